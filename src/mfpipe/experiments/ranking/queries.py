"""The per-context deviation terms at the query positions only: the form pass 2 runs (paper Sec. 6, eq:dev-decomp).

:func:`query_terms` computes what :func:`mfpipe.meanfield.deviation.occurrence_terms` spells out over every (query, key)
position pair (z, ẑ, the mixed prediction, N_X; the definitions are in :mod:`mfpipe.meanfield.deviation`), at the tracked
query positions of a batch only, with the context-conditional kernel Â and the attention per key type held in type
space; :func:`query_plan` is its model-free plan of a batch, shared by all layers. Tests tie the two forms together,
underflowed attention included.

occurrence_terms is the definition: every [B, H, T, T] tensor spelled out (tests and small inputs). query_terms reads
the same three quantities at the query positions only, with Â and the attention per key type held in *type space*
[.., rows, U] (U = the distinct buckets among the keys, well below T on text: every untracked token is one <other>
bucket) instead of spread over key positions: Â_stX = n_t(X) W_st / N_X straight from the prefix counts,
ẑ = Â @ μ_types, and the mixed weight Â_t A_i / A_t = (Â_t / A_t) · A_i is one gather and one product at the key
positions. All windows of a batch go through each op together (rows padded to the longest window): on a CPU the
number of ops, not only their arithmetic, is what a per-window loop would pay. The model-free parts (query rows,
types, prefix counts, gather indices) are built once per batch (query_plan) and serve every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from mfpipe.meanfield.deviation import TINY, OccurrenceTerms

__all__ = ["QueryPlan", "query_plan", "QueryTerms", "query_terms", "QUERY_BLOCK"]

# query_terms works on spans of this many positions: a span's keys stop at its last query (causal), so n spans
# cover about (1 + 1/n) / 2 of the T x T square, at n times the number of ops, and bound the temporaries to
# [H, B, <= QUERY_BLOCK, T] (at most the size of the attention probabilities). Two spans at T = 512 beat one and
# four did not beat two (benchmarks/HISTORY.md).
QUERY_BLOCK = 256
# a key type whose attention total A_t is below this takes the exact per-position formula: Â_t / A_t would overflow
# float32 (Â_t <= 1) and A_t = 0 (every probability of the type underflowed) has its own definition
_UNDERFLOW = 1e-30


@dataclass
class _Span:
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


@dataclass
class QueryTerms(OccurrenceTerms):
    """:class:`OccurrenceTerms` at the query rows of a :class:`QueryPlan` (``[n, H, dh]``), with ``nx [n, H]`` (N_X,
    the normalizer of Â; NaN / 0 where the row is empty), ``valid [n]`` (as :func:`mfpipe.meanfield.ccmf.pair_kernel`: finite,
    positive N_X in every head) and ``other [n, H]`` (the attention on ``<other>`` keys, App. P's filter).
    Rows that are not valid carry whatever the inputs give: callers mask them."""

    nx: Tensor = None
    valid: Tensor = None
    other: Tensor = None


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
        spans.append(_Span(R, k, U, dev(np.arange(B)[:, None]), dev(rows_p), dev(counts, torch.float32),
                           dev(counts == 0, torch.float32), dev(w_index.reshape(-1)),
                           dev(np.stack([r[:k] for r in ranks])), dev(types_p), dev(np.maximum(o, 0)),
                           dev(o >= 0, torch.float32), dev(keep_idx), offset))
        offset += len(keep_idx)
    b_all = np.concatenate(span_b) if span_b else np.zeros(0, np.int64)
    j_all = np.concatenate(span_j) if span_j else np.zeros(0, np.int64)
    return QueryPlan(spans, dev(b_all), dev(j_all), dev(qt[b_all, j_all]))


def query_terms(plan: QueryPlan, probs: Tensor, values: Tensor, W: Tensor, mu: Tensor,
                reads: Tensor | None = None, n_tracked: int | None = None) -> QueryTerms:
    """z, ẑ and the mixed term at the query rows of ``plan`` (:func:`query_plan`), as :func:`occurrence_terms` gives
    them at those rows with Â from :func:`mfpipe.meanfield.ccmf.pair_kernel` (tests tie the two forms).

    ``probs [B, H, T, T]``, ``values [B, H, T, dh]``, ``W [H, N, K]`` one layer's kernel (NaN rows allowed),
    ``mu [H, K, dh]``, ``reads [B, T, H, dh]`` the model's reads to use as z (default Σ_i A_i v_i). float32 work, in
    head-major layout ``[H, B, rows, ..]`` (the layout of W's gather; the matmuls batch over (head, window)). With
    ``n_tracked`` N also ``mixed_tracked``, the mixed sum over the tracked key types (buckets < N) only."""
    H, N, K = W.shape
    B, dh = probs.shape[0], values.shape[-1]
    dt, device = probs.dtype, probs.device
    W_flat = W.to(dt).reshape(H, N * K)
    mu = mu.to(dt)
    P_hb, V_hb = probs.transpose(0, 1), values.to(dt).transpose(0, 1)  # [H, B, T, T], [H, B, T, dh] (views)
    n = plan.n
    out = {"zhat": torch.empty(n, H, dh, dtype=dt, device=device), "mixed": torch.empty(n, H, dh, dtype=dt, device=device),
           "nx": torch.empty(n, H, dtype=dt, device=device), "other": torch.empty(n, H, dtype=dt, device=device),
           "valid": torch.empty(n, dtype=torch.bool, device=device)}
    if n_tracked is not None:
        out["mixed_tracked"] = torch.empty(n, H, dh, dtype=dt, device=device)
    if reads is None:
        out["z"] = torch.empty(n, H, dh, dtype=dt, device=device)
    for sp in plan.spans:
        R, k, U = sp.R, sp.k, sp.U
        idx = sp.key_ranks[None, :, None, :].expand(H, B, R, k)
        P = P_hb[:, sp.window, sp.rows, :k]  # [H, B, R, k] the query rows' attention
        # Â per key type: n_t(X) W_st / N_X (types not in X_j read a weight of the prefix, times 0)
        ahat = W_flat.index_select(1, sp.w_index).view(H, B, R, U).mul_(sp.counts)
        nx = ahat.sum(-1)  # [H, B, R]
        valid = torch.isfinite(nx).all(0) & (nx > 0).all(0)  # [B, R]
        ahat.div_(torch.where(valid, nx, torch.ones_like(nx))[..., None])
        V = V_hb[:, :, :k]
        res = {"zhat": torch.matmul(ahat, mu[:, sp.types]), "nx": nx, "valid": valid}  # ẑ = Σ_t Â_t μ_t
        if reads is None:
            res["z"] = torch.matmul(P, V)
        A = torch.zeros(H, B, R, U, dtype=dt, device=device).scatter_add_(-1, idx, P)  # A_t: attention per key type
        res["other"] = A.gather(-1, sp.other[None, :, None, None].expand(H, B, R, 1)).squeeze(-1).mul_(sp.has_other[:, None])
        # types not in X_j get A_t = 1 (their Â_t is 0): then A_t < _UNDERFLOW flags only the prefix's types
        A.add_(sp.absent)
        exact = _exact_mixed_weights(A, ahat, sp, P, idx) if bool(A.amin() < _UNDERFLOW) else None
        ratio = ahat.div_(A.clamp_min_(_UNDERFLOW))  # Â_t / A_t, in place: ẑ is done
        mixed_w = ratio.gather(-1, idx).mul_(P)  # Â_t A_i / A_t at each key position i of type t (0 above j: P is)
        if exact is not None:
            mixed_w = torch.where(exact[0], exact[1], mixed_w)
        res["mixed"] = torch.matmul(mixed_w, V)
        if n_tracked is not None:
            # the tracked keys' part (not <bos>, not <other>): a second matmul over the columns of the smaller of the
            # two key sets only (the full-width masked product was a third of pass 2's time at N = 1000)
            tracked = sp.types.gather(1, sp.key_ranks) < int(n_tracked)  # [B, k]
            if int(tracked.sum(1).max()) <= int((~tracked).sum(1).max()):
                res["mixed_tracked"] = _keys_part(mixed_w, V, tracked)
            else:
                res["mixed_tracked"] = res["mixed"] - _keys_part(mixed_w, V, ~tracked)
        # [H, B, R, ..] -> the span's real rows [r, H, ..], written into the plan's rows
        rows = slice(sp.offset, sp.offset + sp.keep.shape[0])
        for key, x in res.items():
            x = x.movedim(0, 2) if x.dim() > 2 else x  # [B, R, H, ..] (a view)
            torch.index_select(x.reshape(B * R, *x.shape[2:]), 0, sp.keep, out=out[key][rows])
    z = reads[plan.b, plan.j].to(dt) if reads is not None else out["z"]
    return QueryTerms(z, out["zhat"], out["mixed"], out.get("mixed_tracked"), nx=out["nx"], valid=out["valid"],
                      other=out["other"])


def _keys_part(mixed_w: Tensor, V: Tensor, keys: Tensor) -> Tensor:
    """Σ_i mixed_w_i v_i over the key positions where ``keys [B, k]`` (bool) is set, ``[H, B, R, dh]``: those columns
    gathered, each window's padded to the window with the most (padding weight 0)."""
    H, B, R, k = mixed_w.shape
    count = keys.sum(1)  # [B]
    m = int(count.max())
    if m == 0:
        return mixed_w.new_zeros(H, B, R, V.shape[-1])
    cols = torch.argsort((~keys).to(torch.int8), dim=1, stable=True)[:, :m]  # [B, m] the set's columns first
    real = (torch.arange(m, device=keys.device) < count[:, None]).to(V.dtype)  # [B, m] 0 on padding
    w = mixed_w.gather(-1, cols[None, :, None, :].expand(H, B, R, m))
    v = V.gather(2, cols[None, :, :, None].expand(H, B, m, V.shape[-1])) * real[None, :, :, None]
    return torch.matmul(w, v)


def _exact_mixed_weights(A, ahat, sp, P, idx):
    """occurrence_terms' per-position mixed weight where a prefix type's attention is below _UNDERFLOW (Â_t / A_t
    would overflow): Â_t A_i / A_t, or Â's own weight Â_t / n_t where A_t = 0. (positions [H, B, R, k] bool, weights)"""
    H, B, R, k = P.shape
    causal = torch.arange(k, device=P.device) <= sp.rows[..., None]  # [B, R, k]
    at = (A < _UNDERFLOW).gather(-1, idx) & causal
    A_pos, ahat_pos = A.gather(-1, idx), ahat.gather(-1, idx)
    n_pos = sp.counts.gather(-1, sp.key_ranks[:, None, :].expand(B, R, k))
    return at, torch.where(A_pos > 0, ahat_pos * P / A_pos.clamp_min(TINY), ahat_pos / n_pos.clamp_min(1.0))
