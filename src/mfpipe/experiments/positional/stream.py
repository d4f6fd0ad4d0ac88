"""The positional job's occurrences streamed, batch by batch: the within-type write deviation Δ (``[n, L, H, dh]``:
3-66 GiB held whole on the presets) only summed, in memory bounded independently of ``positional.tokens``.

What the analysis (:mod:`~mfpipe.experiments.positional.analysis`, :mod:`~mfpipe.experiments.positional.fits`,
:mod:`~mfpipe.experiments.positional.readings`) needs of Δ, and how it is kept:

* posVar and the ``W_pos`` share of every head are OLS shares whose regressors are functions of the position alone,
  so they follow from each head's kept count and Δ sum per sampled position and its scatter ``Σ Δ Δᵀ``
  (:class:`Moments`, ``P·L·H·dh`` and ``L·H·dh²`` float64, ``P = T / stride`` positions): the occurrence rows
  ``(x_p − x̄, y_i − ȳ)`` collapse to one weighted row per position, ``√n_p (x_p − x̄)`` and
  ``(Σ_p y − n_p ȳ) / √n_p``, whose normal equations are the occurrences' (:func:`cell_share`);
* the ridge decode's 5-fold CV numbers its folds by a permutation of each head's kept occurrences (and shuffles
  their positions for the baseline), known only once the first pass has counted them: a second pass over the same
  batches (the same forwards, bit for bit) sums each fold's moments of (Δ, p, shuffled p) (:func:`second_pass`,
  ``5·L·H·dh²``), from which every fold's standardised ridge fit and test error follow (:func:`decode`);
* the cluster's readings and curves and S are functions of per-cell sums too (a cell: a position and an offset bin),
  summed by the second pass for the cluster's heads (known after the first; at most :func:`analysis.n_top
  <mfpipe.experiments.positional.analysis.n_top>` of them; :mod:`~mfpipe.experiments.positional.cells`), with a(p)
  itself for its rank correlation with p (4 bytes a cluster head and occurrence);
* mean D (natural text) and the class test's Mann-Whitney ranks use the per-occurrence ``D`` and the untracked
  share (float32 ``[n, L, H]``, 8 bytes a head-occurrence beside Δ's ``4·dh``), kept whole.

So the counts, the S̄ ranks, mean D, the readings' inputs and the ranks of a(p), the offsets' median are the
all-at-once computation's bit for bit; every least-squares share, fit, decode, principal axis and mean is the same
computation solved from sums instead of rows, equal within float64 rounding (the sums' order differs; the decode's
test error is expanded about the fold's means; the readout direction goes through Δ's scatter, its rounding
amplified by the scatter's condition number). One reading moves by more: Spearman's rho of the positional write's
norm and leading coefficient with p (both functions of p) takes the occurrences at one position as tied, where the
rows' fits broke those ties by their rounding noise (1e-6 relative on the mini models). A principal axis's sign is the
eigensolver's either way (``tables.curves``: "a curve may come out mirrored").
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from mfpipe.experiments.positional import analysis as An
from mfpipe.experiments.positional import collect as C
from mfpipe.experiments.positional import fits as F
from mfpipe.experiments.positional.cells import ClusterSums, cell_share, cluster_tables

__all__ = ["analyse", "Moments", "first_pass", "head_table", "ridge_plan", "second_pass", "decode", "FOLDS"]

FOLDS = 5  # the ridge decode's folds (fits.ridge_decode's default)


@dataclass
class Moments:
    """Per head, over its kept occurrences (:func:`analysis.head_masks <mfpipe.experiments.positional.analysis.
    head_masks>`): ``positions [P]`` the sample's distinct positions, ``count [P, L, H]`` int64, ``sums [P, L, H, dh]``
    float64 Σ Δ per position, ``scatter [L, H, dh, dh]`` float64 Σ Δ Δᵀ."""

    positions: np.ndarray
    count: np.ndarray
    sums: np.ndarray
    scatter: np.ndarray


def _keep(prepared, lo, hi, part, c) -> np.ndarray:
    _, _, _, _, window, position, qtype = prepared
    return An.head_masks(C.Occurrences(window[lo:hi], position[lo:hi], qtype[lo:hi], **part), c["min_position"],
                         c["max_other"])


def first_pass(adapter, prepared, cfg: dict, *, batch_size: int, progress: bool = False
               ) -> tuple[C.Occurrences, Moments]:
    """One forward per batch over ``prepared`` (:func:`collect.prepare <mfpipe.experiments.positional.collect.
    prepare>`): the occurrences without Δ, a(p) and offsets (``D``, ``other``, ``valid`` kept) and the heads'
    :class:`Moments`."""
    c = {**An.DEFAULTS, **cfg}
    _, zb, _, _, window, position, qtype = prepared
    n, L, H, dh = len(window), adapter.n_layers, adapter.n_heads, int(zb.shape[-1])
    positions = np.unique(position)
    pidx = np.searchsorted(positions, position)
    D, other, valid = np.zeros((n, L, H), np.float32), np.zeros((n, L, H), np.float32), np.zeros(n, bool)
    count = torch.zeros(len(positions), L, H, dtype=torch.int64)
    sums = torch.zeros(len(positions), L, H, dh, dtype=torch.float64)
    scatter = torch.zeros(L * H, dh, dh, dtype=torch.float64)
    for lo, hi, part in C.batches(adapter, prepared, batch_size=batch_size, progress=progress):
        D[lo:hi], other[lo:hi], valid[lo:hi] = part["D"], part["other"], part["valid"]
        keep = torch.from_numpy(_keep(prepared, lo, hi, part, c))
        kd = torch.from_numpy(part["delta"]).double() * keep[..., None]
        idx = torch.from_numpy(pidx[lo:hi])
        count.index_add_(0, idx, keep.long())
        sums.index_add_(0, idx, kd)
        x = kd.reshape(hi - lo, L * H, dh).transpose(0, 1)  # [L·H, nb, dh]
        scatter += x.transpose(1, 2) @ x
    occ = C.Occurrences(window, position, qtype, delta=None, D=D, bos=None, offset=None, other=other, valid=valid)
    return occ, Moments(positions, count.numpy(), sums.numpy(), scatter.reshape(L, H, dh, dh).numpy())


def head_table(occ, mom: Moments, O, W_pos, S_bar, T: int, cfg: dict) -> pd.DataFrame:
    """:func:`analysis.head_table <mfpipe.experiments.positional.analysis.head_table>` from the first pass: the same
    columns, the decode's NaN until :func:`decode` fills them."""
    c = {**An.DEFAULTS, **cfg}
    keep = An.head_masks(occ, c["min_position"], c["max_other"])
    L, H = keep.shape[1:]
    kept = np.arange(int(c["min_position"]), T)
    rank = An.s_ranks(S_bar)
    basis = F.position_basis(mom.positions, T)
    code = None if W_pos is None else F.code_features(W_pos, mom.positions, kept, int(c["wpos_components"]))
    rows = []
    for l in range(L):
        for h in range(H):
            m = keep[:, l, h]
            o = np.asarray(O[l, h], np.float64)
            G = o @ o.T
            cell = (mom.count[:, l, h], mom.sums[:, l, h], mom.scatter[l, h])
            row = dict(layer=l, head=h, n=int(m.sum()), S_bar=float(S_bar[l, h]), S_rank=int(rank[l * H + h]) + 1,
                       D_natural=float(np.mean(occ.D[m, l, h])) if m.any() else np.nan,
                       posvar=cell_share(cell[0], basis, *cell[1:], G) if m.sum() > 12 else np.nan,
                       wpos=W_pos is not None)
            row["wpos_share"] = (cell_share(cell[0], code, *cell[1:], G) if W_pos is not None and m.sum() > 12
                                 else np.nan)
            row["decode_r2"] = row["decode_r2_shuffled"] = np.nan
            rows.append(row)
    return pd.DataFrame(rows)


