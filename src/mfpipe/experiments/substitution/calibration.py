"""Bias of the context-conditional kernel Â and the calibrated kernel U (paper App. B ``app:ccmf-analysis``).

Â_stX = n_t(X) W_st / N_X with N_X = Σ_t' n_t'(X) W_st' (eq:ahat, eq:w-def-appendix). One *model-free corpus
pass* (:func:`corpus_pass`) runs a kernel through this renormalisation over the windows the statistics were
measured on and accumulates, per head (one layer at a time, all heads at once):

* ``Q_sum[h, s, t] = Σ_{type-s queries} Â_stX`` -- the pair weights ``a[h, b, j, k]`` of
  :func:`mfpipe.meanfield.ccmf.pair_kernel` scattered into ``(s_j, kb_k)`` with one ``index_add`` per chunk of windows;
* ``NX_sum[h, s] = Σ N_X`` and ``inv_NX_sum[h, s] = Σ 1 / N_X``;
* ``m[s]`` -- the number of valid type-s queries (tracked type, finite positive N_X in every head).

``Q = Q_sum / m`` is ``E_s[Â_st]``, the kernel's *predicted type marginal*; the measured one is
``P_st = E_s[A_st]``.

**The bias ratio per cell is Q_st / P_st.** Â_stX and A_stX are both 0 whenever t is absent from X, so with
``π_st = Pr_s(t ∈ supp X)``, ``E_s[Â_st] = π_st E_st[Â_st]`` and ``E_s[A_st] = π_st E_st[A_st]``; the presence
probability cancels and ``E_st[Â]/E_st[A] = Q_st / P_st`` -- the quantity ``E_st[n_t/N_X] / E_st[n_t]`` of
eq:bias (``E_st[Â] = W E_st[n_t/N_X]``, ``E_st[A] = W E_st[n_t]`` by eq:target). 1 is unbiased.
:func:`bias_table` reports it with ``E_s[N_X]``, ``E_s[1/N_X]`` and the model-free ``E_st[n_t] = nbar_st n_s / C_st``
(Table ``tab:ahat-empirical-bias``).

**Calibration** (:func:`calibrate`, Alg. ``alg:sinkhorn``): iterative proportional fitting from ``U0 = W``,
``U <- U (P / max(Q, δ))^α`` until ``max |Q - P| < eps`` or ``iterations`` updates, so that
``E_s[Â(U)] = P`` (eq:fixedpoint) and Â(U) is unbiased. ``U`` keeps W's zeros (off the ``C >= min_count``
support, U = 0 stays 0) and NaN rows. Residuals are taken over the cells U can move (``U > 0``, ``P > 0``, a row
with queries): off-support cells have ``Q = 0`` forever, so the ``P`` mass they carry (rare pairs) cannot be
matched; in a row with off-support mass ``1 - c`` the fit tends to ``Q = P / c`` on its support (Â is invariant to
scaling a row of U). The per-iteration table matches Table ``tab:calib2M``: iteration 0 is W's own residual.

Pure functions on tensors / arrays; the store the ``calibrate_kernel`` job writes is :mod:`mfpipe.meanfield.calibrated`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

__all__ = [
    "DEFAULT_ITERATIONS",
    "WITHIN",
    "PassSums",
    "bias_frame",
    "bias_sums",
    "bias_table",
    "calibrate",
    "calibrate_stats",
    "check_windows",
    "corpus_pass",
    "residual_markdown",
    "residuals",
    "window_batches",
]

DEFAULT_ITERATIONS = 5
DEFAULT_MIN_COUNT = 20
WITHIN = 0.2  # "cells within 20% of 1.0"


@dataclass
class PassSums:
    """The sums of one corpus pass of one layer's kernel: ``Q_sum [H, N, K]``, ``NX_sum [H, N]``,
    ``inv_NX_sum [H, N]`` (float64) and ``m [N]`` (int64, valid queries per type)."""

    Q_sum: Any
    NX_sum: Any
    inv_NX_sum: Any
    m: Any

    @property
    def Q(self):
        """``E_s[Â_st]``: ``Q_sum / m`` (torch float64 ``[H, N, K]``), NaN rows where ``m == 0``."""
        m = self.m.to(self.Q_sum.dtype)
        q = self.Q_sum / m.clamp(min=1)[None, :, None]
        return q.masked_fill((self.m == 0)[None, :, None], float("nan"))

    def numpy(self) -> dict[str, np.ndarray]:
        return {k: getattr(self, k).detach().cpu().numpy() for k in ("Q_sum", "NX_sum", "inv_NX_sum", "m")}


def window_batches(tokens, tracked, batch_size: int = 8, device="cpu") -> list[tuple[Any, Any]]:
    """Key buckets and query types of every window, in batches: a list of ``(kb [b, T], qt [b, T])`` int64
    tensors (:func:`mfpipe.stats.buckets.window_buckets`). ``tokens``: one array ``[n, T]`` or a sequence of them
    (the shards of a half, in order); ``tracked``: a :class:`~mfpipe.corpus.tracked.TrackedSet` or the lookup mapping
    :func:`~mfpipe.stats.buckets.bucket_luts` accepts. Computed once, reused by every pass."""
    import torch

    from mfpipe.stats.buckets import bucket_luts, window_buckets

    key_lut, query_lut, n, _ = bucket_luts(tracked)
    arrays = [tokens] if isinstance(tokens, np.ndarray) and np.ndim(tokens) == 2 else list(tokens)
    out = []
    bs = max(1, int(batch_size))
    for arr in arrays:
        arr = np.asarray(arr)
        for b0 in range(0, arr.shape[0], bs):
            kb, qt = window_buckets(arr[b0 : b0 + bs], key_lut, query_lut, n)
            out.append((torch.as_tensor(kb, dtype=torch.int64, device=device),
                        torch.as_tensor(qt, dtype=torch.int64, device=device)))
    return out


def corpus_pass(W, batches: Sequence[tuple[Any, Any]], max_elements: int | None = None, progress: bool = False,
                desc: str = "corpus pass") -> PassSums:
    """Run one layer's kernel ``W [H, N, K]`` (torch or numpy; computed in its float dtype, accumulated in
    float64) through the renormalisation of eq:ahat over every window of ``batches``
    (:func:`window_batches`). Vectorized: :func:`mfpipe.meanfield.ccmf.pair_kernel` per chunk of windows (at most
    ``max_elements`` pair weights ``H b T T`` at once), then ``index_add`` / ``bincount``; no per-position loop."""
    import torch

    from mfpipe.meanfield.ccmf import ZHAT_CHUNK_ELEMENTS, pair_kernel

    W = torch.as_tensor(W)
    if not W.is_floating_point():
        W = W.double()
    H, N, K = W.shape
    dev = W.device
    f64 = {"dtype": torch.float64, "device": dev}
    Q_sum = torch.zeros(H, N * K, **f64)
    NX_sum = torch.zeros(H, N, **f64)
    inv_sum = torch.zeros(H, N, **f64)
    m = torch.zeros(N, dtype=torch.int64, device=dev)
    limit = int(max_elements or ZHAT_CHUNK_ELEMENTS)
    it = batches
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(batches, desc=desc, unit="batch", dynamic_ncols=True, mininterval=2.0)
    for kb_all, qt_all in it:
        kb_all, qt_all = kb_all.to(dev), qt_all.to(dev)
        B, T = kb_all.shape
        step = max(1, limit // max(1, H * T * T))
        for b0 in range(0, B, step):
            kb, qt = kb_all[b0 : b0 + step], qt_all[b0 : b0 + step]
            a, nx, valid = pair_kernel(W, kb, qt)  # [H, b, T, T], [H, b, T], [b, T]
            bv, jv = torch.nonzero(valid, as_tuple=True)
            if bv.numel() == 0:
                continue
            s = qt[bv, jv]  # [q] query types of the valid queries
            idx = (s * K)[:, None] + kb[bv]  # [q, T]: cell (s_j, kb_k) of every key position (a = 0 for k > j)
            Q_sum.index_add_(1, idx.reshape(-1), a[:, bv, jv, :].reshape(H, -1).to(torch.float64))
            nxv = nx[:, bv, jv].to(torch.float64)
            NX_sum.index_add_(1, s, nxv)
            inv_sum.index_add_(1, s, 1.0 / nxv)
            m += torch.bincount(s, minlength=N)
    return PassSums(Q_sum.reshape(H, N, K), NX_sum, inv_sum, m)


# ------------------------------------------------------------------------------------------------ bias table
def _np(x) -> np.ndarray:
    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    return np.asarray(getattr(x, "values", x), dtype=np.float64)


def bias_sums(sums: PassSums, P_layer, nbar, context_count, query_count,
              min_count: int = DEFAULT_MIN_COUNT) -> dict[str, float]:
    """The additive pieces of one layer's row of :func:`bias_table` (so a long run can keep only these): sums and
    counts of ``N_X``, ``1/N_X``, of the ratio ``Q/P`` over the well-sampled tracked cells (``C_st >= min_count``,
    ``P_st > 0``, a row with queries; every head) and of those within 20% of 1, of the ``<bos>`` / ``<other>``
    columns' ratios over their well-sampled cells, and of the model-free ``E_st[n_t] = nbar_st n_s / C_st``."""
    Q = _np(sums.Q)
    P = _np(P_layer)
    H, N, _K = P.shape
    C = _np(context_count)
    nb = _np(nbar)
    qc = _np(query_count)
    m = _np(sums.m)
    well = (C >= max(int(min_count), 1)) & (m > 0)[:, None]  # [N, K]
    cell = well[None] & np.isfinite(P) & (P > 0) & np.isfinite(Q)  # [H, N, K]
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = np.where(cell, Q / np.where(cell, P, 1.0), np.nan)
    tr = ratio[:, :, :N]
    tr_ok = cell[:, :, :N]
    out = {
        "nx_sum": float(_np(sums.NX_sum).sum()),
        "inv_nx_sum": float(_np(sums.inv_NX_sum).sum()),
        "queries": float(m.sum() * H),
        "ratio_sum": float(np.where(tr_ok, tr, 0.0).sum()),
        "within": float((tr_ok & (np.abs(np.where(tr_ok, tr, 1.0) - 1.0) <= WITHIN)).sum()),
        "cells": float(tr_ok.sum()),
    }
    for name, col in (("bos", N), ("other", N + 1)):
        ok = cell[:, :, col]
        out[f"{name}_sum"] = float(np.where(ok, ratio[:, :, col], 0.0).sum())
        out[f"{name}_cells"] = float(ok.sum())
    # model-free E_st[n_t] = E_s[n_t] / pi_st = nbar_st * n_s / C_st over the well-sampled tracked cells
    c_ok = C[:, :N] >= max(int(min_count), 1)
    with np.errstate(invalid="ignore", divide="ignore"):
        ent = nb[:, :N] * qc[:, None] / np.where(c_ok, C[:, :N], 1.0)
    out["ent_sum"] = float(np.where(c_ok, ent, 0.0).sum())
    out["ent_cells"] = float(c_ok.sum())
    return out


