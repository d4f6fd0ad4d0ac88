"""Mean-field deviation of every head on every context (paper Sec. 6: eq:deviation, eq:dev-decomp, eq:mcov-mctx,
eq:head-meters, eq:ddec; App. B eq:dev-split-app) — the tensor math, one definition for pass 2, the prompt
classes and the lenses.

For a head on a context X with query type s (a tracked position j, prefix 0..j; :mod:`mfpipe.ccmf`):

* ``z``     = Σ_i A_i v_i, the head's read (what attention computed);
* ``ẑ``     = Σ_t Â_stX μ_t, the context-conditional mean field (eq:ccmf);
* ``mixed`` = Σ_t Â_stX v̄_tX, predicted attention on the actual in-context values, where v̄_tX = Σ_{i∈t} A_i v_i
  / A_stX is the attention-weighted mean value of the prefix's type-t keys (A_stX = Σ_{i∈t} A_i);

so the covariance term (a) = z − mixed and the contextualization term (b) = mixed − ẑ sum to z − ẑ exactly
(eq:dev-decomp). Per key position i of type t the mixed weight is Â_stX A_i / A_stX (where A_stX underflows to 0
the prediction's own per-position weight is used: v̄_tX is then undefined and the term reads Â's values).

Geometry: "the value function includes the head's output projection, so all quantities are in residual-stream
units" (App. P): vectors stay in head space (``dh``) and every inner product is taken through the head's slice of
the output projection, ⟨x, y⟩ = x O_h O_hᵀ yᵀ with ``O_h = out_proj_slices(l)[h]`` ``[dh, d]`` (:func:`residual_gram`),
which equals the dot product of the head's residual-stream contributions x O_h and y O_h (no bias: it is shared by
the heads). Then D = 1 − cos(z, ẑ) (eq:deviation) and, with e = z − ẑ and e⊥ its component orthogonal to ẑ,
σ_cov = a·e⊥/|e⊥|², σ_ctx = b·e⊥/|e⊥|² (σ_cov + σ_ctx = 1), M_cov = σ_cov D, M_ctx = σ_ctx D (eq:mcov-mctx,
summing to D). When e⊥ vanishes (z collinear with ẑ: D is 0 or 2) the shares are undefined (the paper's footnote);
we split D evenly and count the case (``degenerate``).

The per-type corpus deviation (eq:ddec) compares the head's mean read per query type, z̄_s = E_s[z], with the mean
prediction E_s[ẑ] by a cosine centred over the query types with at least ``min_occurrences`` occurrences
(:func:`corpus_deviation`).

Two forms of the per-context terms, tied by tests: :func:`occurrence_terms` spells the definition out over every
(query, key) position pair; :func:`query_terms` (what pass 2 runs) computes the same at the query positions only,
with Â and the attention per key type held in type space.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

__all__ = ["key_type_ranks", "same_type_sums", "OccurrenceTerms", "occurrence_terms", "QueryPlan", "query_plan",
           "QueryTerms", "query_terms", "residual_gram", "layer_grams", "gram_dot", "deviation_cosine", "meters",
           "stack_head_major", "meters_head_major", "corpus_deviation", "MIN_OCCURRENCES", "QUERY_BLOCK"]

MIN_OCCURRENCES = 50  # eq:ddec: S̄ averages over the query types with at least this many occurrences
_TINY = 1e-30
# query_terms works on spans of this many positions: a span's keys stop at its last query (causal), so n spans
# cover about (1 + 1/n) / 2 of the T x T square, at n times the number of ops, and bound the temporaries to
# [H, B, <= QUERY_BLOCK, T] (at most the size of the attention probabilities). At T = 512 on CPU two spans took
# about 10 % less time than one and four no less than two (query_terms alone, GPT-2-small shape, N = 1000).
QUERY_BLOCK = 256
# a key type whose attention total A_t is below this takes the exact per-position formula: Â_t / A_t would overflow
# float32 (Â_t <= 1) and A_t = 0 (every probability of the type underflowed) has its own definition
_UNDERFLOW = 1e-30


def key_type_ranks(kb: Tensor) -> Tensor:
    """Per window, each position's bucket as a rank among the window's distinct buckets: ``[B, T]`` in ``0..T-1``
    (positions of one bucket share a rank). Lets per-type sums over a window's keys be a scatter into T slots."""
    s, order = kb.sort(dim=1)
    new = torch.ones_like(s, dtype=torch.long)
    new[:, 1:] = (s[:, 1:] != s[:, :-1]).long()
    ranks_sorted = new.cumsum(1) - 1
    return torch.empty_like(ranks_sorted).scatter_(1, order, ranks_sorted)


