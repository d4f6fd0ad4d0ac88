"""The positional cluster's readings from sums over cells (issue 58): what
:func:`analysis.cluster_tables <mfpipe.experiments.positional.analysis.cluster_tables>`, :func:`tables.curves
<mfpipe.experiments.positional.tables.curves>` and :func:`analysis.union_subspace
<mfpipe.experiments.positional.analysis.union_subspace>` compute from a cluster head's occurrences, computed from
per-cell sums in memory bounded independently of the occurrences' number.

A cell is a (sampled position, attended-key offset bin) pair: every regressor of the readings (the position basis,
the code ``W_pos[p]``, the offset features :func:`fits.offset_features
<mfpipe.experiments.positional.fits.offset_features>`) is a function of the cell, so each OLS share follows from
the cell's count and Δ sum with the head's scatter ``Σ Δ Δᵀ`` (:func:`cell_share`), and each positional write is
a function of the position: one row per position weighted by its count (:class:`Fit`) stands for the occurrences'
rows. a(p) enters by its sums
(the BOS gate's mean, its regression on the code, Δ on a(p)) and, for the rank correlation with p only, by its
values (``a [n, K]`` float32, 4 bytes a cluster head and occurrence); the offsets by their histogram (s.d., median).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from mfpipe.experiments.positional import analysis as An
from mfpipe.experiments.positional import fits as F

__all__ = ["cell_share", "Fit", "ClusterSums", "offset_bins", "cluster_tables", "curves", "union_subspace"]


def cell_share(count, X, sums, scatter, G=None) -> float:
    """:func:`fits.explained_share` of occurrences grouped in
    cells that share their regressors: ``count [P]`` occurrences, ``X [P, k]`` regressors, ``sums [P, m]`` Σ Y per
    cell, ``scatter [m, m]`` Σ Y Yᵀ over all (metric ``G``; None: Euclidean). One weighted row per cell has the
    occurrences' normal equations (``Xᵀ X`` and ``Xᵀ Y`` about the means), so the same fit and share."""
    cnt = np.asarray(count, np.float64)
    sel = cnt > 0
    cnt, X, sums = cnt[sel], np.asarray(X, np.float64).reshape(len(sel), -1)[sel], np.asarray(sums, np.float64)[sel]
    G = np.eye(sums.shape[1]) if G is None else np.asarray(G, np.float64)
    n = cnt.sum()
    if n == 0:
        return float("nan")
    ybar = sums.sum(0) / n
    total = float(np.trace(G @ np.asarray(scatter, np.float64)) - n * ybar @ G @ ybar)
    if not total > 0:
        return float("nan")
    r = np.sqrt(cnt)[:, None]
    Xw = r * (X - (cnt[:, None] * X).sum(0) / n)
    if Xw.shape[1] == 0 or not np.any(Xw):
        return 0.0
    beta, *_ = np.linalg.lstsq(Xw, (sums - cnt[:, None] * ybar) / r, rcond=None)
    fw = Xw @ beta
    return float(np.einsum("ci,ij,cj->", fw, G, fw)) / total


def offset_bins(T: int) -> tuple[np.ndarray, np.ndarray]:
    """``(bin [T], features [n_bins, n_bins])``: the bin of :func:`fits.offset_features` each offset ``0..T-1`` falls
    in, and each bin's feature row (one-hot)."""
    feats = F.offset_features(np.arange(int(T)))
    return feats.argmax(1).astype(np.int64), np.eye(feats.shape[1])


@dataclass
class Fit:
    """A positional write: ``rows [P, d]`` its value at each sampled position, ``w [P]`` the occurrences there."""

    rows: np.ndarray
    w: np.ndarray

    def centred(self) -> np.ndarray:
        w = self.w.astype(np.float64)
        return self.rows - (w[:, None] * self.rows).sum(0) / w.sum()


def _principal(fit: Fit) -> tuple[np.ndarray, np.ndarray]:
    """:func:`fits.principal` of the occurrences' rows: the weighted scatter where they number at least ``d`` (its
    route), else the rows themselves, repeated."""
    Vc = fit.centred()
    if fit.w.sum() >= Vc.shape[1]:
        w, U = np.linalg.eigh(Vc.T @ (fit.w[:, None] * Vc))
        order = np.argsort(w)[::-1]
        return np.clip(w[order], 0, None), U[:, order]
    return F.principal(np.repeat(fit.rows, fit.w, axis=0))


