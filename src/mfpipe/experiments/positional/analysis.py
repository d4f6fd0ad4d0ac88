"""App. positional's readings from the occurrences of one (model, revision) (numpy; no model): every head's posVar,
the positional cluster, and the cluster's rows of "what is moved", the BOS gate, magnification against re-encoding
and the geometry of the new code, with the subspace S the dereferencing ablation removes.

Inputs: an :class:`~mfpipe.experiments.positional.collect.Occurrences` (``delta`` the within-type write deviation
``Δ = z − z̄_s`` in head space, ``position``, ``bos``, ``offset``, ``other``, ``valid``), the output-projection slices
``O [L, H, dh, d]`` (Δ in residual units is ``Δ O_h``), the learned position table ``W_pos [n_positions, d]`` (None
on a rotary model: every reading that needs it is NaN there, with ``wpos = False`` in the table) and ``S̄ [L, H]``
(the head ranking's score, from the deviation store).

Definitions (config ``positional``; README.md, "Positional transport"):

* a head's occurrences: valid, ``p >= min_position``, the head's attention on untracked keys ``<= max_other``;
* **positional cluster**: the heads with ``posVar >= posvar_threshold`` among the top heads by S̄, a share of the
  model's heads (:func:`n_top`: ``top_fraction`` of them, rounded, at least ``min_top``; the default 0.14 is the
  paper's top 20 of GPT-2 small's 144), so that on a small model the rule still looks at its high-deviation heads
  only (an absolute count at least the number of heads would take every head, the lowest-deviation ones too);
* **positional write** of a head: the fit of its residual-unit write on the position code's top ``wpos_components``
  principal components (``W_pos`` models), or on the smooth position function of posVar (rotary models);
* **carriers**: cluster heads whose ``W_pos`` share is ``>= carrier_threshold`` (rotary: the cluster);
* **S**: the top ``ablation_dim`` principal directions of the carriers' positional writes stacked (its share of their
  variance in the table).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from mfpipe.experiments.positional import fits as F

__all__ = ["cluster_pairs", "DEFAULTS", "head_masks", "s_ranks", "head_table", "n_top", "spearman", "cluster", "positional_write",
           "cluster_tables", "union_subspace"]

DEFAULTS = dict(min_position=8, max_other=0.1, top_fraction=0.14, min_top=2, posvar_threshold=0.5,
                carrier_threshold=0.3, wpos_components=10, write_rank=2, ablation_dim=20, ridge_alpha=1.0, seed=0)


def head_masks(occ, min_position: int, max_other: float) -> np.ndarray:
    """``keep [n, L, H]``: the occurrences each head's readings use (valid, position, vocabulary filter)."""
    base = np.asarray(occ.valid, bool) & (np.asarray(occ.position) >= int(min_position))
    return base[:, None, None] & (np.asarray(occ.other) <= float(max_other))


def _gram(O, l, h) -> np.ndarray:
    o = np.asarray(O[l, h], dtype=np.float64)
    return o @ o.T


def s_ranks(S_bar) -> np.ndarray:
    """Each head's rank by S̄ (0 = the highest; NaN last; ties by flat index), flat ``[L·H]``."""
    flat = np.nan_to_num(np.asarray(S_bar, float).reshape(-1), nan=-np.inf)
    order = np.lexsort((np.arange(flat.size), -flat))
    rank = np.empty(flat.size, int)
    rank[order] = np.arange(flat.size)
    return rank


def head_table(occ, O, W_pos, S_bar, T: int, cfg: dict) -> pd.DataFrame:
    """One row per head: occurrences kept, S̄ and its rank, mean D (natural text), posVar, and on ``W_pos`` models the
    ``W_pos`` share and the ridge decode of ``p`` (and its shuffled baseline)."""
    c = {**DEFAULTS, **cfg}
    keep = head_masks(occ, c["min_position"], c["max_other"])
    L, H = keep.shape[1:]
    kept = np.arange(int(c["min_position"]), T)
    rank = s_ranks(S_bar)
    rows = []
    for l in range(L):
        for h in range(H):
            m = keep[:, l, h]
            d, p = np.asarray(occ.delta[m, l, h], np.float64), np.asarray(occ.position[m])
            G = _gram(O, l, h)
            row = dict(layer=l, head=h, n=int(m.sum()), S_bar=float(S_bar[l, h]), S_rank=int(rank[l * H + h]) + 1,
                       D_natural=float(np.mean(occ.D[m, l, h])) if m.any() else np.nan,
                       posvar=F.posvar(d, p, T, G) if m.sum() > 12 else np.nan, wpos=W_pos is not None)
            if W_pos is not None and m.sum() > 12:
                row["wpos_share"] = F.wpos_share(d, p, W_pos, kept, int(c["wpos_components"]), G)
                row["decode_r2"], row["decode_r2_shuffled"] = F.ridge_decode(d, p, alpha=float(c["ridge_alpha"]),
                                                                             seed=int(c["seed"]))
            else:
                row["wpos_share"] = row["decode_r2"] = row["decode_r2_shuffled"] = np.nan
            rows.append(row)
    return pd.DataFrame(rows)