def same_type_sums(w: Tensor, ranks: Tensor) -> Tensor:
    """``out[b, h, j, i] = Σ_{i': bucket(i') = bucket(i)} w[b, h, j, i']`` for ``w [B, H, T, T]`` (query, key) and
    ``ranks [B, T]`` from :func:`key_type_ranks`: each key position gets its type's total weight in row j (for a
    causal ``w`` that is the type's weight in the prefix). One scatter and one gather, ``B H T²``."""
    B, H, T, _ = w.shape
    idx = ranks[:, None, None, :].expand(B, H, T, T)
    totals = torch.zeros_like(w).scatter_add_(-1, idx, w)
    return totals.gather(-1, idx)


@dataclass
class OccurrenceTerms:
    """One layer's reads and predictions per query position and head, head space ``[B, T, H, dh]``."""

    z: Tensor  # the read, Σ_i A_i v_i
    zhat: Tensor  # the mean field, Σ_t Â_stX μ_t (eq:ccmf)
    mixed: Tensor  # Σ_t Â_stX v̄_tX: predicted attention on the in-context values
    mixed_tracked: Tensor | None = None  # the same sum over the tracked key types only (when asked for)

    @property
    def covariance(self) -> Tensor:  # term (a) of eq:dev-decomp
        return self.z - self.mixed

    @property
    def contextualization(self) -> Tensor:  # term (b) of eq:dev-decomp
        return self.mixed - self.zhat


def occurrence_terms(probs: Tensor, values: Tensor, a_hat: Tensor, mu: Tensor, kb: Tensor, reads: Tensor | None = None,
                     ranks: Tensor | None = None, n_tracked: int | None = None) -> OccurrenceTerms:
    """z, ẑ and the mixed term for every (query position, head) of one layer.

    ``probs [B, H, T, T]`` attention (query, key), ``values [B, H, T, dh]``, ``a_hat [B, H, T, T]`` Â spread over key
    positions (:func:`mfpipe.ccmf.pair_kernel`, transposed to batch-major), ``mu [H, K, dh]`` the bucket mean values,
    ``kb [B, T]`` key buckets. ``reads [B, T, H, dh]``: the model's own reads to use as z (default Σ_i A_i v_i).
    Rows that are not valid queries come out as whatever the inputs give (callers mask them). With ``n_tracked`` N
    also ``mixed_tracked``, the mixed sum over the tracked key buckets (``kb < N``) only."""
    dt = probs.dtype
    ranks = key_type_ranks(kb) if ranks is None else ranks
    a_hat = a_hat.to(dt)
    A_type = same_type_sums(probs, ranks)
    Ahat_type = same_type_sums(a_hat, ranks)
    mixed_w = torch.where(A_type > 0, Ahat_type * probs / A_type.clamp_min(_TINY), a_hat)
    mixed = torch.matmul(mixed_w, values.to(dt))  # [B, H, T, dh]
    mixed_tracked = None
    if n_tracked is not None:
        tracked_keys = (kb < int(n_tracked)).to(dt)[:, None, None, :]
        mixed_tracked = torch.matmul(mixed_w * tracked_keys, values.to(dt)).transpose(1, 2)
    zhat = torch.matmul(a_hat, mu.to(dt)[:, kb].transpose(0, 1))  # μ of each key's bucket: [B, H, T, dh]
    z = torch.matmul(probs, values.to(dt)).transpose(1, 2) if reads is None else reads.to(dt)
    return OccurrenceTerms(z, zhat.transpose(1, 2), mixed.transpose(1, 2), mixed_tracked)