def ridge_plan(occ, cfg: dict) -> tuple[np.ndarray, np.ndarray]:
    """``(fold [n, L, H] int8, shuffled position [n, L, H] int32)`` of every head's kept occurrences (-1 / 0
    elsewhere), drawn as :func:`fits.ridge_decode <mfpipe.experiments.positional.fits.ridge_decode>` draws them for
    the head's rows in (window, position) order; heads with at most 12 occurrences get none (no decode)."""
    c = {**An.DEFAULTS, **cfg}
    keep = An.head_masks(occ, c["min_position"], c["max_other"])
    fold = np.full(keep.shape, -1, np.int8)
    shuffled = np.zeros(keep.shape, np.int32)
    for l in range(keep.shape[1]):
        for h in range(keep.shape[2]):
            m = keep[:, l, h]
            if m.sum() <= 12:
                continue
            rng = np.random.default_rng(int(c["seed"]))
            fold[m, l, h] = rng.permutation(int(m.sum())) % FOLDS
            shuffled[m, l, h] = rng.permutation(np.asarray(occ.position[m]))
    return fold, shuffled


def _fold_sums(acc: dict, X, fold, y, ys) -> None:
    """Adds one batch's per-fold moments: ``X [nb, L, H, dh]``, ``fold [nb, L, H]``, ``y [nb]``, ``ys [nb, L, H]``."""
    nb, L, H, dh = X.shape
    y = y[:, None, None].expand(nb, L, H)
    for f in range(FOLDS):
        w = (fold == f).double()
        Xw = X * w[..., None]
        x = Xw.reshape(nb, L * H, dh).transpose(0, 1)
        acc["xx"][f] += (x.transpose(1, 2) @ X.reshape(nb, L * H, dh).transpose(0, 1)).reshape(L, H, dh, dh)
        for key, v in (("n", w), ("y", w * y), ("yy", w * y * y), ("s", w * ys), ("ss", w * ys * ys)):
            acc[key][f] += v.sum(0)
        acc["x"][f] += Xw.sum(0)
        acc["xy"][f] += (Xw * y[..., None]).sum(0)
        acc["xs"][f] += (Xw * ys[..., None]).sum(0)


