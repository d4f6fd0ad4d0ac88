"""The regressions and subspace measures of App. positional (Layer-1 positional transport), on arrays (numpy only).

A head's within-type write deviation ``Δ = z_sX − z̄_s`` per query occurrence is held either in head space
``[n, dh]`` with the head's residual-unit metric ``G = O_h O_hᵀ`` (``dh x dh``: ``‖O_h v‖² = vᵀ G v``), or in residual
units ``[n, d]`` (``G`` = None). Every "share of variance" is about the mean (centred), in that metric, so a fit in
head space gives exactly the share of the residual-unit write ``Δ O_h`` (OLS commutes with the linear map ``O_h``).

* :func:`position_basis` / :func:`posvar`: the smooth position function of the paper (an intercept and
  ``{p̃, p̃², sin 2πkp̃, cos 2πkp̃ : k = 1..4}``, ``p̃ = p / T``: 11 regressors) and the share of Δ's variance it
  explains.
* :func:`code_features` / :func:`wpos_share`: Δ regressed on the position code ``W_pos[p]`` — on its top principal
  components over the kept positions (``W_pos[8:T]`` has few effective dimensions; with as many components as
  distinct positions any function of ``p`` would count as a "linear image").
* :func:`explained_share`: the OLS share for any regressors (offset features, a(p) alone, both).
* :func:`ridge_decode`: cross-validated ridge R² of decoding ``p`` from Δ, beside a position-shuffled baseline.
* :func:`subspace`, :func:`principal_overlap`, :func:`chance_overlap`, :func:`participation_ratio`,
  :func:`share_in_span`, :func:`leading_share`: the geometry of the writes (principal angles, the code's own span).
"""

from __future__ import annotations

import numpy as np

__all__ = ["position_basis", "explained_share", "posvar", "code_features", "wpos_share", "ridge_decode", "principal",
           "subspace",
           "principal_overlap", "chance_overlap", "participation_ratio", "share_in_span", "leading_share",
           "fitted", "offset_features", "N_FOURIER"]

N_FOURIER = 4  # sin / cos pairs of the position basis (the paper's k = 1..4)


def position_basis(p, T: int) -> np.ndarray:
    """``[n, 10]`` float64: ``p̃, p̃², sin 2πkp̃, cos 2πkp̃`` (k = 1..4) of positions ``p`` (``p̃ = p / T``); with the
    intercept the fits add, the paper's 11 regressors."""
    x = np.asarray(p, dtype=np.float64) / float(T)
    cols = [x, x * x]
    for k in range(1, N_FOURIER + 1):
        cols += [np.sin(2 * np.pi * k * x), np.cos(2 * np.pi * k * x)]
    return np.stack(cols, axis=1)


def _centre(a: np.ndarray) -> np.ndarray:
    a = np.asarray(a, dtype=np.float64)
    return a - a.mean(0, keepdims=True)


def fitted(Y, X) -> np.ndarray:
    """The OLS fit of every column of ``Y [n, m]`` on an intercept and ``X [n, k]``, centred (``[n, m]``): the part
    of ``Y``'s variation about its mean the regressors explain (least squares: rank-deficient ``X`` allowed)."""
    Yc, Xc = _centre(Y), _centre(np.asarray(X, dtype=np.float64).reshape(len(Y), -1))
    if Xc.shape[1] == 0 or not np.any(Xc):
        return np.zeros_like(Yc)
    beta, *_ = np.linalg.lstsq(Xc, Yc, rcond=None)
    return Xc @ beta


def _energy(Yc: np.ndarray, G) -> float:
    return float(np.einsum("ni,ij,nj->", Yc, G, Yc)) if G is not None else float((Yc * Yc).sum())


def explained_share(Y, X, G=None) -> float:
    """The share of ``Y``'s variance about its mean (in the metric ``G``; None: Euclidean) explained by the OLS fit
    on an intercept and ``X``; NaN when ``Y`` does not vary."""
    Yc = _centre(Y)
    total = _energy(Yc, G)
    if not total > 0:
        return float("nan")
    return _energy(fitted(Y, X), G) / total


def posvar(delta, p, T: int, G=None) -> float:
    """posVar: the share of Δ's variance about its mean explained by the smooth position function of
    :func:`position_basis` (OLS, 11 regressors with the intercept)."""
    return explained_share(delta, position_basis(p, T), G)


def code_features(W_pos, positions, kept, k: int = 10) -> np.ndarray:
    """The position code of each occurrence as regressors: the scores of ``W_pos[p]`` on the top ``k`` principal
    components of the centred code over the ``kept`` positions (``W_pos [T, d]``; ``positions [n]``)."""
    W = np.asarray(W_pos, dtype=np.float64)
    rows = W[np.asarray(kept, dtype=np.int64)]
    mean = rows.mean(0)
    axes = principal(rows)[1][:, : int(k)]
    return (W[np.asarray(positions, dtype=np.int64)] - mean) @ axes


