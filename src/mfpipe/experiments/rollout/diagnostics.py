"""Per-layer diagnostics computed from the corpus-pass sums: within-type clustering and the value-map
Jensen gap (App. D ``app:clustering``), anisotropy (App. H ``app:anisotropy``) and the MLP gap (App. K
``app:mlp-gap``). Pure functions of numpy arrays (plus the adapter's block pieces where a map must be
applied at a centroid).

Sums each function needs (``N`` tracked types = query buckets ``0..N-1``; sums run over the positions
``j >= 1`` whose type is tracked; accumulate in float64 -- the sums of squares cancel catastrophically in
float32 when a cloud sits far from the origin)::

    clustering_metrics   counts   [N]          n_t, occurrences of type t        (stats: query_count)
                         sums     [L', N, d]   sum_i x_{t,i}                     (stats: resid_sum[:, :N])
                         sumsq    [L', N, d]   sum_i x_{t,i,d}^2 per dim         (stats: resid_sq_sum[:, :N])
    value_jensen_gap     norm_mean [L, N, d]   mean_i attn_input_norm_l(x_{t,i})  (stats: ln_in_mean)
                         centroids [L, N, d]   c_t
    value_jensen_gap_mu  mu       [L, H, N(+2), dh]  mean per-head value of type-t keys (value_sum / key_count)
                         centroids [L, N, d]
    anisotropy           centroids [L', N, d]
    mlp_gap              mlp_in_mean  [L, N, d] mean of the residual the MLP branch reads
                                               (sequential: resid_mid_sum / n; GPT-NeoX parallel: the centroid)
                         mlp_out_mean [L, N, d] mean of what the MLP branch adds (mlp_out_sum / n)

``L'`` is any set of residual depths (App. D uses the block inputs ``E[l]``, ``l = 0..L-1``).
"""

from __future__ import annotations

import numpy as np
import torch

from mfpipe.experiments.rollout import metrics as _m
from mfpipe.models.adapters.forms import has_side_mixer

__all__ = [
    "type_means",
    "clustering_metrics",
    "value_jensen_gap",
    "value_jensen_gap_mu",
    "gap_summary",
    "anisotropy",
    "mlp_input_means",
    "mlp_gap",
]

_EPS = 1e-30


def _f64(x) -> np.ndarray:
    if hasattr(x, "detach"):
        x = x.detach().cpu().double().numpy()
    return np.asarray(x, dtype=np.float64)


def type_means(sums, counts) -> np.ndarray:
    """``sums [..., N, d] / counts [N]`` (types with zero count -> NaN rows)."""
    s, n = _f64(sums), _f64(counts).reshape(-1)
    if s.shape[-2] != n.shape[0]:
        raise ValueError(f"sums have {s.shape[-2]} types, counts {n.shape[0]}")
    with np.errstate(invalid="ignore", divide="ignore"):
        return s / np.where(n > 0, n, np.nan)[:, None]


# --------------------------------------------------------------------------------------- App. D
def clustering_metrics(counts, sums, sumsq) -> dict[str, np.ndarray]:
    """Within-type clustering per layer (App. D, ``fig:clustering`` panels A-B).

    ``counts [N]`` (n_t), ``sums [L', N, d]`` (sum_i x), ``sumsq [L', N, d]`` (sum_i x_d^2 per dim). Types with
    ``n_t = 0`` are dropped. Returns, with ``c_t = sums/n_t``, global centroid ``cbar`` (occurrence-weighted)::

        rel_rms      [L', N]  r_t = sqrt(mean_i ||x_{t,i} - c_t||^2) / ||c_t||    (NaN for dropped types)
        eta2         [L']     1 - V_w / V_tot   (pooled within-type over total variance, summed over dims)
        eta2_z       [L']     mean_d (1 - w_d / sigma^2_d)   (per-dim; dims with sigma^2_d = 0 skipped)
        v_within     [L']     V_w = (1/n) sum_{t,i} ||x - c_t||^2
        v_total      [L']     V_tot = (1/n) sum_{t,i} ||x - cbar||^2
    """
    n = _f64(counts).reshape(-1)
    S, Q = _f64(sums), _f64(sumsq)
    if S.ndim == 2:
        S, Q = S[None], Q[None]
    if S.shape != Q.shape or S.shape[-2] != n.shape[0]:
        raise ValueError(f"sums {S.shape}, sumsq {Q.shape} and counts {n.shape} disagree")
    keep = n > 0
    nk = n[keep]
    Sk, Qk = S[:, keep], Q[:, keep]
    ntot = nk.sum()
    c = Sk / nk[:, None]  # [L', Nk, d]
    # per type per dim within sum of squares: Q - n c^2
    within_td = np.maximum(Qk - nk[:, None] * c**2, 0.0)
    w_d = within_td.sum(1) / ntot  # [L', d]  pooled within-type variance per dim
    mean_d = Sk.sum(1) / ntot
    sigma2_d = np.maximum(Qk.sum(1) / ntot - mean_d**2, 0.0)  # [L', d]
    v_w = w_d.sum(-1)
    v_tot = sigma2_d.sum(-1)
    eta2 = np.where(v_tot > _EPS, 1.0 - v_w / np.maximum(v_tot, _EPS), np.nan)
    ok = sigma2_d > _EPS
    ratio = np.where(ok, w_d / np.where(ok, sigma2_d, 1.0), 0.0)
    eta2_z = np.where(ok.any(-1), (ok * (1.0 - ratio)).sum(-1) / np.maximum(ok.sum(-1), 1), np.nan)
    rel = np.full((S.shape[0], n.shape[0]), np.nan)
    cn = np.linalg.norm(c, axis=-1)
    rel[:, keep] = np.sqrt(within_td.sum(-1) / nk) / np.where(cn > 0, cn, np.nan)
    return {"rel_rms": rel, "eta2": eta2, "eta2_z": eta2_z, "v_within": v_w, "v_total": v_tot}