def _div(a: float, b: float) -> float:
    return a / b if b else float("nan")


def bias_frame(per_layer: Mapping[Any, Mapping[str, float]] | Sequence[Mapping[str, float]]) -> pd.DataFrame:
    """Rows of Table ``tab:ahat-empirical-bias`` from :func:`bias_sums` per layer, plus ``layer = "all"``:
    ``E_NX`` (E_s[N_X], mean over heads and queries), ``E_inv_NX``, ``E_nt`` (E_st[n_t], model-free, mean over
    well-sampled tracked cells), ``ratio`` (mean of Q/P = E_st[Â]/E_st[A] over well-sampled tracked (head, s, t)
    cells, unweighted), ``within_20pct`` (share of those cells with ratio in [0.8, 1.2]), ``bos_ratio``,
    ``other_ratio`` (the ``<bos>`` / ``<other>`` columns, mean over heads and query types), ``n_cells``."""
    items = list(per_layer.items()) if isinstance(per_layer, Mapping) else list(enumerate(per_layer))
    rows = []

    def row(layer, s):
        return {
            "layer": layer,
            "E_NX": _div(s["nx_sum"], s["queries"]),
            "E_inv_NX": _div(s["inv_nx_sum"], s["queries"]),
            "E_nt": _div(s["ent_sum"], s["ent_cells"]),
            "ratio": _div(s["ratio_sum"], s["cells"]),
            "within_20pct": _div(s["within"], s["cells"]),
            "bos_ratio": _div(s["bos_sum"], s["bos_cells"]),
            "other_ratio": _div(s["other_sum"], s["other_cells"]),
            "n_cells": int(s["cells"]),
        }

    for layer, s in items:
        rows.append(row(str(layer), s))
    if items:
        total = {k: sum(s[k] for _, s in items) for k in items[0][1]}
        # E_st[n_t] is model-free: the same in every layer, not a sum over layers
        total["ent_sum"], total["ent_cells"] = items[0][1]["ent_sum"], items[0][1]["ent_cells"]
        rows.append(row("all", total))
    return pd.DataFrame(rows)