def second_pass(adapter, prepared, heads, positions, T: int, cfg: dict, plan=None, *, batch_size: int,
                progress: bool = False):
    """The first pass's batches again: the :class:`~mfpipe.experiments.positional.cells.ClusterSums` of ``heads``
    (over the sample's distinct ``positions``), and, given ``plan`` (:func:`ridge_plan`), every head's per-fold
    ridge moments (float64 ``[FOLDS, L, H, ...]``: ``n``, ``x``, ``xx``, ``y``, ``yy``, ``xy`` and the shuffled
    ``s``, ``ss``, ``xs``) -> (sums, moments or None)."""
    c = {**An.DEFAULTS, **cfg}
    _, zb, _, _, window, position, _ = prepared
    L, H, dh = adapter.n_layers, adapter.n_heads, int(zb.shape[-1])
    sums = ClusterSums(heads, len(window), positions, T, dh)
    pidx = np.searchsorted(positions, position)
    acc = None
    if plan is not None:
        shapes = {"n": (), "y": (), "yy": (), "s": (), "ss": (), "x": (dh,), "xy": (dh,), "xs": (dh,), "xx": (dh, dh)}
        acc = {key: torch.zeros(FOLDS, L, H, *s, dtype=torch.float64) for key, s in shapes.items()}
    for lo, hi, part in C.batches(adapter, prepared, batch_size=batch_size, progress=progress,
                                  desc="positional occurrences (second pass)"):
        if sums.heads:
            sums.add(lo, hi, pidx[lo:hi], part, _keep(prepared, lo, hi, part, c))
        if acc is not None:
            _fold_sums(acc, torch.from_numpy(part["delta"]).double(), torch.from_numpy(plan[0][lo:hi]),
                       torch.from_numpy(position[lo:hi]).double(), torch.from_numpy(plan[1][lo:hi]).double())
    return sums, None if acc is None else {key: v.numpy() for key, v in acc.items()}