def _share_in_span(fit: Fit, basis) -> float:
    Vc = fit.centred()
    q, _ = np.linalg.qr(np.asarray(basis, dtype=np.float64))
    total = float((fit.w[:, None] * Vc * Vc).sum())
    return float((fit.w[:, None] * (Vc @ q) ** 2).sum()) / total if total > 0 else float("nan")


def _leading_share(s: np.ndarray, k: int) -> float:
    return float(s[: int(k)].sum() / s.sum()) if s.sum() > 0 else float("nan")


def _fitted(count, X, sums) -> np.ndarray:
    """:func:`fits.fitted` per cell: the centred OLS fit of the occurrences' ``Y`` on ``X`` (a function of the cell),
    ``[P, m]`` from each cell's ``count`` and ``Y`` sum (zero rows where a cell is empty)."""
    cnt = np.asarray(count, np.float64)
    sel, n = cnt > 0, cnt.sum()
    out = np.zeros((len(cnt), np.asarray(sums).shape[1]))
    X = np.asarray(X, np.float64).reshape(len(cnt), -1)
    Xc = X[sel] - (cnt[sel, None] * X[sel]).sum(0) / n
    if Xc.shape[1] == 0 or not np.any(Xc):
        return out
    r = np.sqrt(cnt[sel])[:, None]
    ys = np.asarray(sums, np.float64)[sel]
    beta, *_ = np.linalg.lstsq(r * Xc, (ys - cnt[sel, None] * ys.sum(0) / n) / r, rcond=None)
    out[sel] = Xc @ beta
    return out