def bias_table(passes, P, nbar, context_count, query_count, min_count: int = DEFAULT_MIN_COUNT) -> pd.DataFrame:
    """Table ``tab:ahat-empirical-bias`` per layer and overall (see :func:`bias_frame`). ``passes``: the
    :class:`PassSums` of ``W`` per layer (a sequence, index = layer, or a mapping layer -> sums); ``P``: the
    attention kernel ``[L, H, N, K]`` (or a mapping layer -> ``[H, N, K]``); ``nbar``, ``context_count``
    ``[N, K]``; ``query_count [N]``."""
    items = passes.items() if isinstance(passes, Mapping) else enumerate(passes)
    per = {layer: bias_sums(s, P[layer], nbar, context_count, query_count, min_count) for layer, s in items}
    return bias_frame(per)


# ------------------------------------------------------------------------------------------------ calibration
def _movable(U, P, m):
    """Cells the fit controls: ``U > 0`` (finite), ``P > 0`` (finite), a row with queries. ``[H, N, K]``."""
    import torch

    return torch.isfinite(U) & (U > 0) & torch.isfinite(P) & (P > 0) & (m > 0)[None, :, None]


def residuals(Q, P, U, m) -> tuple[float, float]:
    """(median ``|Q - P| / P``, max ``|Q - P|``) over the cells the fit controls (see :func:`_movable`)."""
    import torch

    cells = _movable(U, P, m) & torch.isfinite(Q)
    if not bool(cells.any()):
        return float("nan"), float("nan")
    d = (Q - P).abs()[cells]
    return float((d / P[cells]).median()), float(d.max())


