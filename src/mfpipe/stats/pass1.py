"""Pass 1, the statistics reducer: additive per-shard sums of every mean-field statistic (paper Sec. 3.1-3.2,
App. A, D, E, K).

Definitions (shared with the whole pipeline, see docs/conventions.md). A window is ``[BOS, t1 … t(T-1)]``.
Every position ``j ≥ 1`` whose type is tracked is one *context*: query ``x_j``, causal prefix = positions
``0..j`` inclusive. Key buckets: tracked types ``0..N-1`` (frequency rank), ``<bos>`` = ``N`` (position 0
only), ``<other>`` = ``N+1`` (positions ≥ 1 of an untracked type). ``K = N + 2``.

One forward pass per batch (:meth:`Adapter.capture`) feeds all layers' callbacks; each callback reduces its
layer's tensors at once into sums, so only one layer's ``[B,H,T,T]`` attention is ever alive. Everything is
vectorized (gather / index_add / bincount over buckets and query types), no per-position Python loop.

The attention kernel has two reductions (same sums; ``p_mode``): "flat" enumerates every (query, key <= query)
pair of the batch once per batch and, per layer, gathers all heads' probabilities of those pairs and
index_adds them straight into the float64 sums (a few large ops: best for short windows / small batches);
"window" loops over the batch's windows, pools repeated query types and compacts keys to the window's
distinct buckets, accumulates in float32 on the model device (one addition per cell per window) and flushes
into float64 every ``flush_every`` batches (fewer elements: best for long windows). "auto" picks flat while a
layer's (pair, head) elements stay <= ``FLAT_MAX_ELEMENTS``. Counts are int64, all other sums float64 on the
model device. Partials (one per shard) are float64 / int64 and merge by addition (:mod:`mfpipe.stats.partials`).

Sums returned by :meth:`Accumulator.sums` (the shard loop: :func:`mfpipe.stats.shards.accumulate_shard`) (``L`` layers, ``H`` heads, ``d`` width, ``dh`` head width,
``T`` context length)::

    n_windows, n_tokens                 int64 []          windows / tokens (incl. BOS) seen
    query_count                         int64 [N]         n_s: number of type-s queries (contexts)
    key_count                           int64 [K]         positions per bucket (bucket N = n_windows)
    position_count                      int64 [T]         tracked-query positions per position index
    P_sum                               f64 [L,H,N,K]     sum over type-s queries of A_st (eq:P)
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

from .buckets import COOC_WINDOW, PAIR_CHUNK, causal_pairs, n_pairs
from .errors import StatsError

FLAT_MAX_ELEMENTS = 1 << 24  # "auto" uses the flat kernel reduction up to this many (pair, head) elements per layer


@dataclass
class _Window:
    """Per-window compaction shared by every layer of one batch."""

    b: int
    jq: torch.Tensor  # [Mb] query positions (tracked, >= 1)
    invq: torch.Tensor  # [Mb] -> index into uq
    uq: torch.Tensor  # [nq] distinct query types in the window
    inv: torch.Tensor  # [T] -> index into u
    u: torch.Tensor  # [nu] distinct key buckets in the window
    tgt: torch.Tensor  # [H*nq*nu] flat index into the [H,N,K] kernel accumulator


class Accumulator:  # the pass-1 reducer (mfpipe.stats.shards.Reducer)
    """Accumulates the sums of one shard (or any set of batches) on ``device``.

    Use :meth:`add_batch` with an adapter, or drive it yourself: :meth:`begin_batch` with the batch's
    buckets, then :meth:`on_layer` per layer and :meth:`on_final` (exactly the adapter callbacks).
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
        flush_every: int = 8,
        cooc_window: int = COOC_WINDOW,
        cpu_threads: int | None = 1,
        attn_input_norm: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
        p_mode: str = "auto",
    ):
        self.L, self.H, self.d, self.dh = int(n_layers), int(n_heads), int(d_model), int(d_head)
        self.N = int(n_tracked)
        self.K = self.N + 2
        self.T = int(context_length)
        self.device = torch.device(device)
        self.flush_every = max(1, int(flush_every))
        self.cooc_window = int(cooc_window)
        # The reductions are scatter / index_add dominated and gain nothing from intra-op threads on CPU;
        # on a busy machine OpenMP barriers make small parallel ops 10-100x slower. So on CPU they run on
        # `cpu_threads` threads (the model's forward keeps its own setting); None leaves torch alone.
        self.cpu_threads = cpu_threads if self.device.type == "cpu" else None
        self.attn_input_norm = attn_input_norm  # (layer, resid [B,T,d]) -> ln1(resid), e.g. adapter.attn_input_norm
        # Attention-kernel reduction: "flat" = one gather + one index_add over every (query, key <= query) pair of
        # the batch (few large ops: best for short windows); "window" = per window, pool repeated query types and
        # compact keys to the window's distinct buckets first (fewer elements: best for long windows).
        if p_mode not in ("auto", "flat", "window"):
            raise StatsError(f"p_mode must be 'auto', 'flat' or 'window', got {p_mode!r}")
        self.p_mode = p_mode
        self._flat = None
        self._mode = None
        L, H, N, K, T, d, dh, dev = self.L, self.H, self.N, self.K, self.T, self.d, self.dh, self.device
        f64 = dict(dtype=torch.float64, device=dev)
        i64 = dict(dtype=torch.int64, device=dev)
        self.P64 = torch.zeros(L, H * N * K, **f64)
        self.P32: torch.Tensor | None = None  # float32 staging for "window" mode, allocated on first use
        self.nbar = torch.zeros(N * K, **i64)
        self.ctx = torch.zeros(N * K, **i64)
        self.cooc = torch.zeros(N * K, **i64)
        self.query_count = torch.zeros(N, **i64)
        self.key_count = torch.zeros(K, **i64)
        self.position_count = torch.zeros(T, **i64)
        self.resid = torch.zeros(L + 1, K, d, **f64)
        self.resid_sq = torch.zeros(L + 1, K, d, **f64)
        self.attn_out = torch.zeros(L, K, d, **f64)
        self.resid_mid = torch.zeros(L, K, d, **f64)
        self.mlp_out = torch.zeros(L, K, d, **f64)
        self.ln_in = torch.zeros(L, K, d, **f64) if attn_input_norm is not None else torch.full((L, K, d), float("nan"), **f64)
        self.values = torch.zeros(L, K, H * dh, **f64)
        self.reads = torch.zeros(L, K, H * dh, **f64)
        self.n_windows = 0
        self.n_tokens = 0
        self._batches_since_flush = 0
        self._windows: list[_Window] = []
        self._kb_flat: torch.Tensor | None = None
        self._layers_seen: set[int] = set()
        self._final_seen = False

    @contextmanager
    def _threads(self):
        n = torch.get_num_threads()
        if self.cpu_threads is None or n == self.cpu_threads:
            yield
            return
        torch.set_num_threads(self.cpu_threads)
        try:
            yield
        finally:
            torch.set_num_threads(n)

    # ------------------------------------------------------------------ per batch, model-free
    def begin_batch(self, kb: np.ndarray | torch.Tensor, qt: np.ndarray | torch.Tensor) -> None:
        """Register a batch's key buckets / query types ``[B,T]`` and add its model-free counts."""
        with self._threads():
            self._begin_batch(kb, qt)

    def _begin_batch(self, kb, qt) -> None:
        kb = torch.as_tensor(kb, dtype=torch.int64).to(self.device)
        qt = torch.as_tensor(qt, dtype=torch.int64).to(self.device)
        B, T = kb.shape
        if T != self.T:
            raise StatsError(f"batch has context length {T}, the accumulator expects {self.T}")
        N, K, H, dev = self.N, self.K, self.H, self.device
        self._kb_flat = kb.reshape(-1)
        self._layers_seen = set()
        self._final_seen = False
        self.n_windows += B
        self.n_tokens += B * T
        qmask = qt >= 0
        self.query_count += torch.bincount(qt[qmask], minlength=N)
        self.key_count += torch.bincount(self._kb_flat, minlength=K)
        self.position_count += qmask.sum(0)
        arangeT = torch.arange(T, device=dev)

        # n_t(X) and C_st from the (query j, key k <= j) pairs of the batch (mfpipe.stats.buckets): nbar[s,t] counts
        # the pairs with a type-s query and a bucket-t key; C[s,t] the same over the first key of each bucket in its
        # window. In "window" mode they come in chunks of <= PAIR_CHUNK; in "flat" mode they are kept for the kernel.
        firstpos = torch.full((B, K), T, dtype=torch.int64, device=dev)
        firstpos.scatter_reduce_(1, kb, arangeT.expand(B, T), reduce="amin")
        first = firstpos.gather(1, kb) == arangeT  # [B,T]: first position of its bucket in the window
        mode = self.p_mode
        if mode == "auto":
            mode = "flat" if n_pairs(qt) * H <= FLAT_MAX_ELEMENTS else "window"
        self._mode = mode
        self._flat = None
        keep = mode == "flat"
        for bb, jj, kk in causal_pairs(qt, chunk=None if keep else PAIR_CHUNK):
            base = qt[bb, jj] * K + kb[bb, kk]
            self.nbar += torch.bincount(base, minlength=N * K)
            self.ctx += torch.bincount(base[first[bb, kk]], minlength=N * K)
            if keep:  # flat gather / scatter indices for all heads: [H, pairs]
                hh = torch.arange(H, device=dev)[:, None]
                gidx = ((bb * H) * T + jj) * T + kk
                self._flat = (gidx[None, :] + hh * (T * T), base[None, :] + hh * (N * K))

        # ±w co-occurrence: for each query position j (tracked, j >= 1), the buckets at j±1..j±w in the window
        for off in range(1, min(self.cooc_window, T - 1) + 1):
            for q, k in ((qt[:, :-off], kb[:, off:]), (qt[:, off:], kb[:, :-off])):
                m = q >= 0
                self.cooc.index_add_(0, q[m] * K + k[m], torch.ones_like(k[m]))

        # per-window plan for the attention kernel ("window" mode), shared by all layers of the batch
        windows = []
        if mode == "window":
            hoff = (torch.arange(H, device=dev) * N)[:, None, None]
            for b in range(B):
                jqb = torch.nonzero(qmask[b]).reshape(-1)
                if jqb.numel() == 0:
                    continue
                u, inv = torch.unique(kb[b], return_inverse=True)
                uq, invq = torch.unique(qt[b, jqb], return_inverse=True)
                tgt = ((hoff + uq[None, :, None]) * K + u[None, None, :]).reshape(-1)
                windows.append(_Window(b, jqb, invq, uq, inv, u, tgt))
        self._windows = windows

    # ------------------------------------------------------------------ adapter callbacks
    def on_layer(self, cap) -> None:
        """Reduce one layer's :class:`~mfpipe.models.adapters.LayerCapture` into the sums."""
        with self._threads():
            self._on_layer(cap)

    def _on_layer(self, cap) -> None:
        l = int(cap.layer)
        if self._kb_flat is None:
            raise StatsError("Accumulator.on_layer called before begin_batch")
        H, T, dh = self.H, self.T, self.dh
        probs = cap.attn_probs
        B = probs.shape[0]
        if tuple(probs.shape) != (B, H, T, T):
            raise StatsError(f"layer {l}: attention probabilities have shape {tuple(probs.shape)}, expected {(B, H, T, T)}")
        if self._flat is not None:
            # every (head, query, key <= query) probability straight into the float64 kernel sums
            gidx, tgt = self._flat
            vals = probs.reshape(-1)[gidx.reshape(-1)].to(torch.float64)
            self.P64[l].index_add_(0, tgt.reshape(-1), vals)
        if self._windows and self.P32 is None:
            self.P32 = torch.zeros_like(self.P64, dtype=torch.float32)
        acc = self.P32[l] if self.P32 is not None else None
        for w in self._windows:
            src = probs[w.b][:, w.jq].to(torch.float32)  # [H, Mb, T] rows of tracked queries
            nq = w.uq.numel()
            if nq < w.jq.numel():  # pool repeated query types of the window first
                pooled = torch.zeros(H, nq, T, dtype=torch.float32, device=src.device)
                pooled.index_add_(1, w.invq, src)
                src = pooled
            byk = torch.zeros(H, nq, w.u.numel(), dtype=torch.float32, device=src.device)
            byk.index_add_(2, w.inv, src)  # keys -> the window's distinct buckets
            acc.index_add_(0, w.tgt, byk.reshape(-1))
        kbf = self._kb_flat
        BT = kbf.numel()
        f64 = torch.float64
        x = cap.resid_in.reshape(BT, self.d).to(f64)
        self.resid[l].index_add_(0, kbf, x)
        self.resid_sq[l].index_add_(0, kbf, x * x)
        self.attn_out[l].index_add_(0, kbf, cap.attn_out.reshape(BT, self.d).to(f64))
        self.resid_mid[l].index_add_(0, kbf, cap.resid_mid.reshape(BT, self.d).to(f64))
        self.mlp_out[l].index_add_(0, kbf, cap.mlp_out.reshape(BT, self.d).to(f64))
        if self.attn_input_norm is not None:
            y = self.attn_input_norm(l, cap.resid_in)
            self.ln_in[l].index_add_(0, kbf, y.reshape(BT, self.d).to(f64))
        self.values[l].index_add_(0, kbf, cap.values.permute(0, 2, 1, 3).reshape(BT, H * dh).to(f64))
        self.reads[l].index_add_(0, kbf, cap.reads.reshape(BT, H * dh).to(f64))
        self._layers_seen.add(l)

    def on_final(self, resid: torch.Tensor) -> None:
        with self._threads():
            self._on_final(resid)

    def _on_final(self, resid: torch.Tensor) -> None:
        kbf = self._kb_flat
        x = resid.reshape(kbf.numel(), self.d).to(torch.float64)
        self.resid[self.L].index_add_(0, kbf, x)
        self.resid_sq[self.L].index_add_(0, kbf, x * x)
        self._final_seen = True

    def end_batch(self) -> None:
        if len(self._layers_seen) != self.L or not self._final_seen:
            raise StatsError(
                f"the capture delivered layers {sorted(self._layers_seen)} and final={self._final_seen}; "
                f"expected all {self.L} layers and the final residual"
            )
        self._windows = []
        self._flat = None
        self._kb_flat = None
        self._batches_since_flush += 1
        if self._batches_since_flush >= self.flush_every:
            self.flush()

    def flush(self) -> None:
        if self.P32 is not None:
            self.P64 += self.P32
            self.P32.zero_()
        self._batches_since_flush = 0

    # ------------------------------------------------------------------ output
    def sums(self) -> dict[str, np.ndarray]:
        """Float64 / int64 numpy sums (see the module docstring)."""
        self.flush()
        L, H, N, K, dh = self.L, self.H, self.N, self.K, self.dh

        def np_(t):
            return t.detach().cpu().numpy()

        return {
            "n_windows": np.asarray(self.n_windows, dtype=np.int64),
            "n_tokens": np.asarray(self.n_tokens, dtype=np.int64),
            "query_count": np_(self.query_count),
            "key_count": np_(self.key_count),
            "position_count": np_(self.position_count),
            "context_count": np_(self.ctx).reshape(N, K),
            "cooc": np_(self.cooc).reshape(N, K),
            "P_sum": np_(self.P64).reshape(L, H, N, K),
            "nbar_sum": np_(self.nbar).reshape(N, K),
            "resid_sum": np_(self.resid),
            "resid_sq_sum": np_(self.resid_sq),
            "attn_out_sum": np_(self.attn_out),
            "resid_mid_sum": np_(self.resid_mid),
            "mlp_out_sum": np_(self.mlp_out),
            "ln_in_sum": np_(self.ln_in),
            "value_sum": np_(self.values).reshape(L, K, H, dh).transpose(0, 2, 1, 3).copy(),
            "read_sum": np_(self.reads).reshape(L, K, H, dh).transpose(0, 2, 1, 3).copy(),
        }