def n_top(n_heads: int, cfg: dict) -> int:
    """How many of a model's ``n_heads`` heads (layers x heads) the cluster is chosen among: ``top_fraction`` of them,
    rounded half up, at least ``min_top``, at most all of them."""
    c = {**DEFAULTS, **cfg}
    return int(min(n_heads, max(int(c["min_top"]), np.floor(float(c["top_fraction"]) * n_heads + 0.5))))


def cluster(table: pd.DataFrame, cfg: dict) -> tuple[list, list]:
    """(the positional cluster, its carriers) as [(layer, head)] by S̄ rank: posVar >= threshold among the top
    :func:`n_top` heads by S̄ (``table`` has a row per head of the model); carriers: W_pos share >= carrier_threshold
    (the whole cluster on a rotary model)."""
    c = {**DEFAULTS, **cfg}
    top = table[table["S_rank"] <= n_top(len(table), c)].sort_values("S_rank")
    cl = top[top["posvar"] >= float(c["posvar_threshold"])]
    car = cl if not bool(cl["wpos"].any()) else cl[cl["wpos_share"] >= float(c["carrier_threshold"])]
    return ([(int(a), int(b)) for a, b in zip(cl["layer"], cl["head"])],
            [(int(a), int(b)) for a, b in zip(car["layer"], car["head"])])


def positional_write(delta_h, p, O_h, W_pos, T: int, min_position: int, k: int) -> np.ndarray:
    """The positional write ``[n, d]`` (residual units, centred) of one head: its write ``Δ O_h`` fitted on the code's
    top ``k`` principal components, or on the smooth position function where there is no ``W_pos``."""
    write = np.asarray(delta_h, np.float64) @ np.asarray(O_h, np.float64)
    X = (F.code_features(W_pos, p, np.arange(int(min_position), T), k) if W_pos is not None
         else F.position_basis(p, T))
    return F.fitted(write, X)


def spearman(a, b) -> float:
    """Spearman's rho of ``a`` and ``b``; NaN with fewer than three pairs or a constant side."""
    from scipy.stats import spearmanr

    a, b = np.asarray(a, float), np.asarray(b, float)
    return float(spearmanr(a, b).statistic) if len(a) > 2 and np.ptp(a) > 0 and np.ptp(b) > 0 else np.nan


def _head_row(occ, m, l, h, O, W_pos, T, c) -> tuple[dict, np.ndarray, np.ndarray]:
    """Items 3-5 of one cluster head -> (its row, its positional write [n, d], its readout direction [d])."""
    p = np.asarray(occ.position[m])
    d = np.asarray(occ.delta[m, l, h], np.float64)
    G, a, off = _gram(O, l, h), np.asarray(occ.bos[m, l, h], np.float64), np.asarray(occ.offset[m, l, h])
    fit = positional_write(d, p, O[l, h], W_pos, T, c["min_position"], int(c["wpos_components"]))
    lead = fit @ F.principal(fit)[1][:, 0]  # the signed coefficient on the leading axis
    write = d @ np.asarray(O[l, h], np.float64)
    readout, *_ = np.linalg.lstsq(write - write.mean(0), p - p.mean(), rcond=None)
    row = dict(layer=l, head=h, n=int(m.sum()), bos_mean=float(a.mean()), offset_sd=float(off.std()),
               offset_median=float(np.median(off)), a_share=F.explained_share(d, a[:, None], G),
               write_top1=F.leading_share(fit, 1), write_top2=F.leading_share(fit, 2),
               write_top3=F.leading_share(fit, 3), spearman_a_p=spearman(a, p),
               spearman_norm_p=spearman(np.linalg.norm(fit, axis=1), p), spearman_lead_p=spearman(lead, p),
               offset_share=F.explained_share(d, F.offset_features(off), G))
    if W_pos is not None:
        kept = np.arange(int(c["min_position"]), T)
        code = F.code_features(W_pos, p, kept, int(c["wpos_components"]))
        W = np.asarray(W_pos, np.float64)
        wc = W[p] - W[kept].mean(0)
        row.update(wpos_share=F.explained_share(d, code, G),
                   both_share=F.explained_share(d, np.column_stack([code, F.offset_features(off)]), G),
                   a_r2_on_wpos=F.explained_share(a[:, None], code),
                   in_code_pcs=F.share_in_span(fit, F.subspace(W[kept], 10)),
                   pointwise_cos=float(np.mean(np.abs(np.sum(fit * wc, 1)) /
                                               np.maximum(np.linalg.norm(fit, axis=1) * np.linalg.norm(wc, axis=1),
                                                          1e-30))),
                   rms_ratio=float(np.sqrt((fit ** 2).sum(1).mean() / (wc ** 2).sum(1).mean())))
        row["offset_increment"] = row["both_share"] - row["wpos_share"]
    return row, fit, readout