def calibrate(W, P, batches: Sequence[tuple[Any, Any]], iterations: int = DEFAULT_ITERATIONS, alpha: float = 1.0,
              delta: float = 1e-12, eps: float = 1e-6, initial: PassSums | None = None, layer: int | None = None,
              evaluate_final: bool = True, max_elements: int | None = None, progress: bool = False,
              dtype=None):
    """Alg. ``alg:sinkhorn`` for one layer, all heads at once. ``W``, ``P`` ``[H, N, K]`` (torch or numpy;
    computed in float64); ``batches`` from :func:`window_batches` over the windows ``P`` was measured on.

    The target is ``P`` restricted to W's support (``W > 0``) and renormalised per row (the only marginal the
    renormalised kernel can reproduce; ``P`` itself when nothing is truncated).

    ``U0 = W``; for k = 0 .. iterations-1: ``Q = E_s[Â(U_k)]`` (:func:`corpus_pass`), stop if
    ``max |Q - P| < eps``, else ``U_{k+1} = U_k (P / max(Q, delta))^alpha`` on the cells the fit controls (elsewhere
    U is unchanged: W's zeros stay 0, NaN rows stay NaN). ``initial``: the pass of ``W`` if already computed (it is
    iteration 0). With ``evaluate_final`` (default) the returned U's own residual is measured too (one more pass;
    the last row, ``iteration = iterations``) unless the loop stopped at ``eps``. ``dtype``: the float type of the
    passes' pair weights (default float64; float32 halves the time, the sums stay float64; U is float64 throughout).

    Returns ``(U, table)``: U torch float64 ``[H, N, K]``; ``table`` a DataFrame with ``layer``, ``iteration``,
    ``median_rel`` (median ``|Q-P|/P``), ``max_abs`` (max ``|Q-P|``), ``n_cells`` -- Table ``tab:calib2M``.
    """
    import torch

    U = torch.as_tensor(W).to(torch.float64).clone()
    P = torch.as_tensor(P).to(device=U.device, dtype=torch.float64)
    if P.shape != U.shape:
        raise ValueError(f"W has shape {tuple(U.shape)}, P {tuple(P.shape)}; expected the same [H, N, K]")
    # The target is P on the kernel's support (U > 0), renormalised per row: Â(U) puts no mass off the
    # C >= min_count support, so Q sums to 1 over it and the fixed point Q = P exists only for the renormalised
    # P (with P itself the residual stalls at the off-support mass). Without truncation this is P.
    on = torch.nan_to_num(U, nan=0.0) > 0
    P = torch.where(on, P, torch.zeros_like(P))
    P = P / P.sum(-1, keepdim=True).clamp(min=1e-300)
    rows = []
    sums = initial
    k = 0
    while True:
        if sums is None:
            sums = corpus_pass(U if dtype is None else U.to(dtype), batches, max_elements=max_elements, progress=progress,
                               desc=f"layer {layer} pass {k}" if layer is not None else f"pass {k}")
        Q = sums.Q.to(U.device)
        med, mx = residuals(Q, P, U, sums.m.to(U.device))
        cells = int(_movable(U, P, sums.m.to(U.device)).sum())
        rows.append({"layer": layer, "iteration": k, "median_rel": med, "max_abs": mx, "n_cells": cells})
        if not (mx >= eps) or k >= iterations:  # converged (or nothing to fit), or the last evaluation
            break
        move = _movable(U, P, sums.m.to(U.device))
        factor = (P / Q.clamp(min=delta)).pow(alpha)
        U = torch.where(move & torch.isfinite(factor), U * factor, U)
        k += 1
        sums = None
        if k >= iterations and not evaluate_final:
            break
    return U, pd.DataFrame(rows, columns=["layer", "iteration", "median_rel", "max_abs", "n_cells"])


