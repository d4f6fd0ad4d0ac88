"""Pass 1, the statistics reducer: additive per-shard sums of every mean-field statistic (paper Sec. 3.1-3.2,
App. A, D, E, K).

Definitions (shared with the whole pipeline, see docs/conventions.md). A window is ``[BOS, t1 … t(T-1)]``.
Every position ``j ≥ 1`` whose type is tracked is one *context*: query ``x_j``, causal prefix = positions
``0..j`` inclusive. Key buckets: tracked types ``0..N-1`` (frequency rank), ``<bos>`` = ``N`` (position 0
only), ``<other>`` = ``N+1`` (positions ≥ 1 of an untracked type). ``K = N + 2``.

One forward pass per batch (:meth:`Adapter.capture`) feeds all layers' callbacks; each callback reduces its
layer's tensors at once into sums, so only one layer's ``[B,H,T,T]`` attention is ever alive. Everything is
vectorized (gather / index_add / bincount over buckets and query types), no per-position Python loop.

Hot path and precision (issue 13). Everything that depends only on the batch's tokens is planned once per batch
in :meth:`Accumulator.begin_batch` and shared by all layers:

- the attention kernel: the (query, key <= query) pairs of the batch's tracked queries
  (:func:`mfpipe.stats.buckets.causal_pairs`, in chunks of ``PAIR_CHUNK``), the flat index of each pair into
  a layer's ``[B,H,T,T]`` probabilities, and the pair's *compact cell*: the rank of its ``(s, t)`` cell among
  the distinct cells of the chunk (the same ``torch.unique`` gives ``nbar``: the pairs per cell). Per layer, one
  gather of every (pair, head) probability and one float32 ``index_add_`` into a small, cache-resident ``[U, H]``
  buffer (``U`` distinct cells), which is then added once into the kernel sum, held cell-major ``[L, N*K, H]``
  (the H heads of a cell are one cache line: the scattered add into the 0.6 GB sum touches U lines, not U*H);
- the per-position statistics: the batch's distinct buckets and each position's rank among them. Per layer,
  float32 ``index_add_`` of ``x, (x - c_b)², attn_out, mlp_out, ln1(x), values, reads`` into ``[U_b, ·]`` buffers
  (``U_b`` distinct buckets of the batch; ``c_b`` the batch's bucket mean, ``sum x²`` is restored in float64 as
  ``M2 + S1²/n``, so E[x²] - c² never cancels in float32), each then added once in float64 into its sum over
  the K buckets (one tensor per statistic, so :meth:`Accumulator.sums` hands out views, not copies).

So every floating-point sum is a float32 sum over ONE batch (bounded: at most the batch's positions / pairs of
one cell), added into the shard's sum once per batch: float64 for the per-position sums (``resid_var`` =
E[x²] - c² cancels), float32 for the kernel (``L H N K`` cells: 0.6 GB at N=1000 and 9.2 GB at N=4000 for
GPT-2 small, where float64 would be 1.2 / 18.4 GB). The kernel's error is then at most one float32 rounding per
batch and cell on top of the batch sums: ``|err| <= (m + n_b) u S`` with ``u = 2^-24``, ``m`` the most pairs of one
cell in a batch, ``n_b`` the batches of the shard and ``S`` the exact sum (a worst-case bound; the measured error
is far smaller: 2.7e-7 per cell on 2.05 M tokens, tests/test_stats_precision.py). ``resid_mid`` is not accumulated: it is ``resid_in +
attn_out`` (the adapter's definition), so its sum is the sum of theirs. Counts are int64.

Sums returned by :meth:`Accumulator.sums` (the shard loop: :func:`mfpipe.stats.shards.accumulate_shard`) (``L``
layers, ``H`` heads, ``d`` width, ``dh`` head width, ``T`` context length)::

    n_windows, n_tokens                 int64 []          windows / tokens (incl. BOS) seen
    query_count                         int64 [N]         n_s: number of type-s queries (contexts)
    key_count                           int64 [K]         positions per bucket (bucket N = n_windows)
    position_count                      int64 [T]         tracked-query positions per position index
    P_sum                               f32 [L,H,N,K]     sum over type-s queries of A_st (eq:P)
    nbar_sum                            int64 [N,K]       sum over type-s queries of n_t(X) (App. A)
    context_count                       int64 [N,K]       C_st: type-s queries with n_t(X) >= 1 (App. E)
    cooc                                int64 [N,K]       keys of bucket t within ±cooc_window of a type-s
                                                          query (excluding itself; Sec. 4.2 `cooc`)
    resid_sum, resid_sq_sum             f64 [L+1,K,d]     residual entering block l (l = L: final residual
                                                          before the last norm) and its square, by bucket
    attn_out_sum, resid_mid_sum,
    mlp_out_sum                         f64 [L,K,d]       attention / MLP branch outputs and post-attention
                                                          residual by bucket (App. K MLP gap)
    ln_in_sum                           f64 [L,K,d]       attention-input norm of the residual, ln1(x), by bucket
                                                          (App. D value-map Jensen gap); NaN without a norm fn
    value_sum                           f64 [L,H,K,dh]    per-head values by key bucket (-> mu_t)
    read_sum                            f64 [L,H,K,dh]    per-head reads by the position's bucket (-> zbar_s)
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from .buckets import COOC_WINDOW, PAIR_CHUNK, causal_pairs
from .errors import StatsError

# (pair, head) elements per layer up to which the gather / scatter indices of all heads are built once per batch
# (16 bytes each); above it they are built per layer, for slices of at most this many elements
INDEX_CACHE_MAX = 1 << 23


@dataclass
class _PairChunk:
    """One chunk of the batch's (query, key <= query) pairs, planned once per batch for every layer. Head-minor
    layout throughout: element ``i * H + h`` is head ``h`` of pair (or cell) ``i``."""

    gidx: torch.Tensor  # [M] flat index of each pair into head 0 of a layer's contiguous [B,H,T,T] probabilities
    pinv: torch.Tensor  # [M] the pair's compact cell: rank of its (s*K + t) among the chunk's distinct cells
    cells: torch.Tensor  # [U] the chunk's distinct cells s*K + t (rows of a layer's [N*K, H] kernel sum)
    cells_all: torch.Tensor  # [U*H] flat index of (cell, head) into a layer's [N*K*H] kernel sum
    idx_all: torch.Tensor | None  # [M*H] gather index of every (pair, head) (cached when M*H <= INDEX_CACHE_MAX)
    tgt_all: torch.Tensor | None  # [M*H] (compact cell, head) of every (pair, head) in the [U*H] batch buffer



@contextmanager
def reducer_threads(n: int | None):
    """Run a reducer's work on ``n`` torch threads (None: leave torch alone), restoring the caller's setting after:
    gather / scatter dominated reductions gain little from intra-op threads on CPU, and on a busy machine OpenMP
    barriers make their many small parallel ops 10-100x slower (the model's forward keeps its own setting)."""
    prev = torch.get_num_threads()
    if n is None or n == prev:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(prev)


class Accumulator:  # the pass-1 reducer (mfpipe.stats.shards.Reducer)
    """Accumulates the sums of one shard (or any set of batches) on ``device``.

    Drive it with the adapter callbacks: :meth:`begin_batch` with the batch's buckets, then :meth:`on_layer` per
    layer and :meth:`on_final`, then :meth:`end_batch`; :meth:`sums` returns the numpy sums.
    """

    def __init__(
        self,
        n_layers: int,
        n_heads: int,
        d_model: int,
        d_head: int,
        n_tracked: int,
        context_length: int,
        device: str | torch.device = "cpu",
        cooc_window: int = COOC_WINDOW,
        cpu_threads: int | None = 1,
        attn_input_norm: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
    ):
        self.L, self.H, self.d, self.dh = int(n_layers), int(n_heads), int(d_model), int(d_head)
        self.N = int(n_tracked)
        self.K = self.N + 2
        self.T = int(context_length)
        self.device = torch.device(device)
        self.cooc_window = int(cooc_window)
        # The reductions are gather / scatter dominated and gain nothing from intra-op threads on CPU; on a busy
        # machine OpenMP barriers make small parallel ops 10-100x slower. So on CPU they run on `cpu_threads`
        # threads (the model's forward keeps its own setting); None leaves torch alone.
        self.cpu_threads = cpu_threads if self.device.type == "cpu" else None
        self.attn_input_norm = attn_input_norm  # (layer, resid [B,T,d]) -> ln1(resid), e.g. adapter.attn_input_norm
        L, H, N, K, T, d, dh, dev = self.L, self.H, self.N, self.K, self.T, self.d, self.dh, self.device
        i64 = dict(dtype=torch.int64, device=dev)
        # per-position sums, float64, one tensor per statistic (sums() hands them out without copies)
        f64 = dict(dtype=torch.float64, device=dev)
        self.pos = {"resid": torch.zeros(L + 1, K, d, **f64), "resid_sq": torch.zeros(L + 1, K, d, **f64),
                    "attn_out": torch.zeros(L, K, d, **f64), "mlp_out": torch.zeros(L, K, d, **f64),
                    "ln_in": torch.zeros(L, K, d, **f64), "values": torch.zeros(L, K, H * dh, **f64),
                    "reads": torch.zeros(L, K, H * dh, **f64)}
        # kernel sums, cell-major: row s*K + t holds the H heads' sums (see the module docstring)
        self.P = torch.zeros(L, N * K, H, dtype=torch.float32, device=dev)
        self.nbar = torch.zeros(N * K, **i64)
        self.ctx = torch.zeros(N * K, **i64)
        self.cooc = torch.zeros(N * K, **i64)
        self.query_count = torch.zeros(N, **i64)
        self.key_count = torch.zeros(K, **i64)
        self.position_count = torch.zeros(T, **i64)
        self.n_windows = 0
        self.n_tokens = 0
        self._chunks: list[_PairChunk] = []
        self._kinv: torch.Tensor | None = None  # [B*T] rank of each position's bucket among the batch's buckets
        self._ub: torch.Tensor | None = None  # [U_b] the batch's distinct buckets (sorted)
        self._layers_seen: set[int] = set()
        self._final_seen = False

    def _threads(self):
        return reducer_threads(self.cpu_threads)

    # ------------------------------------------------------------------ per batch, model-free
    def begin_batch(self, kb: np.ndarray | torch.Tensor, qt: np.ndarray | torch.Tensor) -> None:
        """Register a batch's key buckets / query types ``[B,T]``, add its model-free counts and plan its
        reductions (shared by all layers)."""
        with self._threads():
            self._begin_batch(kb, qt)

    def _begin_batch(self, kb, qt) -> None:
        kb = torch.as_tensor(kb, dtype=torch.int64).to(self.device)
        qt = torch.as_tensor(qt, dtype=torch.int64).to(self.device)
        B, T = kb.shape
        if T != self.T:
            raise StatsError(f"batch has context length {T}, the accumulator expects {self.T}")
        N, K, H, dev = self.N, self.K, self.H, self.device
        kbf = kb.reshape(-1)
        self._ub, self._kinv, cnt = torch.unique(kbf, return_inverse=True, return_counts=True)
        self._ub_count32, self._ub_count64 = cnt.to(torch.float32), cnt.to(torch.float64)
        self._layers_seen = set()
        self._final_seen = False
        self.n_windows += B
        self.n_tokens += B * T
        qmask = qt >= 0
        self.query_count += torch.bincount(qt[qmask], minlength=N)
        self.key_count += torch.bincount(kbf, minlength=K)
        self.position_count += qmask.sum(0)
        arangeT = torch.arange(T, device=dev)
        heads = torch.arange(H, device=dev)

        # n_t(X) and C_st from the (query j, key k <= j) pairs of the batch (mfpipe.stats.buckets): nbar[s,t] counts
        # the pairs with a type-s query and a bucket-t key; C[s,t] the same over the first key of each bucket in its
        # window. The same pairs, with their compact cells, are the plan of the attention-kernel reduction.
        firstpos = torch.full((B, K), T, dtype=torch.int64, device=dev)
        firstpos.scatter_reduce_(1, kb, arangeT.expand(B, T), reduce="amin")
        first = firstpos.gather(1, kb) == arangeT  # [B,T]: first position of its bucket in the window
        chunks = []
        heads = torch.arange(H, device=dev)
        for bb, jj, kk in causal_pairs(qt, chunk=PAIR_CHUNK):
            cells, pinv, cnt = torch.unique(qt[bb, jj] * K + kb[bb, kk], return_inverse=True, return_counts=True)
            self.nbar.index_add_(0, cells, cnt)
            self.ctx.index_add_(0, cells, torch.bincount(pinv[first[bb, kk]], minlength=cells.numel()))
            gidx = ((bb * H) * T + jj) * T + kk
            cells_all = (cells[:, None] * H + heads).reshape(-1)
            idx_all = tgt_all = None
            if H * gidx.numel() <= INDEX_CACHE_MAX:
                idx_all, tgt_all = self._pair_index(gidx, pinv, heads)
            chunks.append(_PairChunk(gidx, pinv, cells, cells_all, idx_all, tgt_all))
        self._chunks = chunks

        # ±w co-occurrence: for each query position j (tracked, j >= 1), the buckets at j±1..j±w in the window
        w = min(self.cooc_window, T - 1)
        if w > 0:
            offs = torch.cat([torch.arange(1, w + 1, device=dev), -torch.arange(1, w + 1, device=dev)])
            pos = arangeT[:, None] + offs[None, :]  # [T, 2w]
            ok = qmask[:, :, None] & ((pos >= 0) & (pos < T))[None]  # [B, T, 2w]
            nb = kb[:, pos.clamp(0, T - 1)]  # [B, T, 2w] the neighbours' buckets
            cells = (qt[:, :, None] * K + nb)[ok]
            self.cooc.index_add_(0, cells, torch.ones_like(cells))

    # ------------------------------------------------------------------ adapter callbacks
    def on_layer(self, cap) -> None:
        """Reduce one layer's :class:`~mfpipe.models.adapters.LayerCapture` into the sums."""
        with self._threads():
            self._on_layer(cap)

    def _pair_index(self, gidx: torch.Tensor, pinv: torch.Tensor, heads: torch.Tensor):
        """(gather index into a layer's flat probabilities, scatter index into the [U*H] cell buffer) of every
        (pair, head), head-minor."""
        T, H = self.T, self.H
        return (gidx[:, None] + heads * (T * T)).reshape(-1), (pinv[:, None] * H + heads).reshape(-1)

    def _kernel(self, l: int, probs: torch.Tensor) -> None:
        """P[l] += the batch's attention probabilities summed by (query type, key bucket, head): one gather of every
        (pair, head) probability and one float32 ``index_add_`` into the chunk's compact [U*H] cell buffer (small,
        cache-resident), which is added once into the kernel sum. Head-minor layout, so that last scattered add
        touches one run of H contiguous floats per cell (one cache line), not H lines 4 N K bytes apart."""
        H = self.H
        pf = probs.reshape(-1) if probs.is_contiguous() else probs.contiguous().reshape(-1)
        heads = None
        for ch in self._chunks:
            M = ch.pinv.numel()
            buf = torch.zeros(ch.cells.numel() * H, dtype=torch.float32, device=pf.device)  # this batch's sums
            if ch.idx_all is not None:
                buf.index_add_(0, ch.tgt_all, pf.index_select(0, ch.idx_all).to(torch.float32))
            else:  # large chunk: slices of <= INDEX_CACHE_MAX (pair, head) elements
                heads = torch.arange(H, device=pf.device) if heads is None else heads
                step = max(1, INDEX_CACHE_MAX // H)
                for a in range(0, M, step):
                    idx, tgt = self._pair_index(ch.gidx[a : a + step], ch.pinv[a : a + step], heads)
                    buf.index_add_(0, tgt, pf.index_select(0, idx).to(torch.float32))
            self.P[l].view(-1).index_add_(0, ch.cells_all, buf)

    def _moments(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Float64 ``(sum x, sum x²)`` over the batch's buckets of float32 rows ``x [B*T, d]``. The square is summed
        around the batch's bucket mean in float32 and shifted back in float64 (``sum x² = M2 + S1²/n``), so its
        float32 error is relative to the spread, not to ``c²``: E[x²] - c² then cancels exactly in float64."""
        kinv = self._kinv
        U = self._ub.numel()
        s1 = torch.zeros(U, x.shape[1], dtype=torch.float32, device=x.device).index_add_(0, kinv, x)
        xc = x - (s1 / self._ub_count32[:, None]).index_select(0, kinv)
        m2 = torch.zeros_like(s1).index_add_(0, kinv, xc * xc)
        s1 = s1.to(torch.float64)
        return s1, m2.to(torch.float64) + s1 * s1 / self._ub_count64[:, None]

    def _on_layer(self, cap) -> None:
        l = int(cap.layer)
        if self._kinv is None:
            raise StatsError("Accumulator.on_layer called before begin_batch")
        H, T, d = self.H, self.T, self.d
        probs = cap.attn_probs
        B = probs.shape[0]
        if tuple(probs.shape) != (B, H, T, T):
            raise StatsError(f"layer {l}: attention probabilities have shape {tuple(probs.shape)}, expected {(B, H, T, T)}")
        self._kernel(l, probs)

        # per-position sums: float32 sums over the batch's distinct buckets (one contiguous buffer per statistic:
        # index_add_ into column slices of one wide buffer is 3x slower), then once into the float64 sums
        kinv, ub = self._kinv, self._ub
        BT = kinv.numel()
        f32 = torch.float32
        pos = self.pos

        def add(name, x):
            x = x.reshape(BT, -1).to(f32)
            part = torch.zeros(ub.numel(), x.shape[1], dtype=f32, device=kinv.device).index_add_(0, kinv, x)
            pos[name][l].index_add_(0, ub, part.to(torch.float64))

        s1, s2 = self._moments(cap.resid_in.reshape(BT, d).to(f32))
        pos["resid"][l].index_add_(0, ub, s1)
        pos["resid_sq"][l].index_add_(0, ub, s2)
        add("attn_out", cap.attn_out)
        add("mlp_out", cap.mlp_out)
        if self.attn_input_norm is not None:
            add("ln_in", self.attn_input_norm(l, cap.resid_in))
        add("values", cap.values.permute(0, 2, 1, 3))
        add("reads", cap.reads)
        self._layers_seen.add(l)

    def on_final(self, resid: torch.Tensor) -> None:
        with self._threads():
            self._on_final(resid)

    def _on_final(self, resid: torch.Tensor) -> None:
        kinv, d = self._kinv, self.d
        s1, s2 = self._moments(resid.reshape(kinv.numel(), d).to(torch.float32))
        self.pos["resid"][self.L].index_add_(0, self._ub, s1)
        self.pos["resid_sq"][self.L].index_add_(0, self._ub, s2)
        self._final_seen = True

    def end_batch(self) -> None:
        if len(self._layers_seen) != self.L or not self._final_seen:
            raise StatsError(
                f"the capture delivered layers {sorted(self._layers_seen)} and final={self._final_seen}; "
                f"expected all {self.L} layers and the final residual"
            )
        self._chunks = []
        self._kinv = self._ub = None

    # ------------------------------------------------------------------ output
    def sums(self) -> dict[str, np.ndarray]:
        """Numpy sums (see the module docstring): ``P_sum`` float32, the other float sums float64, counts int64.
        On CPU most are views of the accumulators (no copies: treat them as read-only, take them after the last
        batch)."""
        L, H, N, K, d, dh = self.L, self.H, self.N, self.K, self.d, self.dh

        def np_(t):
            return t.detach().cpu().numpy()

        pos = {k: np_(v) for k, v in self.pos.items()}  # views of the CPU accumulators, no copies
        resid = pos["resid"]
        ln_in = pos["ln_in"] if self.attn_input_norm is not None else np.full((L, K, d), np.nan)
        return {
            "n_windows": np.asarray(self.n_windows, dtype=np.int64),
            "n_tokens": np.asarray(self.n_tokens, dtype=np.int64),
            "query_count": np_(self.query_count),
            "key_count": np_(self.key_count),
            "position_count": np_(self.position_count),
            "context_count": np_(self.ctx).reshape(N, K),
            "cooc": np_(self.cooc).reshape(N, K),
            "P_sum": np_(self.P).reshape(L, N, K, H).transpose(0, 3, 1, 2),  # a view [L, H, N, K]
            "nbar_sum": np_(self.nbar).reshape(N, K),
            "resid_sum": resid,
            "resid_sq_sum": pos["resid_sq"],
            "attn_out_sum": pos["attn_out"],
            "resid_mid_sum": resid[:L] + pos["attn_out"],  # resid_mid = resid_in + attn_out (the adapter's definition)
            "mlp_out_sum": pos["mlp_out"],
            "ln_in_sum": ln_in,
            "value_sum": pos["values"].reshape(L, K, H, dh).transpose(0, 2, 1, 3),
            "read_sum": pos["reads"].reshape(L, K, H, dh).transpose(0, 2, 1, 3),
        }