class ClusterSums:
    """The second pass's sums of ``heads`` (K of them) over their kept occurrences: per cell ``count [K, P, B]`` and
    Δ ``dsum [K, P, B, dh]``; per position a(p) ``asum [K, P]``; ``a2 [K]`` Σ a², ``ad [K, dh]`` Σ a Δ, ``a_lo``,
    ``a_hi`` its extremes; the offsets' histogram ``offsets [K, T]``; a(p) itself ``a [n, K]`` (the rank
    correlation)."""

    def __init__(self, heads, n: int, positions, T: int, dh: int):
        self.heads = [(int(l), int(h)) for l, h in heads]
        self.positions, self.T = np.asarray(positions), int(T)
        self.bin_of, self.bin_features = offset_bins(T)
        K, P, B = len(self.heads), len(self.positions), self.bin_features.shape[0]
        self.count = torch.zeros(K, P, B, dtype=torch.int64)
        self.dsum = torch.zeros(K, P, B, dh, dtype=torch.float64)
        self.asum, self.a2 = torch.zeros(K, P, dtype=torch.float64), torch.zeros(K, dtype=torch.float64)
        self.ad = torch.zeros(K, dh, dtype=torch.float64)
        self.a_lo, self.a_hi = torch.full((K,), np.inf, dtype=torch.float64), torch.full((K,), -np.inf,
                                                                                          dtype=torch.float64)
        self.offsets = torch.zeros(K, self.T, dtype=torch.int64)
        self.a = np.zeros((int(n), K), np.float32)

    def add(self, lo: int, hi: int, pidx, part: dict, keep) -> None:
        """One batch: occurrences ``lo:hi`` (position indices ``pidx``), the batch's fields ``part`` and head masks
        ``keep [nb, L, H]``."""
        lsel, hsel = ([x[i] for x in self.heads] for i in (0, 1))
        k = torch.from_numpy(np.ascontiguousarray(keep[:, lsel, hsel]))  # [nb, K]
        d = torch.from_numpy(np.ascontiguousarray(part["delta"][:, lsel, hsel])).double() * k[..., None]
        a = torch.from_numpy(np.ascontiguousarray(part["bos"][:, lsel, hsel])).double()
        off = torch.from_numpy(np.ascontiguousarray(part["offset"][:, lsel, hsel]))
        self.a[lo:hi] = part["bos"][:, lsel, hsel]
        K, P, B = self.count.shape
        cell = (torch.from_numpy(np.asarray(pidx))[:, None] * B + torch.from_numpy(self.bin_of)[off])  # [nb, K]
        heads = torch.arange(K)[None, :].expand_as(cell)
        flat = (heads * (P * B) + cell).reshape(-1)
        self.count.view(-1).index_add_(0, flat, k.reshape(-1).long())
        self.dsum.view(-1, d.shape[-1]).index_add_(0, flat, d.reshape(-1, d.shape[-1]))
        self.asum.view(-1).index_add_(0, (heads * P + cell // B).reshape(-1), (a * k).reshape(-1))
        self.a2 += (a * a * k).sum(0)
        self.ad += (d * a[..., None]).sum(0)
        big = torch.tensor(np.inf, dtype=torch.float64)
        self.a_lo = torch.minimum(self.a_lo, torch.where(k, a, big).amin(0))
        self.a_hi = torch.maximum(self.a_hi, torch.where(k, a, -big).amax(0))
        self.offsets.view(-1).index_add_(0, (heads * self.T + off).reshape(-1), k.reshape(-1).long())


def _spearman_counts(values, positions, w) -> float:
    """Spearman of a per-position value with the position over the occurrences (``w`` at each position)."""
    keep = w > 0
    return An.spearman(np.repeat(values[keep], w[keep]), np.repeat(positions[keep], w[keep]))


def _median(hist: np.ndarray) -> float:
    """``np.median`` of the values ``0..len(hist)-1`` counted by ``hist``."""
    c = np.cumsum(hist)
    n = int(c[-1])
    lo, hi = np.searchsorted(c, (n - 1) // 2, "right"), np.searchsorted(c, n // 2, "right")
    return float(np.mean([lo, hi]))


def _gate(s: ClusterSums, k: int, G, scatter) -> tuple[float, float]:
    """(a(p)'s mean, the share of Δ explained by a(p) alone) of head ``k``: OLS on one regressor, from sums."""
    n = float(s.count[k].sum())
    a_sum, d_sum = float(s.asum[k].sum()), s.dsum[k].sum((0, 1)).numpy()
    abar, dbar = a_sum / n, d_sum / n
    total = float(np.trace(G @ scatter) - n * dbar @ G @ dbar)
    var_a = float(s.a2[k]) - n * abar * abar
    if not total > 0:
        return a_sum / n, float("nan")
    if float(s.a_lo[k]) == float(s.a_hi[k]):  # a constant a(p): fits.fitted's zero fit
        return a_sum / n, 0.0
    c_da = s.ad[k].numpy() - n * abar * dbar
    return a_sum / n, float(c_da @ G @ c_da) / var_a / total


def _head_row(s: ClusterSums, k: int, a, p, scatter, O, W_pos, c) -> tuple[dict, Fit, np.ndarray]:
    """:func:`analysis.cluster_tables`'s row of cluster head ``k`` from its sums (``a``, ``p`` its kept occurrences'
    a(p) and positions, for the rank correlation) -> (row, positional write, readout direction)."""
    l, h = s.heads[k]
    cnt, dsum = s.count[k].numpy(), s.dsum[k].numpy()
    cnt_p, dsum_p = cnt.sum(1), dsum.sum(1)
    n, pos, T = int(cnt.sum()), s.positions, s.T
    Oh = np.asarray(O[l, h], np.float64)
    G = Oh @ Oh.T
    kept = np.arange(int(c["min_position"]), T)
    X = (F.code_features(W_pos, pos, kept, int(c["wpos_components"])) if W_pos is not None
         else F.position_basis(pos, T))
    fit = Fit(_fitted(cnt_p, X, dsum_p @ Oh), cnt_p)
    s_fit, axes = _principal(fit)
    # the readout: the min-norm least squares of p on the write Δ O_h, through Δ's centred scatter C and O_h's Gram
    dbar, pbar = dsum_p.sum(0) / n, float(cnt_p @ pos) / n
    C = scatter - n * np.outer(dbar, dbar)
    v = np.linalg.lstsq(C, pos @ dsum_p - n * pbar * dbar, rcond=None)[0]
    readout = Oh.T @ np.linalg.lstsq(G, v, rcond=None)[0]
    hist = s.offsets[k].numpy().astype(np.float64)
    o = np.arange(T)
    omean = float(hist @ o) / n
    bos_mean, a_share = _gate(s, k, G, scatter)
    share = lambda count, X_, sums: cell_share(count, X_, sums, scatter, G)  # noqa: E731
    row = dict(layer=l, head=h, n=n, bos_mean=bos_mean, offset_sd=float(np.sqrt(hist @ (o - omean) ** 2 / n)),
               offset_median=_median(hist), a_share=a_share, write_top1=_leading_share(s_fit, 1),
               write_top2=_leading_share(s_fit, 2), write_top3=_leading_share(s_fit, 3),
               spearman_a_p=An.spearman(a, p),
               spearman_norm_p=_spearman_counts(np.linalg.norm(fit.rows, axis=1), pos, cnt_p),
               spearman_lead_p=_spearman_counts(fit.rows @ axes[:, 0], pos, cnt_p),
               offset_share=share(cnt.sum(0), s.bin_features, dsum.sum(0)))
    if W_pos is not None:
        W = np.asarray(W_pos, np.float64)
        wc = W[pos] - W[kept].mean(0)
        B = cnt.shape[1]
        both = np.column_stack([np.repeat(X, B, axis=0), np.tile(s.bin_features, (len(pos), 1))])
        asum = s.asum[k].numpy()
        norms = np.maximum(np.linalg.norm(fit.rows, axis=1) * np.linalg.norm(wc, axis=1), 1e-30)
        row.update(wpos_share=share(cnt_p, X, dsum_p), both_share=share(cnt.reshape(-1), both,
                                                                        dsum.reshape(-1, dsum.shape[-1])),
                   a_r2_on_wpos=cell_share(cnt_p, X, asum[:, None], np.array([[float(s.a2[k])]])),
                   in_code_pcs=_share_in_span(fit, F.subspace(W[kept], 10)),
                   pointwise_cos=float(cnt_p @ (np.abs(np.sum(fit.rows * wc, 1)) / norms)) / n,
                   rms_ratio=float(np.sqrt((cnt_p @ (fit.rows ** 2).sum(1)) / (cnt_p @ (wc ** 2).sum(1)))))
        row["offset_increment"] = row["both_share"] - row["wpos_share"]
    return row, fit, readout


def cluster_tables(s: ClusterSums, keep, position, scatter, O, W_pos, cfg: dict) -> dict:
    """:func:`analysis.cluster_tables` from ``s`` (the cluster heads' sums): ``rows``, ``overlaps``, ``model`` and
    ``fits`` ({head: :class:`Fit`}); ``keep [n, L, H]`` the heads' masks, ``position [n]`` the occurrences',
    ``scatter [L, H, dh, dh]`` Σ Δ Δᵀ of every head (the first pass's)."""
    c = {**An.DEFAULTS, **cfg}
    rows, fits, readouts, spans = [], {}, {}, {}
    for k, (l, h) in enumerate(s.heads):
        m = keep[:, l, h]
        if m.sum() <= 12:
            continue
        row, fit, readout = _head_row(s, k, s.a[m, k].astype(np.float64), np.asarray(position)[m],
                                      np.asarray(scatter[l, h], np.float64), O, W_pos, c)
        rows.append(row)
        fits[(l, h)], readouts[(l, h)] = fit, readout
        spans[(l, h)] = _principal(fit)[1][:, : int(c["write_rank"])]
    return dict(rows=pd.DataFrame(rows), fits=fits, **An.cluster_pairs(readouts, spans, O, W_pos, s.T, c))


def curves(s: ClusterSums, fits: dict, heads, cfg: dict, n_bins: int = 16) -> pd.DataFrame:
    """:func:`tables.curves` from the sums and :func:`cluster_tables`'s fits: per cluster head and position bin the
    mean a(p) and the mean signed coefficient of the positional write on its leading axis."""
    c = {**An.DEFAULTS, **cfg}
    edges = np.linspace(int(c["min_position"]), s.T, n_bins + 1)
    b = np.clip(np.digitize(s.positions, edges) - 1, 0, n_bins - 1)
    index = {hd: k for k, hd in enumerate(s.heads)}
    rows = []
    for l, h in heads:
        if (l, h) not in fits:
            continue
        fit = fits[(l, h)]
        lead, w, asum = fit.rows @ _principal(fit)[1][:, 0], fit.w.astype(np.float64), s.asum[index[(l, h)]].numpy()
        for k in np.unique(b[fit.w > 0]):
            sel = (b == k) & (fit.w > 0)
            n = w[sel].sum()
            rows.append(dict(head=f"L{l}H{h}", position=float(w[sel] @ s.positions[sel]) / n,
                             a_mean=float(asum[sel].sum()) / n, lead_mean=float(w[sel] @ lead[sel]) / n, n=int(n)))
    return pd.DataFrame(rows, columns=["head", "position", "a_mean", "lead_mean", "n"])


def union_subspace(fits: dict, heads, dim: int, d: int) -> tuple[np.ndarray, float]:
    """:func:`analysis.union_subspace` of :class:`Fit` s: the top ``dim`` principal directions of the heads'
    positional writes stacked (``k = min(dim, rank)``) and their share of the writes' variance."""
    parts = [fits[h] for h in heads if h in fits]
    if not parts:
        return np.zeros((int(d), 0)), float("nan")
    stack = Fit(np.concatenate([f.centred() for f in parts]), np.concatenate([f.w for f in parts]))
    rows = stack.rows[stack.w > 0] * np.sqrt(stack.w[stack.w > 0])[:, None]
    k = int(min(int(dim), np.linalg.matrix_rank(rows)))
    S = _principal(stack)[1][:, :k]
    return S, _share_in_span(stack, S)
