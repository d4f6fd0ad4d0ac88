"""The per-context deviation terms at the query positions only: the form pass 2 runs (paper Sec. 6, eq:dev-decomp).

:func:`query_terms` computes what :func:`mfpipe.meanfield.deviation.occurrence_terms` spells out over every (query, key)
position pair (z, ẑ, the mixed prediction, N_X; the definitions are in :mod:`mfpipe.meanfield.deviation`), at the tracked
query positions of a batch only, with the context-conditional kernel Â and the attention per key type held in type
space; :func:`mfpipe.meanfield.plan.query_plan` is its model-free plan of a batch, shared by all layers (and by the
substitution's ẑ). Tests tie the two forms together, underflowed attention included.

occurrence_terms is the definition: every [B, H, T, T] tensor spelled out (tests and small inputs). query_terms reads
the same three quantities at the query positions only, with Â and the attention per key type held in *type space*
[.., rows, U] (U = the distinct buckets among the keys, well below T on text: every untracked token is one <other>
bucket) instead of spread over key positions: Â_stX = n_t(X) W_st / N_X straight from the prefix counts,
ẑ = Â @ μ_types, and the mixed weight Â_t A_i / A_t = (Â_t / A_t) · A_i is one gather and one product at the key
positions. All windows of a batch go through each op together (rows padded to the longest window): on a CPU the
number of ops, not only their arithmetic, is what a per-window loop would pay. On CPU the middle of that (the
attention per key type, the ratio, the mixed weights, the <other> share, the gather of one key set's weights) is one
compiled loop over each query row's keys up to the row (:mod:`mfpipe.deviation._native_loops`), equal to the
torch ops bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mfpipe.stats.engine import engine_name
from mfpipe.meanfield.deviation import TINY, OccurrenceTerms
from mfpipe.meanfield.plan import QueryPlan, span_kernel

__all__ = ["KeyPart", "QueryTerms", "key_part", "query_terms"]

# a key type whose attention total A_t is below this takes the exact per-position formula: Â_t / A_t would overflow
# float32 (Â_t <= 1) and A_t = 0 (every probability of the type underflowed) has its own definition
_UNDERFLOW = 1e-30


@dataclass
class QueryTerms(OccurrenceTerms):
    """:class:`OccurrenceTerms` at the query rows of a :class:`QueryPlan` (``[n, H, dh]``), with ``nx [n, H]`` (N_X,
    the normalizer of Â; NaN / 0 where the row is empty), ``valid [n]`` (as :func:`mfpipe.meanfield.ccmf.pair_kernel`: finite,
    positive N_X in every head) and ``other [n, H]`` (the attention on ``<other>`` keys, App. P's filter).
    Rows that are not valid carry whatever the inputs give: callers mask them."""

    nx: Tensor = None
    valid: Tensor = None
    other: Tensor = None


def query_terms(plan: QueryPlan, probs: Tensor, values: Tensor, W: Tensor, mu: Tensor,
                reads: Tensor | None = None, n_tracked: int | None = None, engine: str = "auto") -> QueryTerms:
    """z, ẑ and the mixed term at the query rows of ``plan`` (:func:`mfpipe.meanfield.plan.query_plan`), as :func:`occurrence_terms` gives
    them at those rows with Â from :func:`mfpipe.meanfield.ccmf.pair_kernel` (tests tie the two forms).

    ``probs [B, H, T, T]``, ``values [B, H, T, dh]``, ``W [H, N, K]`` one layer's kernel (NaN rows allowed),
    ``mu [H, K, dh]``, ``reads [B, T, H, dh]`` the model's reads to use as z (default Σ_i A_i v_i). float32 work, in
    head-major layout ``[H, B, rows, ..]`` (the layout of W's gather; the matmuls batch over (head, window)). With
    ``n_tracked`` N also ``mixed_tracked``, the mixed sum over the tracked key types (buckets < N) only.

    ``engine``: "native" computes the mixed weights and the ``<other>`` shares of each span with the compiled loop of
    :mod:`mfpipe.deviation._native_loops` (CPU, float32, numba installed), "torch" with torch ops (any
    device), "auto" the first where it runs; the two agree bit for bit. ``probs``, ``values`` and ``reads`` may be
    views of some heads of a layer's tensors (pass 2 gives each of two threads half the heads): no copy is made."""
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
    loops = _native_loops() if _engine(engine, probs) == "native" else None
    # the loop reads each query row's keys in place: a view of some heads needs no copy, only contiguous rows
    probs_np = (probs if probs.stride(-1) == 1 else probs.contiguous()).numpy() if loops is not None else None
    for sp in plan.spans:
        R, k, U = sp.R, sp.k, sp.U
        # Â per key type: n_t(X) W_st / N_X (types not in X_j read a weight of the prefix, times 0)
        ahat, nx, valid = span_kernel(sp, W_flat)  # Â per key type [H, B, R, U], N_X, validity
        V = V_hb[:, :, :k]
        res = {"zhat": torch.matmul(ahat, mu[:, sp.types]), "nx": nx, "valid": valid}  # ẑ = Σ_t Â_t μ_t
        if reads is None or loops is None:
            P = P_hb[:, sp.window, sp.rows, :k]  # [H, B, R, k] the query rows' attention
            if reads is None:
                res["z"] = torch.matmul(P, V)
        part = key_part(sp, n_tracked) if n_tracked is not None else None
        if loops is not None:
            mixed_w, res["other"], w_part = _native_mixed_weights(loops, probs_np, sp, ahat, H, part)
        else:
            idx = sp.key_ranks[None, :, None, :].expand(H, B, R, k)
            A = torch.zeros(H, B, R, U, dtype=dt, device=device).scatter_add_(-1, idx, P)  # A_t: attention per key type
            res["other"] = A.gather(-1, sp.other[None, :, None, None].expand(H, B, R, 1)).squeeze(-1).mul_(sp.has_other[:, None])
            # types not in X_j get A_t = 1 (their Â_t is 0): then A_t < _UNDERFLOW flags only the prefix's types
            A.add_(sp.absent)
            exact = _exact_mixed_weights(A, ahat, sp, P, idx) if bool((A < _UNDERFLOW).any()) else None
            ratio = ahat.div_(A.clamp_min_(_UNDERFLOW))  # Â_t / A_t, in place: ẑ is done
            mixed_w = ratio.gather(-1, idx).mul_(P)  # Â_t A_i / A_t at each key position i of type t (0 above j: P is)
            if exact is not None:
                mixed_w = torch.where(exact[0], exact[1], mixed_w)
            w_part = None
        res["mixed"] = torch.matmul(mixed_w, V)
        if part is not None:
            # the tracked keys' part (not <bos>, not <other>): a second matmul over the columns of the smaller of the
            # two key sets only (the full-width masked product was a third of pass 2's time at N = 1000)
            x = _keys_part(mixed_w, V, part, w_part)
            res["mixed_tracked"] = x if part.tracked else res["mixed"] - x
        # [H, B, R, ..] -> the span's real rows [r, H, ..], written into the plan's rows
        rows = slice(sp.offset, sp.offset + sp.keep.shape[0])
        for key, x in res.items():
            x = x.movedim(0, 2) if x.dim() > 2 else x  # [B, R, H, ..] (a view)
            torch.index_select(x.reshape(B * R, *x.shape[2:]), 0, sp.keep, out=out[key][rows])
    z = reads[plan.b, plan.j].to(dt) if reads is not None else out["z"]
    return QueryTerms(z, out["zhat"], out["mixed"], out.get("mixed_tracked"), nx=out["nx"], valid=out["valid"],
                      other=out["other"])


def _engine(engine: str, probs: Tensor) -> str:
    name = engine_name(engine, probs.device)
    if probs.dtype != torch.float32:
        if engine == "native":
            raise ValueError(f"engine='native' runs on float32 attention, not {probs.dtype}; use engine='torch'")
        return "torch"
    return name


_loops = None


def _native_loops():
    global _loops
    if _loops is None:
        from mfpipe.deviation import _native_loops as loops

        _loops = loops
    return _loops


def _native_mixed_weights(loops, probs_np, sp, ahat: Tensor, H: int, part: KeyPart | None):
    """The span's mixed weights ``[H, B, R, k]``, ``<other>`` shares ``[H, B, R]`` and, with ``part``, the weights of
    its key columns ``[H, B, R, m]`` (0 on padding) from the compiled loop (``span_mixed_weights``)."""
    B = sp.window.shape[0]
    mixed_w = torch.empty(H, B, sp.R, sp.k, dtype=torch.float32)
    other = torch.empty(H, B, sp.R, dtype=torch.float32)
    cols, count = (part.cols, part.count) if part is not None else (sp.key_ranks[:, :0], sp.has_other.new_zeros(B, dtype=torch.long))
    w_part = torch.empty(H, B, sp.R, cols.shape[1], dtype=torch.float32)
    loops.span_mixed_weights(probs_np, sp.rows.numpy(), sp.key_ranks.numpy(), ahat.numpy(), sp.absent.numpy(),
                             sp.counts.numpy(), sp.other.numpy(), sp.has_other.numpy(), cols.numpy(), count.numpy(),
                             0, H, mixed_w.numpy(), other.numpy(), w_part.numpy())
    return mixed_w, other, (w_part if part is not None else None)


@dataclass
class KeyPart:
    """The key columns of a span whose mixed sum :func:`query_terms` takes apart (``mixed_tracked``): the tracked
    keys (``tracked``) or, where they are the larger set, the others; ``cols [B, m]`` their positions, each window's
    first (padded to the window with the most: the padding's weights or values are 0), ``count [B]`` how many."""

    tracked: bool
    cols: Tensor
    count: Tensor
    real: Tensor  # [B, m] float 1.0 on a window's own columns, 0.0 on padding


def key_part(sp, n_tracked: int) -> KeyPart:
    """:class:`KeyPart` of span ``sp`` for ``n_tracked`` tracked types, once per batch (cached on the span)."""
    part = sp.cache.get(("key_part", int(n_tracked)))
    if part is None:
        tracked = sp.types.gather(1, sp.key_ranks) < int(n_tracked)  # [B, k]
        use_tracked = int(tracked.sum(1).max()) <= int((~tracked).sum(1).max())
        keys = tracked if use_tracked else ~tracked
        count = keys.sum(1)  # [B]
        m = int(count.max())
        cols = torch.argsort((~keys).to(torch.int8), dim=1, stable=True)[:, :m].contiguous()  # the set's columns first
        real = (torch.arange(m, device=keys.device) < count[:, None]).to(torch.float32)
        part = sp.cache[("key_part", int(n_tracked))] = KeyPart(use_tracked, cols, count.contiguous(), real)
    return part


def _keys_part(mixed_w: Tensor, V: Tensor, part: KeyPart, w_part: Tensor | None = None) -> Tensor:
    """Σ_i mixed_w_i v_i over the key columns of ``part`` ``[H, B, R, dh]``: those columns' weights (``w_part`` where
    the compiled loop wrote them, else gathered) and values (gathered, 0 on padding)."""
    H, B, R, k = mixed_w.shape
    m = part.cols.shape[1]
    if m == 0:
        return mixed_w.new_zeros(H, B, R, V.shape[-1])
    if w_part is None:
        w_part = mixed_w.gather(-1, part.cols[None, :, None, :].expand(H, B, R, m))
    v = V.gather(2, part.cols[None, :, :, None].expand(H, B, m, V.shape[-1])) * part.real[None, :, :, None]
    return torch.matmul(w_part, v)


def _exact_mixed_weights(A, ahat, sp, P, idx):
    """occurrence_terms' per-position mixed weight where a prefix type's attention is below _UNDERFLOW (Â_t / A_t
    would overflow): Â_t A_i / A_t, or Â's own weight Â_t / n_t where A_t = 0. (positions [H, B, R, k] bool, weights)"""
    H, B, R, k = P.shape
    causal = torch.arange(k, device=P.device) <= sp.rows[..., None]  # [B, R, k]
    at = (A < _UNDERFLOW).gather(-1, idx) & causal
    A_pos, ahat_pos = A.gather(-1, idx), ahat.gather(-1, idx)
    n_pos = sp.counts.gather(-1, sp.key_ranks[:, None, :].expand(B, R, k))
    return at, torch.where(A_pos > 0, ahat_pos * P / A_pos.clamp_min(TINY), ahat_pos / n_pos.clamp_min(1.0))
