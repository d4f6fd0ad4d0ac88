"""Kernel dynamics across training (paper Sec. 5.3 ``sec:kernel-dynamics``, App. N ``app:waypoint-kernel``).

The compared object is the per-key kernel ``W = P / nbar`` of one checkpoint (App. A; ``nbar`` is a model-free
token count, identical at every checkpoint of one corpus sample, so dividing by it removes the frequency
weighting of ``P`` and leaves the attention pattern). Per head, ``W`` is an ``N x K`` matrix: rows the query types
``s``, columns the key buckets ``t``.

Support (:func:`support_mask`): the type pairs with context count ``C_st >= min_count`` (20) -- "all kernel-level
comparisons are restricted to type pairs with context count >= 20" -- and only the *tracked* key columns
``t < N``. The ``<bos>`` and ``<other>`` columns are excluded, because App. N speaks of *type pairs* and of how a
head "divides its attention among the types present", and neither column is a per-key rate of a type: ``<bos>``
has ``nbar = 1`` in every context, so its ``W`` entry is the whole sink mass ``P_s,bos`` (~0.4, hundreds of times a
type's per-key rate) and would dominate the quadratic CKA and the row spread; ``<other>`` pools every untracked
type into one averaged rate. Off-support entries are set to 0 (a zero column stays zero after centring and adds
nothing to a Gram matrix, so masking a column is the same as dropping it); NaN rows (types never seen as a query)
are set to 0.

Linear CKA (App. N): per head, the masked kernel ``X`` is column-centred (each key column minus its mean over query
types) and replaced by its rank-``r`` SVD approximant ``U_r S_r V_r^T`` (r = 96). Because linear CKA depends on
``X`` only through the Gram matrix ``X X^T`` and ``V_r`` is orthonormal, it is computed *exactly* from the factor
``F = U_r S_r`` ``[N, r]``::

    CKA(X, Y) = ||F_x^T F_y||_F^2 / (||F_x^T F_x||_F ||F_y^T F_y||_F)

(with the full rank this is the textbook ``||Y_c^T X_c||_F^2 / (||X_c^T X_c||_F ||Y_c^T Y_c||_F)``). Averaged
over heads (all layers) for the every-pair matrix and the adjacent-checkpoint curve.

Row spread (App. N "Row uniformity"): per head, ``mean_s std_t log W[s, t]`` over the supported tracked key
types with ``W > 0`` (population std, ``ddof = 0``), over the rows with at least two such entries; the figure
shows the fold-variation ``exp(spread)`` (1 = uniform attention across the types present).

Pure functions on arrays (numpy in, numpy out; torch is used for the batched linear algebra).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

__all__ = [
    "DEFAULT_RANK",
    "adjacent_cka",
    "check_same_source",
    "cka_matrix",
    "cka_per_head",
    "dynamics_tables",
    "kernel_dataset",
    "kernel_factors",
    "linear_cka",
    "masked_kernel",
    "open_kernel",
    "open_model_kernels",
    "row_spread",
    "support_fingerprint",
    "support_mask",
]

DEFAULT_RANK = 96
DEFAULT_MIN_COUNT = 20


def support_mask(context_count, n_tracked: int | None = None, min_count: int = DEFAULT_MIN_COUNT) -> np.ndarray:
    """Boolean ``[N, K]``: ``C_st >= min_count`` on the tracked key columns ``t < N``; ``<bos>`` (``N``) and
    ``<other>`` (``N+1``) columns False (see the module docstring). ``context_count [N, K]``; ``n_tracked``
    defaults to its number of rows."""
    C = np.asarray(context_count)
    n = C.shape[0] if n_tracked is None else int(n_tracked)
    mask = C >= max(int(min_count), 1)
    mask[:, n:] = False
    return mask


def support_fingerprint(mask: np.ndarray) -> str:
    """sha256 of a support mask (shape and bits): equal supports <=> equal fingerprints."""
    m = np.ascontiguousarray(np.asarray(mask, dtype=bool))
    h = hashlib.sha256(np.asarray(m.shape, dtype=np.int64).tobytes())
    h.update(np.packbits(m.ravel()).tobytes())
    return h.hexdigest()


def masked_kernel(W_layer, mask) -> np.ndarray:
    """``W [H, N, K]`` restricted to ``mask [N, K]`` (0 elsewhere), NaN rows -> 0, as float64."""
    W = np.asarray(W_layer, dtype=np.float64)
    m = np.asarray(mask, dtype=bool)
    if W.shape[-2:] != m.shape:
        raise ValueError(f"kernel has shape {W.shape}, the support mask {m.shape}; expected [H, N, K] and [N, K]")
    return np.where(m[None] & np.isfinite(W), W, 0.0)


def kernel_factors(W_layer, mask, rank: int = DEFAULT_RANK) -> np.ndarray:
    """Per head the column-centred rank-``r`` SVD factor ``F = U_r S_r``: ``[H, N, r]`` float64 with
    ``r = min(rank, N)`` (columns in decreasing singular value; trailing zero columns where the kernel has lower
    rank). ``F F^T`` is the rank-r approximant of the Gram matrix ``X_c X_c^T`` of the centred masked kernel.

    Computed from the eigen-decomposition of that ``N x N`` Gram matrix (float64): ``F = V_r sqrt(lambda_r)``
    equals ``U_r S_r`` up to the signs of its columns, which CKA does not see."""
    import torch

    X = torch.from_numpy(masked_kernel(W_layer, mask))  # [H, N, K]
    X = X - X.mean(dim=1, keepdim=True)  # column-centred: each key column minus its mean over query types
    G = X @ X.transpose(1, 2)  # [H, N, N]
    G = 0.5 * (G + G.transpose(1, 2))
    lam, V = torch.linalg.eigh(G)  # ascending
    r = min(int(rank), X.shape[1])
    lam = lam.flip(-1)[:, :r].clamp(min=0.0)
    V = V.flip(-1)[:, :, :r]
    return (V * lam.sqrt()[:, None, :]).numpy()


def _gram_norm(F) -> np.ndarray:
    """``||F^T F||_F`` per head, ``F [..., N, r]``."""
    F = np.asarray(F, dtype=np.float64)
    return np.linalg.norm(np.swapaxes(F, -1, -2) @ F, axis=(-2, -1))


def linear_cka(Fa, Fb) -> np.ndarray:
    """Linear CKA per head from factors ``[..., N, r]`` (the ranks of ``Fa`` and ``Fb`` may differ):
    ``||Fa^T Fb||_F^2 / (||Fa^T Fa||_F ||Fb^T Fb||_F)``; NaN where a kernel is 0 (nothing to compare)."""
    Fa = np.asarray(Fa, dtype=np.float64)
    Fb = np.asarray(Fb, dtype=np.float64)
    num = np.linalg.norm(np.swapaxes(Fa, -1, -2) @ Fb, axis=(-2, -1)) ** 2
    den = _gram_norm(Fa) * _gram_norm(Fb)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, num / np.where(den > 0, den, 1.0), np.nan)


def cka_per_head(factors: Sequence) -> np.ndarray:
    """``[R, R, L, H]``: CKA of every pair of revisions for every head. ``factors``: one array per revision,
    ``[L, H, N, r]`` (numpy, or anything ``np.asarray`` reads layer by layer, e.g. a lazy xarray variable).
    Symmetric in the revisions, 1 on the diagonal (NaN for an all-zero kernel). Loads one layer of every
    revision at a time."""
    R = len(factors)
    if R == 0:
        return np.zeros((0, 0, 0, 0))
    L, H = np.shape(factors[0])[:2]
    out = np.full((R, R, L, H), np.nan)
    for l in range(L):
        Fl = [np.asarray(f[l], dtype=np.float64) for f in factors]
        for F in Fl[1:]:
            if F.shape[:2] != Fl[0].shape[:2]:
                raise ValueError(f"factors of layer {l} differ in shape: {[f.shape for f in Fl]}")
        norms = [_gram_norm(F) for F in Fl]
        for a in range(R):
            for b in range(a, R):
                num = np.linalg.norm(np.swapaxes(Fl[a], -1, -2) @ Fl[b], axis=(-2, -1)) ** 2
                den = norms[a] * norms[b]
                with np.errstate(invalid="ignore", divide="ignore"):
                    v = np.where(den > 0, num / np.where(den > 0, den, 1.0), np.nan)
                out[a, b, l] = out[b, a, l] = v
    return out


def cka_matrix(factors: Sequence, per_layer: bool = False) -> np.ndarray:
    """Every-pair CKA averaged over heads: ``[R, R]`` (mean over all layers' heads) or, with ``per_layer``,
    ``[L, R, R]`` (mean over the heads of each layer). Heads whose kernel is all zero are left out (nanmean)."""
    c = cka_per_head(factors)
    if per_layer:
        return np.moveaxis(_nanmean(c, axis=3), 2, 0)
    return _nanmean(c.reshape(c.shape[0], c.shape[1], -1), axis=2)


def _nanmean(a: np.ndarray, axis: int) -> np.ndarray:
    a = np.asarray(a, dtype=np.float64)
    ok = np.isfinite(a)
    n = ok.sum(axis=axis)
    s = np.where(ok, a, 0.0).sum(axis=axis)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(n > 0, s / np.maximum(n, 1), np.nan)


def adjacent_cka(matrix) -> np.ndarray:
    """``[R-1]``: CKA between consecutive revisions, ``matrix[i, i+1]`` of an every-pair matrix (``[R, R]`` or
    ``[..., R, R]``)."""
    m = np.asarray(matrix, dtype=np.float64)
    R = m.shape[-1]
    i = np.arange(R - 1)
    return m[..., i, i + 1]


def row_spread(W_layer, mask) -> np.ndarray:
    """``[H]``: per head ``mean_s std_t log W[s, t]`` over the supported tracked key types with ``W > 0``
    (population std), over the rows with >= 2 such entries; NaN for a head with no such row."""
    W = masked_kernel(W_layer, mask)
    ok = W > 0
    logw = np.log(np.where(ok, W, 1.0))
    n = ok.sum(-1)  # [H, N]
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.where(ok, logw, 0.0).sum(-1) / np.maximum(n, 1)
        var = np.where(ok, (logw - mean[..., None]) ** 2, 0.0).sum(-1) / np.maximum(n, 1)
    rows = n >= 2
    std = np.sqrt(var)
    cnt = rows.sum(-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(cnt > 0, np.where(rows, std, 0.0).sum(-1) / np.maximum(cnt, 1), np.nan)


# ------------------------------------------------------------------------------------------------ stores
KERNEL_FORMAT = 1
# what must agree between the kernels of one comparison (same model, tracked set, corpus sample, support, rank)
SAME_SOURCE_KEYS = ("model", "tracked_fingerprint", "n_tracked", "corpus_fingerprint", "context_length", "min_count",
                    "rank", "support_fingerprint")
_COPY_KEYS = ("model", "revision", "half", "model_source", "corpus", "corpus_fingerprint", "half_fingerprint",
              "tracked_fingerprint", "n_tracked", "context_length", "n_tokens", "n_windows", "n_layers", "n_heads",
              "bos_id")


def kernel_dataset(stats, min_count: int = DEFAULT_MIN_COUNT, rank: int = DEFAULT_RANK):
    """One checkpoint's kernel summary as a labelled :class:`xarray.Dataset`, from a statistics store
    (:class:`~mfpipe.stats.api.MeanFieldStats`), one layer at a time:

    * ``factor`` (layer, head, query, rank) float32 -- :func:`kernel_factors` of ``W = P / nbar``;
    * ``spread`` (layer, head) -- :func:`row_spread`;
    * ``rank_energy`` (layer, head) -- share of the centred kernel's squared Frobenius norm the rank-r factor keeps;
    * ``support_size`` -- number of supported (query type, tracked key type) pairs.

    Attributes: the store's provenance (model, revision, tracked and corpus fingerprints, ...), ``min_count``,
    ``rank``, ``support_fingerprint``, ``stats_mfpipe_version`` and this ``mfpipe_version``."""
    import xarray as xr

    from mfpipe.stats.store import code_version

    C = np.asarray(stats.context_count().values)
    mask = support_mask(C, stats.n, min_count)
    L, H, N = stats.n_layers, stats.n_heads, stats.n
    r = min(int(rank), N)
    factor = np.zeros((L, H, N, r), dtype=np.float32)
    spread = np.zeros((L, H))
    energy = np.zeros((L, H))
    for l in range(L):
        W = np.asarray(stats.W(min_count=min_count, layer=l).values, dtype=np.float64)
        F = kernel_factors(W, mask, rank=r)
        factor[l] = F
        spread[l] = row_spread(W, mask)
        X = masked_kernel(W, mask)
        total = ((X - X.mean(1, keepdims=True)) ** 2).sum(axis=(1, 2))
        with np.errstate(invalid="ignore", divide="ignore"):
            energy[l] = np.where(total > 0, (F.astype(np.float64) ** 2).sum(axis=(1, 2)) / np.where(total > 0, total, 1), np.nan)
    q = stats.ds["query"]
    coords = {"layer": np.arange(L), "head": np.arange(H), "query": q.values, "rank": np.arange(r)}
    for name in ("query_str", "query_token_id"):
        if name in stats.ds.coords:
            coords[name] = ("query", stats.ds[name].values)
    attrs = {k: stats.attrs[k] for k in _COPY_KEYS if k in stats.attrs}
    attrs.update({"kind": "kernel_factors", "kernel_format": KERNEL_FORMAT, "min_count": int(min_count), "rank": int(r),
                  "support_fingerprint": support_fingerprint(mask), "support_size": int(mask.sum()),
                  "stats_mfpipe_version": stats.attrs.get("mfpipe_version", "unknown"),
                  "mfpipe_version": code_version()})
    return xr.Dataset(
        {
            "factor": (("layer", "head", "query", "rank"), factor),
            "spread": (("layer", "head"), spread),
            "rank_energy": (("layer", "head"), energy),
            "support_size": ((), np.int64(mask.sum())),
        },
        coords=coords,
        attrs=attrs,
    )


def open_kernel(path):
    """A kernel store written by the ``kernel_revision`` job, opened lazily (``factor`` is read per layer)."""
    from pathlib import Path

    from mfpipe.stats.store import open_zarr

    path = Path(path)
    ds = open_zarr(path, "kernel store", "run its kernel_revision job")
    if ds.attrs.get("kind") != "kernel_factors":
        raise ValueError(f"{path} is not a kernel store (kind={ds.attrs.get('kind')!r})")
    return ds


def check_same_source(datasets, paths, revisions=None) -> None:
    """Refuse kernels that cannot be compared: every store must agree with the first on :data:`SAME_SOURCE_KEYS`
    (model, tracked set, corpus sample, support, rank), and, with ``revisions``, record that revision. Raises
    :class:`~mfpipe.stats.api.ProvenanceError` naming the offending file."""
    from mfpipe.stats.api import ProvenanceError, same_value

    if not datasets:
        raise ValueError("no kernel stores given")
    ref = datasets[0].attrs
    for i, (ds, path) in enumerate(zip(datasets, paths)):
        for key in SAME_SOURCE_KEYS:
            a, b = ds.attrs.get(key), ref.get(key)
            if not same_value(a, b):
                raise ProvenanceError(
                    f"kernel store {path} has {key}={a!r} but {paths[0]} has {b!r}: kernels of different models, "
                    f"tracked sets or corpus samples cannot be compared; rebuild {path} from the matching statistics")
        if revisions is not None and str(ds.attrs.get("revision")) != str(revisions[i]):
            raise ProvenanceError(f"kernel store {path} is for revision {ds.attrs.get('revision')!r}, expected "
                                  f"{revisions[i]!r} at position {i} of the revision list")


def open_model_kernels(paths, model: str, revisions, steps) -> list:
    """The kernel stores of ``model`` at ``revisions`` (training ``steps``), one per path in revision order, opened
    (:func:`open_kernel`) and checked: as many paths as revisions and steps, each of that model, revision and of the
    same source as the first (:func:`check_same_source`). Raises
    :class:`~mfpipe.stats.api.ProvenanceError` naming the offending file."""
    from mfpipe.stats.api import ProvenanceError

    if len(paths) != len(revisions) or len(steps) != len(revisions):
        raise ValueError(f"{len(paths)} kernel stores, {len(revisions)} revisions and {len(steps)} steps: "
                         "they must correspond one to one, in revision order")
    datasets = [open_kernel(p) for p in paths]
    for p, ds in zip(paths, datasets):
        if str(ds.attrs.get("model")) != model:
            raise ProvenanceError(f"kernel store {p} is for model {ds.attrs.get('model')!r}, expected {model!r}")
    check_same_source(datasets, paths, revisions)
    return datasets


def dynamics_tables(datasets, revisions, steps):
    """``(matrix [R, R], cka, adjacent, spread)`` from the kernel stores of one model in revision order.
    ``cka``: every ordered pair (``rev_a, rev_b, step_a, step_b, cka``: mean over all heads); ``adjacent``: the
    consecutive pairs; ``spread``: ``revision, step, layer, head, spread``."""
    import pandas as pd

    revisions = [str(r) for r in revisions]
    steps = [int(s) for s in steps]
    if not (len(datasets) == len(revisions) == len(steps)):
        raise ValueError(f"{len(datasets)} kernels, {len(revisions)} revisions and {len(steps)} steps")
    M = cka_matrix([ds["factor"].variable for ds in datasets])
    R = len(revisions)
    cka = pd.DataFrame([{"rev_a": revisions[a], "rev_b": revisions[b], "step_a": steps[a], "step_b": steps[b],
                         "cka": float(M[a, b])} for a in range(R) for b in range(R)])
    adj = adjacent_cka(M)
    adjacent = pd.DataFrame([{"rev_a": revisions[i], "rev_b": revisions[i + 1], "step_a": steps[i],
                              "step_b": steps[i + 1], "cka": float(adj[i])} for i in range(R - 1)],
                            columns=["rev_a", "rev_b", "step_a", "step_b", "cka"])
    rows = []
    for rev, step, ds in zip(revisions, steps, datasets):
        sp = np.asarray(ds["spread"].values)
        for l in range(sp.shape[0]):
            for h in range(sp.shape[1]):
                rows.append({"revision": rev, "step": step, "layer": l, "head": h, "spread": float(sp[l, h])})
    return M, cka, adjacent, pd.DataFrame(rows)
