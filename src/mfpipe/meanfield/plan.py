"""The model-free plan of a batch's query rows, and the context-conditional mean field at those rows (paper
eq:w-def-appendix, eq:ccmf) in *type space*: the form the substitution and pass 2 run.

:func:`query_plan` lays out, once per batch, every tracked query row of every window (in spans of
:data:`QUERY_BLOCK` positions: a span's keys stop at its last query), the distinct key buckets of each window's
prefix (ranked in order of first occurrence) and their prefix counts n_t(X_j). :func:`span_kernel` then gives a
layer's Â_stX = n_t(X) W_st / N_X per key *type* ``[H, B, R, U]`` (U = the distinct buckets among the span's keys,
well below T on text: every untracked token is one <other> bucket), and :func:`ccmf_rows` ẑ = Σ_t Â_stX μ_t at
every query row. :func:`mfpipe.meanfield.ccmf.ccmf_reads` computes the same ẑ over key *positions* (the pair form,
``[H, B, T, T]``); tests tie the two forms together and to a per-position loop.

All windows of a batch go through each op together (rows padded to the longest window): on a CPU the number of ops,
not only their arithmetic, is what a per-window loop would pay.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

__all__ = ["QUERY_BLOCK", "QueryPlan", "Span", "ccmf_rows", "query_plan", "span_kernel"]

# query_terms works on spans of this many positions: a span's keys stop at its last query (causal), so n spans
# cover about (1 + 1/n) / 2 of the T x T square, at n times the number of ops, and bound the temporaries to
# [H, B, <= QUERY_BLOCK, T] (at most the size of the attention probabilities). Two spans at T = 512 beat one and
# four did not beat two (benchmarks/HISTORY.md).
QUERY_BLOCK = 256

@dataclass
class Span:
    """The query rows of every window inside positions ``[j0, j0 + block)``, padded to ``R`` rows per window; their
    keys are ``0..k-1`` (k = the last row + 1: causal) and hold at most ``U`` distinct buckets per window, ranked in
    order of first occurrence (rank 0: position 0's bucket, in every prefix). Padding rows have no key (counts 0)."""

    R: int
    k: int
    U: int
    window: Tensor  # [B, 1] window index (broadcasts against rows)
    rows: Tensor  # [B, R] positions (padding: 0)
    counts: Tensor  # [B, R, U] float32 n_t(X_j), the prefix count of each key type of the window (0: not in X_j)
    absent: Tensor  # [B, R, U] float32 1.0 where counts == 0
    w_index: Tensor  # [B * R * U] into W.reshape(H, N * K): (query type of row j) * K + bucket of type u, or of
    #                  rank 0 where type u is not in X_j (that weight is multiplied by 0; rank 0's W is part of N_X)
    key_ranks: Tensor  # [B, k] rank of each key position's bucket
    types: Tensor  # [B, U] bucket of each rank (padding: 0)
    other: Tensor  # [B] rank of the <other> bucket among the span's keys (0 where it has none: see has_other)
    has_other: Tensor  # [B] float32 1.0 / 0.0
    keep: Tensor  # [r] the real rows (not padding) in the span's flattened (window, row) axis
    offset: int  # where the span's rows start in the plan's rows
    cache: dict = field(default_factory=dict, repr=False)  # what a caller derives once per batch, shared by layers


@dataclass
class QueryPlan:
    """The model-free part of :func:`query_terms` for one batch (:func:`query_plan`): its spans and, per query row
    (span by span, each in (window, position) order), ``b``, ``j`` and its query type ``s`` (``[n]`` each)."""

    spans: list
    b: Tensor
    j: Tensor
    s: Tensor

    @property
    def n(self) -> int:
        return int(self.b.shape[0])


def query_plan(kb, qt, n_buckets: int, device=None, block: int | None = None) -> QueryPlan:
    """The model-free part of :func:`query_terms` for ``kb``/``qt [B, T]`` (:func:`mfpipe.stats.buckets.window_buckets`;
    ``n_buckets`` = K = N + 2, the ``<other>`` bucket being K - 1) on ``device``; spans of ``block`` positions
    (default :data:`QUERY_BLOCK`)."""
    block = int(block or QUERY_BLOCK)
    kb = np.asarray(kb.cpu() if isinstance(kb, Tensor) else kb, dtype=np.int64)
    qt = np.asarray(qt.cpu() if isinstance(qt, Tensor) else qt, dtype=np.int64)
    B, T = kb.shape
    K = int(n_buckets)

    def dev(x, dtype=torch.long):
        return torch.as_tensor(np.ascontiguousarray(x), dtype=dtype, device=device)

    ranks, types, n_types, prefix, other = [], [], [], [], []
    for b in range(B):
        uniq, first, inv = np.unique(kb[b], return_index=True, return_inverse=True)
        # ranks in order of first occurrence: the keys 0..k-1 then use ranks below their own number of types
        order = np.argsort(first, kind="stable")
        rank_of = np.empty_like(order)
        rank_of[order] = np.arange(len(order))
        ranks.append(rank_of[inv.reshape(-1)])
        types.append(uniq[order])
        n_types.append(np.maximum.accumulate(ranks[-1]) + 1)  # distinct buckets among keys 0..j
        onehot = np.zeros((T, len(uniq)), np.float32)
        onehot[np.arange(T), ranks[-1]] = 1.0
        prefix.append(onehot.cumsum(0))  # [T, U_b]: n_t(X_j)
        other.append(int(rank_of[np.searchsorted(uniq, K - 1)]) if (uniq == K - 1).any() else -1)
    spans, span_b, span_j = [], [], []
    offset = 0
    for j0 in range(0, T, block):
        rows = [np.nonzero(qt[b, j0 : j0 + block] >= 0)[0] + j0 for b in range(B)]
        R = max(len(r) for r in rows)
        if R == 0:
            continue
        k = max(int(r[-1]) + 1 for r in rows if len(r))
        U = max(int(n_types[b][k - 1]) for b in range(B))
        rows_p = np.zeros((B, R), np.int64)
        keep = np.zeros((B, R), bool)
        counts = np.zeros((B, R, U), np.float32)
        types_p = np.zeros((B, U), np.int64)
        w_index = np.zeros((B, R, U), np.int64)
        for b, r in enumerate(rows):
            u = int(n_types[b][k - 1])
            rows_p[b, : len(r)], keep[b, : len(r)] = r, True
            counts[b, : len(r), :u] = prefix[b][r, :u]
            types_p[b, :u] = types[b][:u]
            s = qt[b, r] * K
            w_index[b, : len(r)] = np.where(counts[b, : len(r)] > 0, s[:, None] + types_p[b][None, :], (s + types[b][0])[:, None])
            span_b.append(np.full(len(r), b))
            span_j.append(r)
        o = np.array([x if 0 <= x < int(n_types[b][k - 1]) else -1 for b, x in enumerate(other)])
        keep_idx = np.flatnonzero(keep)
        spans.append(Span(R, k, U, dev(np.arange(B)[:, None]), dev(rows_p), dev(counts, torch.float32),
                           dev(counts == 0, torch.float32), dev(w_index.reshape(-1)),
                           dev(np.stack([r[:k] for r in ranks])), dev(types_p), dev(np.maximum(o, 0)),
                           dev(o >= 0, torch.float32), dev(keep_idx), offset))
        offset += len(keep_idx)
    b_all = np.concatenate(span_b) if span_b else np.zeros(0, np.int64)
    j_all = np.concatenate(span_j) if span_j else np.zeros(0, np.int64)
    return QueryPlan(spans, dev(b_all), dev(j_all), dev(qt[b_all, j_all]))


def span_kernel(sp: Span, W_flat: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """One layer's Â over a span's rows per key type: ``(ahat [H, B, R, U], nx [H, B, R], valid [B, R])``.

    ``W_flat [H, N * K]`` is the layer's kernel ``W [H, N, K]`` flattened (NaN rows allowed). ``ahat`` =
    n_t(X_j) W_st / N_X (types not in X_j read a weight of the prefix, times a count of 0); N_X = Σ_t n_t W_st;
    ``valid``: finite, positive N_X in every head (:func:`mfpipe.meanfield.ccmf.pair_kernel`'s definition). Rows
    that are not valid keep their unnormalised weights (callers mask them)."""
    H = W_flat.shape[0]
    B = sp.window.shape[0]
    ahat = W_flat.index_select(1, sp.w_index).view(H, B, sp.R, sp.U).mul_(sp.counts)
    nx = ahat.sum(-1)  # [H, B, R]
    valid = torch.isfinite(nx).all(0) & (nx > 0).all(0)  # [B, R]
    ahat.div_(torch.where(valid, nx, torch.ones_like(nx))[..., None])
    return ahat, nx, valid


def ccmf_rows(plan: QueryPlan, W: Tensor, mu: Tensor) -> tuple[Tensor, Tensor]:
    """ẑ_sX (eq:ccmf) at every query row of ``plan``: ``(zhat [n, H, dh], valid [n])``, one layer's ``W [H, N, K]``
    and ``mu [H, K, dh]``, in ``W``'s dtype. Rows that are not valid carry whatever the weights give."""
    H, N, K = W.shape
    W_flat = W.reshape(H, N * K)
    mu = mu.to(W.dtype)
    zhat = torch.empty(plan.n, H, mu.shape[-1], dtype=W.dtype, device=W.device)
    valid = torch.empty(plan.n, dtype=torch.bool, device=W.device)
    for sp in plan.spans:
        B = sp.window.shape[0]
        ahat, _, v = span_kernel(sp, W_flat)
        z = torch.matmul(ahat, mu[:, sp.types])  # [H, B, R, dh]
        rows = slice(sp.offset, sp.offset + sp.keep.shape[0])
        torch.index_select(z.movedim(0, 2).reshape(B * sp.R, H, -1), 0, sp.keep, out=zhat[rows])
        torch.index_select(v.reshape(-1), 0, sp.keep, out=valid[rows])
    return zhat, valid
