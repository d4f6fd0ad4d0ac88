"""Scores of a predicted centroid cloud against the true one (paper App. "Full Mean Field Results").

At one layer a *cloud* is an ``[N, d]`` array, one row per evaluation type. Every metric first centres
**each cloud by its own mean** over the types (App. "Full Mean Field Results": ``c~_t = c_t - mean_t c_t``
and ``ĉ~_t = ĉ_t - mean_t ĉ_t``), so a shared offset added to either cloud changes nothing. Then:

* :func:`centered_cosine` -- ``mean_t cos(ĉ~_t, c~_t)``: per-type cosine, simple mean over types.
* :func:`rsa` -- Pearson correlation between the off-diagonal entries of the pairwise *cosine-similarity*
  matrices of the centred true and the centred predicted cloud (representation similarity analysis;
  invariant to any rotation and any positive rescaling of either cloud).
* :func:`centered_relative_error` -- ratio of means ``sum_t ||ĉ~_t - c~_t|| / sum_t ||c~_t||``.
* :func:`centered_norm_ratio` -- ``sum_t ||ĉ~_t|| / sum_t ||c~_t||`` (1 ideal, > 1 overshoot).

:func:`score_cloud` gives all four for one layer, :func:`score_layers` for a stack of layers
``[L', N, d]``, and :func:`cross_layer_summary` the cross-layer mean with its standard error over layers
(``std(ddof=1) / sqrt(n_layers)``, Table 1 / ``tab:qwen-pinned``).

Everything is float64 numpy; inputs may be numpy arrays or torch tensors.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

__all__ = [
    "METRICS",
    "center",
    "per_type_cosine",
    "centered_cosine",
    "rsa",
    "centered_relative_error",
    "centered_norm_ratio",
    "score_cloud",
    "score_layers",
    "cross_layer_summary",
    "summarize_scores",
]

#: metric names in the order the paper lists them
METRICS: tuple[str, ...] = ("cosine", "rsa", "rel_error", "norm_ratio")

_EPS = 1e-12


def _as_f64(x) -> np.ndarray:
    if hasattr(x, "detach"):  # torch tensor
        x = x.detach().cpu().double().numpy()
    return np.asarray(x, dtype=np.float64)


def _pair(pred, true) -> tuple[np.ndarray, np.ndarray]:
    p, t = _as_f64(pred), _as_f64(true)
    if p.shape != t.shape:
        raise ValueError(f"prediction shape {p.shape} != truth shape {t.shape}")
    if p.ndim < 2:
        raise ValueError(f"a cloud is [..., N types, d]; got shape {p.shape}")
    return p, t


def center(x) -> np.ndarray:
    """``x - mean over types``: subtract the cloud's own mean (axis ``-2``) from every row."""
    x = _as_f64(x)
    return x - x.mean(axis=-2, keepdims=True)


def per_type_cosine(pred, true) -> np.ndarray:
    """``[..., N]`` cosine between each type's centred prediction and centred truth (0 for a zero vector; NaN where
    either cloud has NaN: a hybrid's layer of another mixer has no attention output to score, not a cosine of 0)."""
    p, t = _pair(pred, true)
    p, t = center(p), center(t)
    num = (p * t).sum(-1)
    den = np.linalg.norm(p, axis=-1) * np.linalg.norm(t, axis=-1)
    return np.where(den > _EPS, num / np.maximum(den, _EPS), np.where(np.isnan(den), np.nan, 0.0))


def centered_cosine(pred, true) -> float:
    """Mean over types of the per-type cosine of the centred clouds (``[N, d]`` each)."""
    return float(per_type_cosine(pred, true).mean(-1))


def _cosine_similarity_matrix(x: np.ndarray) -> np.ndarray:
    n = np.linalg.norm(x, axis=-1, keepdims=True)
    u = x / np.maximum(n, _EPS)
    return u @ u.T


def rsa(pred, true) -> float:
    """Pearson r between the off-diagonal pairwise cosine similarities of the centred true cloud and of the
    centred predicted cloud (upper triangle; the matrices are symmetric). ``nan`` if either list is constant
    (e.g. fewer than 3 types)."""
    p, t = _pair(pred, true)
    if p.ndim != 2:
        raise ValueError(f"rsa takes one layer's clouds [N, d]; got {p.shape}")
    iu = np.triu_indices(p.shape[0], k=1)
    a = _cosine_similarity_matrix(center(t))[iu]
    b = _cosine_similarity_matrix(center(p))[iu]
    a = a - a.mean()
    b = b - b.mean()
    den = np.sqrt((a * a).sum() * (b * b).sum())
    if not den > _EPS:
        return float("nan")
    return float((a * b).sum() / den)


def centered_relative_error(pred, true) -> float:
    """Ratio of means ``sum_t ||ĉ~_t - c~_t|| / sum_t ||c~_t||`` (0 ideal)."""
    p, t = _pair(pred, true)
    p, t = center(p), center(t)
    return float(np.linalg.norm(p - t, axis=-1).sum(-1) / max(np.linalg.norm(t, axis=-1).sum(-1), _EPS))


def centered_norm_ratio(pred, true) -> float:
    """``sum_t ||ĉ~_t|| / sum_t ||c~_t||``: the predicted cloud's mean radius over the true one's (1 ideal)."""
    p, t = _pair(pred, true)
    p, t = center(p), center(t)
    return float(np.linalg.norm(p, axis=-1).sum(-1) / max(np.linalg.norm(t, axis=-1).sum(-1), _EPS))


def score_cloud(pred, true, metrics: Sequence[str] = METRICS) -> dict[str, float]:
    """All requested metrics (names from :data:`METRICS`) for one layer's clouds ``[N, d]``."""
    fns = {
        "cosine": centered_cosine,
        "rsa": rsa,
        "rel_error": centered_relative_error,
        "norm_ratio": centered_norm_ratio,
    }
    unknown = set(metrics) - set(fns)
    if unknown:
        raise ValueError(f"unknown metric(s) {sorted(unknown)}; known: {METRICS}")
    return {m: fns[m](pred, true) for m in metrics}


def score_layers(pred, true, metrics: Sequence[str] = METRICS) -> dict[str, np.ndarray]:
    """Per-layer scores of stacked clouds ``[L', N, d]`` -> ``{metric: [L']}``."""
    p, t = _pair(pred, true)
    if p.ndim != 3:
        raise ValueError(f"score_layers takes [layers, N, d]; got {p.shape}")
    rows = [score_cloud(p[i], t[i], metrics) for i in range(p.shape[0])]
    return {m: np.array([r[m] for r in rows]) for m in metrics}


def cross_layer_summary(values, layers=None) -> tuple[float, float]:
    """(mean, standard error over layers) of a per-layer score ``[L']``; ``layers`` selects entries
    (index array or slice; ``None`` = all). SE = ``std(ddof=1)/sqrt(n)`` (``nan`` for one layer);
    ``nan`` entries are dropped."""
    v = _as_f64(values).reshape(-1)
    if layers is not None:
        v = v[layers]
    v = v[np.isfinite(v)]
    if v.size == 0:
        return float("nan"), float("nan")
    se = float(v.std(ddof=1) / np.sqrt(v.size)) if v.size > 1 else float("nan")
    return float(v.mean()), se


def summarize_scores(scores: Mapping[str, np.ndarray], layers=None) -> dict[str, tuple[float, float]]:
    """:func:`cross_layer_summary` of every metric of a :func:`score_layers` result."""
    return {m: cross_layer_summary(v, layers) for m, v in scores.items()}