# ------------------------------------------------------------------------------------------------ one model
def check_windows(stats, tokens: Sequence[np.ndarray], tracked, where: str = "") -> None:
    """Refuse windows and a tracked set that are not the ones the statistics store was measured on: the tracked
    set's fingerprint, the context length and the number of windows and tokens must match (Q is compared with P
    cell by cell, so both must average over the same contexts)."""
    from mfpipe.stats.api import ProvenanceError

    a = stats.attrs
    fp = getattr(tracked, "fingerprint", None)
    if fp is not None and a.get("tracked_fingerprint") not in (None, fp):
        raise ProvenanceError(f"tracked set {where or ''} (fingerprint {fp[:12]}…) is not the one statistics store "
                              f"{stats.path} was computed with ({str(a.get('tracked_fingerprint'))[:12]}…)")
    n_windows = sum(int(t.shape[0]) for t in tokens)
    n_tokens = sum(int(t.size) for t in tokens)
    T = {int(t.shape[1]) for t in tokens}
    want = (int(a.get("n_windows", n_windows)), int(a.get("n_tokens", n_tokens)), int(a.get("context_length", 0)))
    if (n_windows, n_tokens) != want[:2] or (want[2] and T != {want[2]}):
        raise ProvenanceError(
            f"the shards {where} hold {n_windows} windows / {n_tokens} tokens of length {sorted(T)}, statistics store "
            f"{stats.path} was measured on {want[0]} windows / {want[1]} tokens of length {want[2]}: calibrate on the "
            f"shards of the half the store was computed from")