def cluster_tables(occ, O, W_pos, T: int, heads, cfg: dict) -> dict:
    """The cluster's readings (items 3-6): ``rows`` (one per head), ``overlaps`` (pairwise principal-angle overlaps
    of the heads' write subspaces, readout cosines, chance level), ``model`` (the code's participation ratio) and
    ``fits`` ({head: positional write [n, d]}) for :func:`union_subspace`."""
    c = {**DEFAULTS, **cfg}
    keep = head_masks(occ, c["min_position"], c["max_other"])
    rows, fits, readouts, spans = [], {}, {}, {}
    for l, h in heads:
        m = keep[:, l, h]
        if m.sum() <= 12:
            continue
        row, fit, readout = _head_row(occ, m, l, h, O, W_pos, T, c)
        rows.append(row)
        fits[(l, h)], readouts[(l, h)] = fit, readout
        spans[(l, h)] = F.subspace(fit, int(c["write_rank"]))
    return dict(rows=pd.DataFrame(rows), fits=fits, **cluster_pairs(readouts, spans, O, W_pos, T, c))


def union_subspace(fits: dict, heads, dim: int, d: int) -> tuple[np.ndarray, float]:
    """S ``[d, k]``: the top ``dim`` principal directions of the positional writes of ``heads`` stacked
    (``k = min(dim, rank)``), and the share of their combined variance it holds (``[d, 0]`` and NaN without any)."""
    parts = [fits[h] for h in heads if h in fits]
    if not parts:
        return np.zeros((int(d), 0)), float("nan")
    stack = np.concatenate(parts, axis=0)
    k = int(min(int(dim), np.linalg.matrix_rank(stack)))
    S = F.subspace(stack, k)
    return S, F.share_in_span(stack, S)


def cluster_pairs(readouts: dict, spans: dict, O, W_pos, T: int, c: dict) -> dict:
    """The cluster's pairwise table (``overlaps``: principal overlap of the heads' write spans, |cos| of their
    readouts, the overlap of chance) and the ``model`` row (d, W_pos present, W_pos's participation ratio), from each
    head's readout and span (``{(l, h): ...}``); shared by the all-at-once and the streamed readings."""
    d = int(np.asarray(O).shape[-1])
    pairs = []
    names = list(readouts)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            ra, rb = readouts[a], readouts[b]
            cos = float(abs(ra @ rb) / max(np.linalg.norm(ra) * np.linalg.norm(rb), 1e-30))
            pairs.append(dict(head_a=f"L{a[0]}H{a[1]}", head_b=f"L{b[0]}H{b[1]}",
                              overlap=F.principal_overlap(spans[a], spans[b]), readout_cos=cos,
                              chance=F.chance_overlap(int(c["write_rank"]), int(c["write_rank"]), d)))
    model = dict(d_model=d, wpos=W_pos is not None, participation_ratio=np.nan)
    if W_pos is not None:
        model["participation_ratio"] = F.participation_ratio(np.asarray(W_pos, float)[int(c["min_position"]):T])
    return dict(overlaps=pd.DataFrame(pairs), model=model)
