"""Pass 1, the statistics reducer: additive per-shard sums of every mean-field statistic (paper Sec. 3.1-3.2,
App. A, D, E, K).

Definitions (shared with the whole pipeline, see docs/conventions.md). A window is ``[BOS, t1 … t(T-1)]``.
Every position ``j ≥ 1`` whose type is tracked is one *context*: query ``x_j``, causal prefix = positions
``0..j`` inclusive. Key buckets: tracked types ``0..N-1`` (frequency rank), ``<bos>`` = ``N`` (position 0
only), ``<other>`` = ``N+1`` (positions ≥ 1 of an untracked type). ``K = N + 2``.

One forward pass per batch (:meth:`Adapter.run` with :attr:`Accumulator.select`) feeds all layers' callbacks; each callback reduces its
layer's tensors at once into sums, so only one layer's ``[B,H,T,T]`` attention is ever alive. Everything is
vectorized (gather / index_add / bincount over buckets and query types), no per-position Python loop.

Hot path and precision (issue 13). Everything that depends only on the batch's tokens is planned once per batch
in :meth:`Accumulator.begin_batch` and shared by all layers: the (query, key <= query) pairs of the tracked queries
(the order of :func:`mfpipe.stats.buckets.causal_pairs`, in groups of at most ``PAIR_CHUNK`` pairs) with each
pair's *compact cell* (its rank among the group's distinct ``(s, t)`` cells, found without sorting), and the
batch's distinct buckets with each position's rank among them. Per layer, the kernel is summed per compact cell in
float32 into the batch's ``[U, L*H]`` sums, which :meth:`Accumulator.end_batch` adds once into the kernel sum, held
cell-major and layer-minor ``[N*K, L*H]`` (one run of L*H contiguous floats per cell and batch, not one per layer:
the forward evicts the sum between layers; above ``DEFERRED_SUMS_MAX`` bytes each layer is added as it comes); each
per-position statistic is summed in float32 over the batch's buckets and added once into its float64 sum over the K
buckets (the square around the batch's bucket mean, ``sum x² = M2 + S1²/n``, so E[x²] - c² never cancels in
float32). What is an affine map of another statistic's rows (the per-head values, attn_out where no norm follows
the output projection) or a difference of the others (mlp_out in a float32 model) is not summed per position, nor read
by the capture: :meth:`Accumulator.sums` derives it (:mod:`mfpipe.stats.derived`, with its error bounds), and a layer
whose MLP output is not read is reduced before its MLP runs.

Two engines compute these sums (``engine=``), behind one protocol (:class:`mfpipe.stats.engine.Engine`): on CPU
with numba installed (the default there, ``"native"``) each reduction is one compiled loop of
:mod:`mfpipe.stats.native`, adding the same terms in the same order and precision as the torch ops of ``"torch"``
(every device, GPUs included; :mod:`mfpipe.stats.torch_engine`), so the two engines' sums are equal bit for bit
(tests/test_stats_native.py), except ``ln_in_sum`` and the value sums made from it where the adapter writes its
attention-input norm as a :class:`~mfpipe.models.adapters.NormForm` (``attn_input_norm_form``) that reproduces the
module on a probe: the native engine then sums the normalised rows in its own loop and applies the affine in
float64, equal to float32 rounding. The engine adds into the sums the accumulator owns
(:class:`~mfpipe.stats.engine.Totals`); the counts ``nbar``, ``C``, ``cooc`` are complete only in :meth:`sums`.

On CPU, where the job has two or more threads, each layer's reduction (from ``HELPER_MIN_PROBS`` attention
elements on) is split between the calling thread and one helper thread (:class:`HelperThread`): half the heads of
the kernel and part of the per-position statistics each, written into disjoint sums, so the sums are bit for bit
those of one thread. The forward is parked while a callback runs, so the job's second core would otherwise idle.
Measurements of both: benchmarks/HISTORY.md, "Pass 1 (statistics)".

The temporaries of the hot path are reused buffers (:class:`~mfpipe.stats.workspace.Scratch`): on CPU a fresh multi-MB tensor is
page-faulted in on first touch, which on a VM cost as much as the arithmetic of these reductions.

So every floating-point sum is a float32 sum over ONE batch (bounded: at most the batch's positions / pairs of
one cell), added into the shard's sum once per batch: float64 for the per-position sums (``resid_var`` =
E[x²] - c² cancels), float32 for the kernel (``L H N K`` cells: 0.6 GB at N=1000 and 9.2 GB at N=4000 for
GPT-2 small, where float64 would be 1.2 / 18.4 GB). The kernel's error is then at most one float32 rounding per
batch and cell on top of the batch sums: ``|err| <= (m + n_b) u S`` with ``u = 2^-24``, ``m`` the most pairs of one
cell in a batch, ``n_b`` the batches of the shard and ``S`` the exact sum (a worst-case bound; the measured error
is far smaller: 2.7e-7 per cell on 2.05 M tokens, tests/test_stats_precision.py). ``resid_mid`` is not accumulated:
it is ``resid_in + attn_out`` (the adapter's definition), so its sum is the sum of theirs. Counts are int64.

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
                                                          residual by bucket (App. K MLP gap); with
                                                          mlp_out_from_resid: resid_sum[l+1] - resid_mid_sum
    ln_in_sum                           f64 [L,K,d]       attention-input norm of the residual, ln1(x), by bucket
                                                          (App. D value-map Jensen gap); NaN without a norm fn
    value_sum                           f64 [L,H,K,dh]    per-head values by key bucket (-> mu_t); with
                                                          value_weights: (ln_in_sum W + key_count b) per head
    read_sum                            f64 [L,H,K,dh]    per-head reads by the position's bucket (-> zbar_s)
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from mfpipe.stats import derived
from mfpipe.stats.buckets import COOC_WINDOW, PAIR_CHUNK
from mfpipe.stats.engine import BatchPlan, Engine, Totals, engine_name
from mfpipe.stats.errors import StatsError
from mfpipe.workflow.heap import hold_heap_blocks, release_free_memory
from mfpipe.stats.workspace import HelperThread, Scratch, reducer_threads

# bytes up to which a batch's kernel sums of all layers ([U, L*H] float32 per pair chunk) are kept for one add into
# P at the end of the batch; above it (large models: L*H in the thousands) each layer is added as it comes
DEFERRED_SUMS_MAX = 1 << 28
# attention elements [B*H*T*T] of a layer from which its reduction is split with the helper thread (HelperThread):
# below, handing half the work over costs about what it saves (measured: benchmarks/HISTORY.md)
HELPER_MIN_PROBS = 1 << 22
# entries of the native plan's [n_ub, n_ub] compaction table (4 MB of int32: up to 1024 buckets in a batch)
RANK_TABLE_MAX = 1 << 20


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
        value_weights: Callable[[int], tuple[torch.Tensor, torch.Tensor | None]] | None = None,
        helper_thread: bool | None = None,
        engine: str = "auto",
        attn_input_norm_form: Callable[[int], object] | None = None,
        attn_out_weights: Callable[[int], tuple[torch.Tensor, torch.Tensor | None] | None] | None = None,
        mlp_out_from_resid: bool = False,
        lazy_derived: bool = False,
        kernel_dir: str | None = None,
        layer_kinds: tuple[str, ...] | None = None,
    ):
        self.L, self.H, self.d, self.dh = int(n_layers), int(n_heads), int(d_model), int(d_head)
        self.other_layers = [l for l, k in enumerate(layer_kinds or ()) if k != "attention"]  # a hybrid's (_on_layer)
        self.N = int(n_tracked)
        self.K = self.N + 2
        self.T = int(context_length)
        self.device = torch.device(device)
        self.cooc_window = int(cooc_window)
        # The reductions are gather / scatter dominated and gain nothing from intra-op threads on CPU; on a busy
        # machine OpenMP barriers make small parallel ops many times slower. So on CPU they run on `cpu_threads`
        # threads (the model's forward keeps its own setting); None leaves torch alone.
        self.cpu_threads = cpu_threads if self.device.type == "cpu" else None
        # "native": on CPU the reductions run as compiled loops (mfpipe.stats.native, numba), the same sums bit for
        # bit; "torch": as torch ops (any device); "auto": native where it can run
        self.engine = engine_name(engine, self.device, StatsError)
        # On CPU each layer's reduction is split between this thread and a helper thread (HelperThread) where the job
        # has a second thread to give (torch's threads, set from the job's `threads`); None: that rule, True /
        # False: force. On a GPU the reductions are asynchronous kernels already.
        if helper_thread is None:
            helper_thread = self.device.type == "cpu" and torch.get_num_threads() >= 2
        self._helper = HelperThread(self.cpu_threads) if helper_thread and self.device.type == "cpu" else None
        self.attn_input_norm = attn_input_norm  # (layer, resid [B,T,d]) -> ln1(resid), e.g. adapter.attn_input_norm
        # sums() hands the derived sums out as derived.LayerDerived (one layer computed when indexed): the statistics
        # job writes its partial layer by layer, so they never exist whole beside the accumulators
        self.lazy_derived = bool(lazy_derived)
        self._derive_from_weights(value_weights, attn_out_weights, mlp_out_from_resid)
        self._cols = self._position_columns()
        if kernel_dir is not None and self.device.type != "cpu":
            raise StatsError(f"the kernel sums map a file of {kernel_dir} into host memory (stats.kernel_sums: disk): "
                             f"a pass on {self.device} keeps them in device memory; set stats.kernel_sums: memory")
        self._allocate(attn_input_norm_form, kernel_dir)

    def _derive_from_weights(self, value_weights, attn_out_weights, mlp_out_from_resid: bool) -> None:
        """The statistics derived from others' sums rather than read (value, attn_out and mlp_out; the layouts
        checked now) and so the capture fields read (:attr:`select`)."""
        # layer -> (W [H,d,dh], b [H,dh] | None), e.g. adapter.value_weights: value sums from the ln1(x) sums; None
        # where the values are no affine map of ln1(x) (latent attention: a norm between), so they are summed as read
        if value_weights is not None and value_weights(0) is None:
            value_weights = None
        if value_weights is not None and self.attn_input_norm is None:
            raise ValueError("value_weights maps the attention-input norm's sums to value sums: pass attn_input_norm too")
        self.value_weights = value_weights
        if value_weights is not None:  # a wrong layout fails here, not after a shard's forward passes
            derived.check_layout(value_weights, "value_weights", (self.H, self.d, self.dh), (self.H, self.dh),
                                 "the adapter's value_weights does not match its layout (fused QKV weights need their "
                                 "own value_weights)")
        # layer -> (W [H,dh,d], b [d] | None) or None, e.g. adapter.attn_out_weights: where attn_out is that affine map
        # of the reads (no norm after the output projection), its sums are that map of the read sums
        self.attn_out_weights = None
        if attn_out_weights is not None and attn_out_weights(0) is not None:
            derived.check_layout(attn_out_weights, "attn_out_weights", (self.H, self.dh, self.d), (self.d,),
                                 "the adapter's out_proj_slices / out_proj_bias do not match its layout")
            self.attn_out_weights = attn_out_weights
        # e.g. adapter.mlp_out_from_resid: the mlp_out sums are the residual sums' step through the block less the
        # attn_out sums (resid_in[l+1] = resid_in + attn_out + mlp_out), so the capture does not read the MLP's output
        # and a layer's tensors are reduced (and released) before its MLP runs
        self.mlp_out_from_resid = bool(mlp_out_from_resid)
        # the capture fields this reducer reads (Adapter.run's select): resid_mid is resid_in + attn_out, the values
        # are derived from the ln1(x) sums where value_weights is given, attn_out from the read sums where
        # attn_out_weights is, mlp_out from the residual sums where mlp_out_from_resid
        self.select = (("resid_in", "attn_probs", "reads") + (("mlp_out",) if not self.mlp_out_from_resid else ())
                       + (("values",) if value_weights is None else ())
                       + (("attn_out",) if self.attn_out_weights is None else ()))

    def _position_columns(self) -> dict[str, int]:
        """The per-position statistics summed (the rest derived) -> their widths."""
        # per-position sums, float64, one tensor per statistic (sums() hands them out without copies); the residual
        # and its square have depth L + 1 (l = L: the final residual before the last norm)
        cols = {"resid": self.d, "attn_out": self.d, "mlp_out": self.d}
        if self.attn_out_weights is not None:
            del cols["attn_out"]
        if self.mlp_out_from_resid:
            del cols["mlp_out"]
        if self.attn_input_norm is not None:
            cols["ln_in"] = self.d
        if self.value_weights is None:
            cols["values"] = self.H * self.dh
        cols["reads"] = self.H * self.dh
        return cols

    def _allocate(self, attn_input_norm_form, kernel_dir: str | None = None) -> None:
        """The sums (zero; the kernel sums in a file mapped from ``kernel_dir`` where given), the batch state, the work
        buffers and the engine that adds into the sums."""
        # the sums, which the engine adds into: kernel sums cell-major and layer-minor ([N*K, L*H]: row s*K + t holds
        # the cell's L*H (layer, head) sums, see the module docstring), the counts (nbar, C, cooc side by side:
        # complete only in sums()), the per-position sums
        self._totals = Totals.zeros(self.L, self.H, self.N, self.T, self._cols, self.device, kernel_dir)
        self.P, self.pos = self._totals.P, self._totals.pos
        self.query_count, self.key_count = self._totals.query_count, self._totals.key_count
        self.position_count = self._totals.position_count
        self.n_windows = 0
        self.n_tokens = 0
        self._plan: BatchPlan | None = None  # the batch's plan (begin_batch to end_batch)
        self._layers_seen: set[int] = set()
        self._final_seen = False
        self._scratch = Scratch(self.device)
        self._scratch_helper = Scratch(self.device)  # the helper thread's own work buffers
        # the engine (mfpipe.stats.engine.Engine); the native one sums ln1(x) from the normalised rows in its own loop
        # where the norm has a form (layer -> NormForm, e.g. adapter.attn_input_norm_form) that reproduces
        # attn_input_norm on a probe: no module call and no [B*T, d] output per layer
        self._engine = make_engine(self.engine, self._totals, self.cooc_window, self.attn_input_norm,
                                   attn_input_norm_form)
        self._holding_heap = False  # CPU: the C heap holds every block while batches run (heap.hold_heap_blocks)

    def _threads(self):
        return reducer_threads(self.cpu_threads)

    # ------------------------------------------------------------------ per batch, model-free
    def begin_batch(self, kb: np.ndarray | torch.Tensor, qt: np.ndarray | torch.Tensor) -> None:
        """Register a batch's key buckets / query types ``[B,T]``, add its model-free counts and plan its
        reductions (shared by all layers). (An engine may add part of the counts later, at :meth:`end_batch` or
        when the sums are read: the counts read from :meth:`sums` are complete, at any time.)"""
        B, T = tuple(kb.shape)
        if T != self.T:
            raise StatsError(f"batch has context length {T}, the accumulator expects {self.T}")
        self._layers_seen = set()
        self._final_seen = False
        self.n_windows += B
        self.n_tokens += B * T
        group = max(1, PAIR_CHUNK // (T * (T + 1) // 2))  # windows per pair chunk
        if self.device.type == "cpu" and not self._holding_heap:  # the forward's blocks stay in the heap (to sums())
            self._holding_heap = hold_heap_blocks(True)
        with self._threads():
            self._plan = self._engine.plan(kb, qt, group, self._scratch, DEFERRED_SUMS_MAX, RANK_TABLE_MAX)

    # ------------------------------------------------------------------ adapter callbacks
    def on_layer(self, cap) -> None:
        """Reduce one layer's :class:`~mfpipe.models.adapters.LayerCapture` into the sums."""
        with self._threads():
            self._on_layer(cap)

    @staticmethod
    def _flat_probs(probs: torch.Tensor) -> torch.Tensor:
        pf = probs.reshape(-1) if probs.is_contiguous() else probs.contiguous().reshape(-1)
        return pf.to(torch.float32)

    def _on_layer(self, cap) -> None:
        l = int(cap.layer)
        if self._plan is None:
            raise StatsError("Accumulator.on_layer called before begin_batch")
        if l in self.other_layers:  # a hybrid's layer of another mixer: its input residual only (sums(): the rest NaN)
            self._layers_seen.add(l)
            return self._position_sums(l, {"resid": cap.resid_in}, self._scratch)
        H, T, eng, plan = self.H, self.T, self._engine, self._plan
        probs = cap.attn_probs
        B = probs.shape[0]
        if tuple(probs.shape) != (B, H, T, T):
            raise StatsError(f"layer {l}: attention probabilities have shape {tuple(probs.shape)}, expected {(B, H, T, T)}")
        parts = {"resid": cap.resid_in, "attn_out": cap.attn_out, "mlp_out": cap.mlp_out, "reads": cap.reads}
        parts = {name: t for name, t in parts.items() if name in self._cols}  # the rest is derived in sums()
        if "values" in self._cols:
            parts["values"] = cap.values.permute(0, 2, 1, 3)
        ln_from = cap.resid_in if "ln_in" in self._cols else None
        pf = self._flat_probs(probs)
        if self._helper is None or probs.numel() < HELPER_MIN_PROBS:
            # the kernel: per head, the pairs' probabilities summed by compact cell (float32) into the batch sums
            # [U, L*H], which end_batch adds into P once for all layers (above DEFERRED_SUMS_MAX: into P at once)
            eng.kernel_heads(plan, l, pf, range(H), self._scratch)
            eng.kernel_flush(plan, l)
            self._position_sums(l, parts, self._scratch, ln_from)
        else:
            # the helper takes the second half of the heads, the residual (with its square) and one branch output
            # where one is summed (attn_out, else mlp_out); this thread the first half and the rest, ln1(x) included
            # (a module call where the norm has no form: it stays on the trace's thread)
            half = (H + 1) // 2
            branch = next((name for name in ("attn_out", "mlp_out") if name in parts), None)
            there = {name: parts.pop(name) for name in ("resid", branch) if name is not None}
            self._helper.both(
                lambda: (eng.kernel_heads(plan, l, pf, range(half), self._scratch),
                         self._position_sums(l, parts, self._scratch, ln_from)),
                lambda: (eng.kernel_heads(plan, l, pf, range(half, H), self._scratch_helper),
                         self._position_sums(l, there, self._scratch_helper)),
            )
            eng.kernel_flush(plan, l)
        self._layers_seen.add(l)

    def _position_sums(self, l: int, parts: dict, scratch: Scratch, ln_from: torch.Tensor | None = None) -> None:
        """Per-position sums of layer ``l``: per statistic in ``parts`` (and ``ln1(ln_from)`` as ``ln_in``), a float32
        sum over the batch's distinct buckets, then added once into its float64 sum (Engine.position_sum); ``ln_in``
        where the engine sums the norm itself (Engine.norm_sum) without the module's output."""
        BT = self._plan.n_positions
        if ln_from is not None and not self._engine.norm_sum(self._plan, l, ln_from, scratch):
            parts = {**parts, "ln_in": self.attn_input_norm(l, ln_from)}
        for name, t in parts.items():
            c = self._cols[name]
            if t.is_contiguous() and t.dtype == torch.float32:
                x = t.view(BT, c)
            else:  # values are head-major [B,H,T,dh]: rows [B*T, H*dh] into a reused buffer
                x = scratch.get("posx", BT * c, torch.float32).view(t.shape).copy_(t).view(BT, c)
            self._engine.position_sum(self._plan, name, l, x, scratch)

    def on_final(self, resid: torch.Tensor) -> None:
        with self._threads():
            x = resid.reshape(self._plan.n_positions, self.d).to(torch.float32)
            self._engine.position_sum(self._plan, "resid", self.L, x, self._scratch)
        self._final_seen = True

    def end_batch(self) -> None:
        """Check that every layer and the final residual came, and add the batch's kernel sums into P."""
        if len(self._layers_seen) != self.L or not self._final_seen:
            raise StatsError(
                f"the capture delivered layers {sorted(self._layers_seen)} and final={self._final_seen}; "
                f"expected all {self.L} layers and the final residual"
            )
        if self._plan is not None:
            with self._threads():  # the batch's kernel sums into P, all layers at once: one run of L*H floats per cell
                self._engine.end_batch(self._plan)
        self._plan = None

    def close(self) -> None:
        """Stop the helper thread, if any (the sums stay readable)."""
        if self._helper is not None:
            self._helper.close()
            self._helper = None

    # ------------------------------------------------------------------ output
    def sums(self) -> dict[str, np.ndarray]:
        """Numpy sums (see the module docstring): ``P_sum`` float32, the other float sums float64, counts int64.
        On CPU most are views of the accumulators (no copies: treat them as read-only, take them after the last
        batch); with ``lazy_derived`` the derived ones are :class:`~mfpipe.stats.derived.LayerDerived`."""
        L, H, N, K, dh = self.L, self.H, self.N, self.K, self.dh
        self._engine.complete_counts()  # what the engine left for later (a batch begun and not ended included)
        # the batches' work buffers go before the sums' own arrays are made (the value and resid_mid sums: ~150 MB
        # for GPT-2 small at N = 1000), so they do not add up at the shard's end; a later batch grows them again
        self._scratch, self._scratch_helper = Scratch(self.device), Scratch(self.device)
        if self.device.type == "cpu":
            if self._holding_heap:  # the arrays built below are mapped again, and handed back when freed
                self._holding_heap = not hold_heap_blocks(False)
            release_free_memory()

        def np_(t):
            return t.detach().cpu().numpy()

        key_count, tot = np_(self.key_count), self._totals
        derived.no_attention(self.P, self.pos, self.other_layers, H)  # a hybrid's other layers: NaN, never 0
        # views of the CPU accumulators, no copies; with the sums derived from them
        position = derived.position_sums({name: np_(t) for name, t in self.pos.items()}, key_count, H, dh,
                                         self.attn_out_weights, self.value_weights, lazy=self.lazy_derived)
        return {
            "n_windows": np.asarray(self.n_windows, dtype=np.int64),
            "n_tokens": np.asarray(self.n_tokens, dtype=np.int64),
            "query_count": np_(self.query_count),
            "key_count": key_count,
            "position_count": np_(self.position_count),
            "context_count": np_(tot.ctx).reshape(N, K),
            "cooc": np_(tot.cooc).reshape(N, K),
            "P_sum": np_(self.P).reshape(N, K, L, H).transpose(2, 3, 0, 1),  # a view [L, H, N, K]
            "nbar_sum": np_(tot.nbar).reshape(N, K),
            **position,
        }


def make_engine(name: str, totals: Totals, cooc_window: int, attn_input_norm: Callable | None = None,
                attn_input_norm_form: Callable | None = None) -> Engine:
    """The engine ``name`` (:func:`engine_name`) adding into ``totals``. The native engine sums the attention-input
    norm itself where every layer has a form (``attn_input_norm_form(layer)``) that reproduces ``attn_input_norm``
    on a probe (:func:`mfpipe.stats.native.checked_norm_forms`)."""
    if name == "native":
        from mfpipe.stats import native

        forms = None
        if attn_input_norm is not None and attn_input_norm_form is not None:
            forms = native.checked_norm_forms(attn_input_norm_form, attn_input_norm, totals.L,
                                              totals.pos["resid"].shape[-1])
        return native.NativeEngine(totals, cooc_window, forms)
    from mfpipe.stats.torch_engine import TorchEngine

    return TorchEngine(totals, cooc_window)