def _cv(a: dict, t: str, alpha: float) -> float:
    """Cross-validated ridge R² of one head's target ``t`` ("y" the position, "s" shuffled) from its per-fold
    moments (``a[key][f]``): :func:`fits.ridge_decode <mfpipe.experiments.positional.fits.ridge_decode>`'s fit and
    test error, with the fold's standardisation, written in sums."""
    N, Sx, Sxx, St, Stt, Sxt = a["n"], a["x"], a["xx"], a[t], a[t + t], a["x" + t]
    ss = float(Stt.sum() - St.sum() ** 2 / N.sum())
    sse = 0.0
    for f in range(FOLDS):
        if N[f] == 0:
            continue
        tr = np.arange(FOLDS) != f
        ntr = N[tr].sum()
        mu, tbar = Sx[tr].sum(0) / ntr, St[tr].sum() / ntr
        Sxx_tr = Sxx[tr].sum(0)
        var = np.diag(Sxx_tr) / ntr - mu * mu
        flat = var <= 1e-12 * np.maximum(np.diag(Sxx_tr) / ntr, np.finfo(float).tiny)  # a constant feature: sd 1
        sd = np.where(flat, 1.0, np.sqrt(np.where(flat, 1.0, var)))
        A = (Sxx_tr - ntr * np.outer(mu, mu)) / np.outer(sd, sd)
        w = np.linalg.solve(A + alpha * np.eye(len(mu)), (Sxt[tr].sum(0) - ntr * mu * tbar) / sd)
        Ste, nte = St[f], N[f]
        cross = (Sxt[f] - tbar * Sx[f] - mu * Ste + nte * tbar * mu) / sd
        gram = (Sxx[f] - np.outer(Sx[f], mu) - np.outer(mu, Sx[f]) + nte * np.outer(mu, mu)) / np.outer(sd, sd)
        sse += float(Stt[f] - 2 * tbar * Ste + nte * tbar * tbar - 2 * w @ cross + w @ gram @ w)
    return 1.0 - sse / ss if ss > 0 else float("nan")


def decode(table: pd.DataFrame, moments: dict, cfg: dict) -> pd.DataFrame:
    """``table`` (:func:`head_table`) with ``decode_r2`` and ``decode_r2_shuffled`` from :func:`second_pass`'s
    moments, on the heads :func:`ridge_plan` drew folds for."""
    c = {**An.DEFAULTS, **cfg}
    out = table.copy()
    for i, r in enumerate(table.itertuples()):
        a = {key: v[:, r.layer, r.head] for key, v in moments.items()}
        if a["n"].sum() <= 12:
            continue
        out.loc[out.index[i], ["decode_r2", "decode_r2_shuffled"]] = [_cv(a, "y", float(c["ridge_alpha"])),
                                                                     _cv(a, "s", float(c["ridge_alpha"]))]
    return out


def analyse(adapter, prepared, O, W_pos, S_bar, T: int, cfg: dict, *, batch_size: int, progress: bool = False):
    """Every head's row, the positional cluster and its readings in two streamed passes (the second only where there
    is a cluster or a decode) -> ``(occ, heads, cluster, carriers, ctab, sums)``: ``occ`` the occurrences with
    ``D``, ``other``, ``valid`` (what the readings read), ``heads`` as :func:`analysis.head_table
    <mfpipe.experiments.positional.analysis.head_table>`'s, ``ctab`` as :func:`analysis.cluster_tables
    <mfpipe.experiments.positional.analysis.cluster_tables>`'s (its ``fits`` :class:`~mfpipe.experiments.positional.
    cells.Fit` s) and ``sums`` the cluster's :class:`~mfpipe.experiments.positional.cells.ClusterSums` (the
    curves')."""
    occ, mom = first_pass(adapter, prepared, cfg, batch_size=batch_size, progress=progress)
    heads = head_table(occ, mom, O, W_pos, S_bar, T, cfg)
    mom.sums = mom.count = None  # (every head's per-position sums: done with; the scatters serve the cluster's)
    cl, carriers = An.cluster(heads, cfg)
    plan = ridge_plan(occ, cfg) if W_pos is not None else None
    sums = ClusterSums([], len(occ), mom.positions, T, 1)
    if cl or plan is not None:
        sums, moments = second_pass(adapter, prepared, cl, mom.positions, T, cfg, plan, batch_size=batch_size,
                                    progress=progress)
        if moments is not None:
            heads = decode(heads, moments, cfg)
    c = {**An.DEFAULTS, **cfg}
    ctab = cluster_tables(sums, An.head_masks(occ, c["min_position"], c["max_other"]), occ.position,
                             mom.scatter, O, W_pos, cfg)
    return occ, heads, cl, carriers, ctab, sums