def calibrate_stats(stats, tokens: Sequence[np.ndarray], tracked, min_count: int = DEFAULT_MIN_COUNT,
                    iterations: int = DEFAULT_ITERATIONS, alpha: float = 1.0, delta: float = 1e-12, eps: float = 1e-6,
                    batch_size: int = 8, device="cpu", progress: bool = False, log=None, dtype=None):
    """Bias table and calibrated kernel of every layer of one statistics store (:class:`MeanFieldStats`) over the
    windows it was measured on (``tokens``: the shards' token arrays, in order). Layer by layer: ``W`` (the store's
    ``W(min_count)``), its pass (the bias table's row and iteration 0), then :func:`calibrate` (U in float64, the
    passes in ``dtype``: default float64).

    Returns ``(U [L, H, N, K] float32 numpy, bias DataFrame, residual DataFrame)``."""
    import torch

    if isinstance(tokens, np.ndarray) and tokens.ndim == 2:
        tokens = [tokens]
    tokens = list(tokens)
    check_windows(stats, tokens, tracked)
    batches = window_batches(tokens, tracked, batch_size=batch_size, device=device)
    nbar = stats.nbar().values
    C = stats.context_count().values
    qc = stats.query_count().values
    L = stats.n_layers
    U_all = None
    per_layer, tables = {}, []
    for l in range(L):
        W = torch.as_tensor(np.asarray(stats.W(min_count=min_count, layer=l).values, dtype=np.float64), device=device)
        P = torch.as_tensor(np.asarray(stats.P(layer=l).values, dtype=np.float64), device=device)
        first = corpus_pass(W if dtype is None else W.to(dtype), batches, progress=progress, desc=f"layer {l} pass 0")
        per_layer[l] = bias_sums(first, P.cpu().numpy(), nbar, C, qc, min_count)
        U, table = calibrate(W, P, batches, iterations=iterations, alpha=alpha, delta=delta, eps=eps, initial=first,
                             layer=l, progress=progress, dtype=dtype)
        if U_all is None:
            U_all = np.zeros((L, *U.shape), dtype=np.float32)
        U_all[l] = U.cpu().numpy()
        tables.append(table)
        if log is not None:
            r = table.iloc[-1]
            log.info("layer %d: residual median |Q-P|/P %.3g -> %.3g, max |Q-P| %.3g -> %.3g after %d iterations", l,
                     table["median_rel"].iloc[0], r["median_rel"], table["max_abs"].iloc[0], r["max_abs"],
                     int(r["iteration"]))
    return U_all, bias_frame(per_layer), pd.concat(tables, ignore_index=True)


def residual_markdown(table: pd.DataFrame, title: str | None = None) -> str:
    """Table ``tab:calib2M``'s layout: per layer, the two residuals as rows and the iterations as columns."""
    its = sorted(int(i) for i in table["iteration"].unique())
    lines = []
    if title:
        lines += [f"### {title}", ""]
    lines += ["| layer | residual | " + " | ".join(f"iter {i}" for i in its) + " |",
              "|---|---|" + "|".join("---:" for _ in its) + "|"]
    for layer, g in table.groupby("layer", sort=True):
        g = g.set_index("iteration")
        for col, label in (("median_rel", "median \\|Q-P\\|/P"), ("max_abs", "max \\|Q-P\\|")):
            vals = [f"{g.loc[i, col]:.3g}" if i in g.index else "" for i in its]
            lines.append(f"| {layer} | {label} | " + " | ".join(vals) + " |")
    return "\n".join(lines) + "\n"