# ---------------------------------------------------------------------------------------------- the fast form
# occurrence_terms above is the definition: every [B, H, T, T] tensor spelled out (tests and small inputs). Pass 2
# runs query_terms, the same three reads at the query positions only, with Â and the attention per key type held in
# *type space* [.., rows, U] (U = the distinct buckets among the keys, well below T on text: every untracked token
# is one <other> bucket) instead of spread over key positions: Â_stX = n_t(X) W_st / N_X straight from the prefix
# counts, ẑ = Â @ μ_types, and the mixed weight Â_t A_i / A_t = (Â_t / A_t) · A_i is one gather and one product at
# the key positions. All windows of a batch go through each op together (rows padded to the longest window): on a
# CPU the number of ops, not only their arithmetic, is what a per-window loop would pay. The model-free parts
# (query rows, types, prefix counts, gather indices) are built once per batch (query_plan) and serve every layer.


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
    the normalizer of Â; NaN / 0 where the row is empty), ``valid [n]`` (as :func:`mfpipe.ccmf.pair_kernel`: finite,
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
    them at those rows with Â from :func:`mfpipe.ccmf.pair_kernel` (tests tie the two forms).

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
    return at, torch.where(A_pos > 0, ahat_pos * P / A_pos.clamp_min(_TINY), ahat_pos / n_pos.clamp_min(1.0))


def residual_gram(out_proj_slices: Tensor) -> Tensor:
    """``G_h = O_h O_hᵀ`` ``[H, dh, dh]`` from ``[H, dh, d]``: the residual-stream inner product in head space."""
    o = out_proj_slices.to(torch.float64)
    return o @ o.transpose(1, 2)


def layer_grams(adapter) -> Tensor:
    """``[L, H, dh, dh]``: :func:`residual_gram` of every layer's output projection slices (the adapter's)."""
    return torch.stack([residual_gram(adapter.out_proj_slices(l).float()) for l in range(adapter.n_layers)])


def gram_dot(x: Tensor, y: Tensor, G: Tensor) -> Tensor:
    """⟨x, y⟩ through each head's gram, ``[..., H, dh] x [..., H, dh] -> [..., H]``."""
    return (torch.einsum("...hd,hde->...he", x, G.to(x.dtype)) * y).sum(-1)


def deviation_cosine(z: Tensor, zhat: Tensor, G: Tensor | None = None) -> Tensor:
    """D = 1 − cos(z, ẑ) per ``[..., H]`` (eq:deviation), in residual-stream units through ``G`` (head space
    when ``G`` is None). float64. A zero vector has cosine 0 (D = 1)."""
    z, zhat = z.to(torch.float64), zhat.to(torch.float64)
    if G is None:
        zz, hh, zh = (z * z).sum(-1), (zhat * zhat).sum(-1), (z * zhat).sum(-1)
    else:
        zz, hh, zh = gram_dot(z, z, G), gram_dot(zhat, zhat, G), gram_dot(z, zhat, G)
    return 1.0 - zh / (zz * hh).clamp_min(_TINY).sqrt()


def meters(terms: OccurrenceTerms, G: Tensor) -> dict[str, Tensor]:
    """Per occurrence and head ``[..., H]`` (float64): ``D``, ``sigma_cov``, ``sigma_ctx``, ``M_cov`` = σ_cov D,
    ``M_ctx`` = σ_ctx D and ``degenerate`` (bool: e⊥ = 0, shares split evenly). See the module docstring."""
    shape = terms.z.shape[:-1]  # [..., H]
    m = meters_head_major(stack_head_major(terms), G)
    return {k: v.transpose(0, 1).reshape(shape) for k, v in m.items()}


def stack_head_major(terms: OccurrenceTerms) -> Tensor:
    """``[3, H, dh, n]`` float64: z, ẑ, mixed of ``[..., H, dh]`` terms (n = the leading axes flattened), head-major
    with the rows last, so that each head's gram product is one ``G @ x`` over its n rows (on CPU about twice as fast
    as ``x @ G`` in float64) and the inner products reduce over ``dh`` with the rows contiguous (the cast to float64
    is this one copy)."""
    H, dh = terms.z.shape[-2:]
    X = torch.empty(3, H, dh, terms.z[..., 0, 0].numel(), dtype=torch.float64, device=terms.z.device)
    for i, x in enumerate((terms.z, terms.zhat, terms.mixed)):
        X[i].copy_(x.reshape(-1, H, dh).permute(1, 2, 0))
    return X


def meters_head_major(X: Tensor, G: Tensor) -> dict[str, Tensor]:
    """:func:`meters` of :func:`stack_head_major`'s ``X [3, H, dh, n]``: each ``[H, n]``.

    Two gram products, G z and G ẑ, give the five inner products ⟨z,z⟩, ⟨z,ẑ⟩, ⟨ẑ,ẑ⟩, ⟨m,z⟩, ⟨m,ẑ⟩ (m the mixed
    term), and every quantity of the split is a combination of those: with e = z − ẑ, c = ⟨e,ẑ⟩/⟨ẑ,ẑ⟩ and
    e⊥ = z − (1 + c) ẑ, |e⊥|² = |e|² − c⟨e,ẑ⟩, ⟨a, e⊥⟩ for a = z − m and ⟨b, e⊥⟩ for b = m − ẑ expand bilinearly.
    In float64 from float32 inputs the expansions lose ~1e-16 of |z|² + |ẑ|² (a relative 1e-16 / D on D, far below
    the inputs' own precision); e⊥ counts as zero (degenerate: the shares split evenly) below 1e-13 of that."""
    G = G.to(X.dtype)
    Gz, Gh = torch.bmm(G, X[0]), torch.bmm(G, X[1])  # [H, dh, n]
    zz, zh, zm = (X * Gz).sum(2)  # [H, n] each
    hh, hm = (X[1:] * Gh).sum(2)
    eh = zh - hh
    coef = torch.where(hh > _TINY, eh / hh.clamp_min(_TINY), torch.zeros_like(hh))
    pp = (zz - 2.0 * zh + hh) - coef * eh  # |e⊥|²
    c1 = 1.0 + coef
    a_perp = zz - c1 * zh - zm + c1 * hm  # ⟨z − m, z − (1 + c) ẑ⟩
    b_perp = zm - c1 * hm - zh + c1 * hh  # ⟨m − ẑ, z − (1 + c) ẑ⟩
    degenerate = pp <= 1e-13 * (zz + hh)
    safe = torch.where(degenerate, torch.ones_like(pp), pp)
    s_cov = torch.where(degenerate, torch.full_like(pp, 0.5), a_perp / safe)
    s_ctx = torch.where(degenerate, torch.full_like(pp, 0.5), b_perp / safe)
    D = 1.0 - zh / (zz * hh).clamp_min(_TINY).sqrt()  # deviation_cosine from the same products
    return {"D": D, "sigma_cov": s_cov, "sigma_ctx": s_ctx, "M_cov": s_cov * D, "M_ctx": s_ctx * D,
            "degenerate": degenerate}


def corpus_deviation(zbar: np.ndarray, zhat_bar: np.ndarray, counts: np.ndarray, gram: np.ndarray,
                     min_occurrences: int = MIN_OCCURRENCES) -> tuple[np.ndarray, np.ndarray]:
    """eq:ddec per head: ``(S [L, H, N], S_bar [L, H])``.

    ``zbar``/``zhat_bar [L, H, N, dh]`` the mean read and mean prediction per query type (head space), ``counts
    [N]`` or ``[L, H, N]`` the occurrences behind each mean, ``gram [L, H, dh, dh]`` (:func:`residual_gram`). Over
    the types with ``counts >= min_occurrences`` both are centred (the type-mean removed) and compared by cosine in
    residual-stream units; ``S_s = 1 − cos_c``, NaN for the other types; ``S̄`` their mean (NaN with < 2 types)."""
    zbar = np.asarray(zbar, dtype=np.float64)
    zhat_bar = np.asarray(zhat_bar, dtype=np.float64)
    L, H, N, dh = zbar.shape
    keep = np.broadcast_to(np.asarray(counts) >= int(min_occurrences), (L, H, N))
    S = np.full((L, H, N), np.nan)
    S_bar = np.full((L, H), np.nan)
    for l in range(L):
        for h in range(H):
            k = keep[l, h] & np.isfinite(zbar[l, h]).all(-1) & np.isfinite(zhat_bar[l, h]).all(-1)
            if k.sum() < 2:
                continue
            x = zbar[l, h, k] - zbar[l, h, k].mean(0)
            y = zhat_bar[l, h, k] - zhat_bar[l, h, k].mean(0)
            G = np.asarray(gram[l, h], dtype=np.float64)
            xy = np.einsum("sd,de,se->s", x, G, y)
            xx = np.einsum("sd,de,se->s", x, G, x)
            yy = np.einsum("sd,de,se->s", y, G, y)
            S[l, h, k] = 1.0 - xy / np.sqrt(np.maximum(xx * yy, _TINY))
            S_bar[l, h] = S[l, h, k].mean()
    return S, S_bar