def wpos_share(delta, positions, W_pos, kept, k: int = 10, G=None) -> float:
    """The share of Δ's variance that is a linear image of the position code ``W_pos[p]`` (OLS on
    :func:`code_features`)."""
    return explained_share(delta, code_features(W_pos, positions, kept, k), G)


def ridge_decode(X, y, *, alpha: float = 1.0, folds: int = 5, seed: int = 0) -> tuple[float, float]:
    """Cross-validated R² of decoding ``y`` (the query position) from ``X [n, m]`` by ridge regression (standardised
    features, ``alpha``), and the same with ``y`` shuffled (the baseline, ≈ 0 or below) -> (R², shuffled R²)."""
    X = np.asarray(X, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    rng = np.random.default_rng(seed)
    fold = rng.permutation(len(y)) % max(2, int(folds))

    def cv(target):
        pred = np.empty_like(target)
        for f in np.unique(fold):
            tr, te = fold != f, fold == f
            mu, sd = X[tr].mean(0), X[tr].std(0)
            sd[sd == 0] = 1.0
            A, b = (X[tr] - mu) / sd, target[tr] - target[tr].mean()
            w = np.linalg.solve(A.T @ A + alpha * np.eye(A.shape[1]), A.T @ b)
            pred[te] = (X[te] - mu) / sd @ w + target[tr].mean()
        ss = float(((target - target.mean()) ** 2).sum())
        return 1.0 - float(((target - pred) ** 2).sum()) / ss if ss > 0 else float("nan")

    return cv(y), cv(rng.permutation(y))


def principal(V) -> tuple[np.ndarray, np.ndarray]:
    """The principal axes of the centred rows of ``V [n, d]``: (variances along them, descending ``[r]``; the axes
    ``[d, r]``), from the ``d x d`` scatter matrix (``n`` is the occurrences: far more than ``d``) or, where ``n < d``,
    from the SVD of the rows."""
    Vc = _centre(V)
    n, d = Vc.shape
    if n >= d:
        w, U = np.linalg.eigh(Vc.T @ Vc)
        order = np.argsort(w)[::-1]
        return np.clip(w[order], 0, None), U[:, order]
    _, s, vt = np.linalg.svd(Vc, full_matrices=False)
    return s * s, vt.T


def subspace(V, k: int) -> np.ndarray:
    """An orthonormal basis ``[d, k]`` of the top-``k`` principal directions of the rows of ``V [n, d]`` (centred)."""
    return principal(V)[1][:, : int(k)]


def principal_overlap(A, B) -> float:
    """Mean ``cos²`` of the principal angles between the column spans of ``A [d, a]`` and ``B [d, b]`` (the mean over
    ``min(a, b)`` angles; 1: one span inside the other, 0: orthogonal)."""
    qa, _ = np.linalg.qr(np.asarray(A, dtype=np.float64))
    qb, _ = np.linalg.qr(np.asarray(B, dtype=np.float64))
    s = np.linalg.svd(qa.T @ qb, compute_uv=False)
    return float(np.mean(np.clip(s, 0, 1) ** 2))


def chance_overlap(a: int, b: int, d: int) -> float:
    """The expected :func:`principal_overlap` of random subspaces of dimensions ``a`` and ``b`` in ``R^d``:
    ``E tr(P_A P_B) = ab / d`` over ``min(a, b)`` angles, ``max(a, b) / d``."""
    return max(int(a), int(b)) / float(d)


def participation_ratio(X) -> float:
    """Effective dimensions of the centred rows of ``X``: ``(Σλ)² / Σλ²`` over its covariance eigenvalues."""
    s = principal(X)[0]
    return float(s.sum() ** 2 / (s * s).sum()) if s.sum() > 0 else float("nan")


def share_in_span(V, basis) -> float:
    """The share of the centred rows of ``V [n, d]``'s variance inside the span of ``basis [d, k]`` (orthonormalised)."""
    Vc = _centre(V)
    q, _ = np.linalg.qr(np.asarray(basis, dtype=np.float64))
    total = float((Vc * Vc).sum())
    return float(((Vc @ q) ** 2).sum()) / total if total > 0 else float("nan")


def leading_share(V, k: int) -> float:
    """The share of the centred rows of ``V``'s variance on its top ``k`` singular directions."""
    s = principal(V)[0]
    return float(s[: int(k)].sum() / s.sum()) if s.sum() > 0 else float("nan")


def offset_features(offsets, small: int = 8, bins=(16, 32, 64, 128, 256)) -> np.ndarray:
    """The relative-code regressors of attended-key offsets ``o = p − k``: one-hot ``o = 0..small-1`` and coarse bins
    ``[small, b1), [b1, b2), ..., [b_last, ∞)`` (the intercept is the fits')."""
    o = np.asarray(offsets, dtype=np.int64)
    cols = [(o == i) for i in range(int(small))]
    edges = [int(small), *[int(b) for b in bins], np.iinfo(np.int64).max]
    cols += [(o >= lo) & (o < hi) for lo, hi in zip(edges[:-1], edges[1:])]
    return np.stack(cols, axis=1).astype(np.float64)