def _gap(mean_map: np.ndarray, map_at_c: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(relative magnitude ||E f(x) - f(c)|| / ||f(c)||, direction 1 - cos(E f(x), f(c))) over the last axis."""
    diff = np.linalg.norm(mean_map - map_at_c, axis=-1)
    nc = np.linalg.norm(map_at_c, axis=-1)
    nm = np.linalg.norm(mean_map, axis=-1)
    rel = diff / np.where(nc > 0, nc, np.nan)
    cos = (mean_map * map_at_c).sum(-1) / np.where(nc * nm > 0, nc * nm, np.nan)
    return rel, 1.0 - cos


@torch.no_grad()
def value_jensen_gap(adapter, norm_mean, centroids) -> dict[str, np.ndarray]:
    """App. D panel C, as the paper defines it: the Jensen gap of the attention block's input normaliser,
    ``rel = ||E[ln_1 x_t] - ln_1 c_t|| / ||ln_1 c_t||`` and ``dir = 1 - cos(E[ln_1 x_t], ln_1 c_t)``, per layer
    and type (``[L, N]`` each). ``ln_1`` is ``adapter.attn_input_norm`` (incl. its affine; identity for OLMo-2,
    whose gap is then 0). ``norm_mean [L, N, d]`` = per-type mean of ``attn_input_norm_l(x)`` over occurrences,
    ``centroids [L(+1), N, d]``."""
    nm = _f64(norm_mean)
    L = nm.shape[0]
    rel, dirn = [], []
    for layer in range(L):
        c = torch.as_tensor(_f64(centroids[layer]), dtype=torch.float32, device=adapter.device)
        if layer not in getattr(adapter, "attention_layers", range(L)):  # a hybrid's other block: no norm, NaN
            rel.append(np.full(c.shape[0], np.nan))
            dirn.append(rel[-1])
            continue
        lc = adapter.attn_input_norm(layer, c).double().cpu().numpy()
        r, d = _gap(nm[layer], lc)
        rel.append(r)
        dirn.append(d)
    return {"rel": np.stack(rel), "dir": np.stack(dirn)}


@torch.no_grad()
def value_jensen_gap_mu(adapter, mu, centroids) -> dict[str, np.ndarray]:
    """The value-map Jensen gap measured on the values themselves: ``mu_t - v(c_t)`` per head
    (sec. 3.2 footnote), ``rel = ||mu_t - v(c_t)|| / ||v(c_t)||`` and ``dir = 1 - cos(mu_t, v(c_t))``, each
    ``[L, H, N]``. ``mu [L, H, N(+2), dh]`` (only the tracked columns are used), ``centroids [L(+1), N, d]``.
    Note the value bias is inside both ``mu_t`` and ``v(c_t)`` (App. D's ``ln_1`` version excludes ``W_V``)."""
    M = _f64(mu)
    L = M.shape[0]
    rel, dirn = [], []
    for layer in range(L):
        c = _f64(centroids[layer])
        n = c.shape[0]
        if layer not in getattr(adapter, "attention_layers", range(L)):  # a hybrid's other block: no values, NaN
            rel.append(np.full((M.shape[1], n), np.nan))
            dirn.append(rel[-1])
            continue
        v = adapter.value_map(layer, torch.as_tensor(c, dtype=torch.float32, device=adapter.device))
        v = v.double().cpu().numpy().transpose(1, 0, 2)  # [H, N, dh]
        r, d = _gap(M[layer][:, :n], v)
        rel.append(r)
        dirn.append(d)
    return {"rel": np.stack(rel), "dir": np.stack(dirn)}


def gap_summary(values, axis: int = -1) -> dict[str, np.ndarray]:
    """Median and inter-quartile band over types (``axis``), NaNs ignored: ``{"median", "q25", "q75"}``."""
    v = _f64(values)
    q = np.nanpercentile(v, [25, 50, 75], axis=axis)
    return {"q25": q[0], "median": q[1], "q75": q[2]}


# --------------------------------------------------------------------------------------- App. H
def anisotropy(centroids) -> dict[str, np.ndarray]:
    """``tab:anisotropy`` per layer of ``centroids [L', N, d]``: ``norm_mean`` = ||cbar|| with
    ``cbar = (1/N) sum_t c_t``; ``mean_dist`` = mean_t ||c_t - cbar||; ``ratio`` = mean_dist / ||cbar||."""
    c = _f64(centroids)
    if c.ndim == 2:
        c = c[None]
    cbar = c.mean(axis=1)
    nb = np.linalg.norm(cbar, axis=-1)
    dist = np.linalg.norm(c - cbar[:, None], axis=-1).mean(axis=1)
    return {"norm_mean": nb, "mean_dist": dist, "ratio": dist / np.where(nb > 0, nb, np.nan)}


# --------------------------------------------------------------------------------------- App. K
def mlp_input_means(adapter, centroids, resid_mid_mean=None, mlp_out_mean=None) -> np.ndarray:
    """``[L, N, d]`` mean of the residual each layer's MLP branch reads: the post-attention residual
    ``resid_mid`` for sequential blocks (``resid_mid_mean``, e.g. ``resid_mid_sum / n``), the block input
    ``c^l`` for GPT-NeoX parallel residual; where a mixer beside the attention adds a branch of its own (Falcon-H1:
    ``resid_mid`` is the heads' alone), the next block's input less the MLP branch (``centroids [L+1, N, d]``,
    ``mlp_out_mean [L, N, d]``)."""
    L = adapter.n_layers
    if adapter.parallel_residual:
        return _f64(centroids)[:L]
    if has_side_mixer(adapter) and mlp_out_mean is not None:
        return _f64(centroids)[1:L + 1] - _f64(mlp_out_mean)[:L]
    if resid_mid_mean is None:
        raise ValueError("sequential blocks need resid_mid_mean (the mean post-attention residual)")
    return _f64(resid_mid_mean)[:L]


@torch.no_grad()
def mlp_gap(adapter, mlp_in_mean, mlp_out_mean, types=None) -> dict[str, np.ndarray]:
    """App. K ``tab:mlp-gap``: per layer, the MLP applied once at the mean input ``MLP_l(m_s)`` vs the
    occurrence-mean MLP contribution ``E_occ[MLP_l(m)]``, scored like the rollout (centred clouds):
    ``cosine`` (mean over types of the centred cosine) and ``rel_error`` (ratio of means), plus ``rsa`` and
    ``norm_ratio``; each ``[L]``. Also returns ``at_mean [L, N, d]``.

    ``mlp_in_mean [L, N, d]`` (:func:`mlp_input_means`), ``mlp_out_mean [L, N, d]`` (``mlp_out_sum / n``);
    ``types``: optional index of the types to score (e.g. those with a positive count)."""
    m_in, m_out = _f64(mlp_in_mean), _f64(mlp_out_mean)
    if m_in.shape != m_out.shape:
        raise ValueError(f"mlp_in_mean {m_in.shape} and mlp_out_mean {m_out.shape} differ")
    L = m_in.shape[0]
    at = []
    for layer in range(L):
        if layer not in getattr(adapter, "attention_layers", range(L)):  # a hybrid's other block: no MLP branch read
            at.append(np.full(m_in[layer].shape, np.nan))
            continue
        x = torch.as_tensor(m_in[layer], dtype=torch.float32, device=adapter.device)
        at.append(adapter.mlp(layer, x).double().cpu().numpy())
    at_mean = np.stack(at)
    p, t = (at_mean, m_out) if types is None else (at_mean[:, types], m_out[:, types])
    scores = _m.score_layers(p, t)
    scores["at_mean"] = at_mean
    return scores
