"""Pass 2, the deviation reducer (paper Sec. 6, App. P): a second corpus pass over the statistics half that reads
pass 1's kernel ``W`` and value means ``μ`` (never recomputing them) and accumulates, per layer, head and query
type, the mean-field deviation of every context and its covariance / contextualization split
(:mod:`mfpipe.meanfield.deviation`).

It is a reducer of the shard loop (:func:`mfpipe.stats.loop.run_reducer`): one traced forward per batch
with only the attention probabilities, values and reads selected; per layer the three reads z, ẑ, mixed at the
query positions (:func:`mfpipe.deviation.queries.query_terms`: the context-conditional kernel Â per key type, float32; its
model-free plan built once per batch), the meters (float64) and scatter-adds over query types.
On CPU the mixed weights of each layer come from a compiled loop (numba; ``engine``, as pass 1's: "auto" takes it
where it runs, "torch" the torch ops a GPU runs; the two agree bit for bit at every valid row), and with that loop,
where the layer's reductions get two or more threads and the model has two or more heads, the layer's heads are split
in two halves, each on its own thread (this one and a :class:`~mfpipe.stats.workspace.HelperThread`) with half the
torch threads: a head's terms, meters and sums need no other head's, and every sum cell gets its terms in the same
order as on one thread, so the sums equal a one-thread run's bit for bit (tests; measured on two cores). No final
residual is read, so the forward stops after the last layer's attention (:meth:`Adapter.run`).
Every window belongs to one of two document-interleaved halves (the parity of its first token's document: the
split-half stability of App. P), so the additive sums carry a leading ``split`` axis of 2.

Sums (``L`` layers, ``H`` heads, ``N`` tracked types, ``dh`` head width; float64 unless said)::

    n_windows, n_tokens      int64 []           windows / tokens seen
    count                    int64 [2,L,N]      valid contexts (a tracked query with a valid Â row) per split
    D_sum, M_cov_sum,
    M_ctx_sum                [2,L,H,N]          Σ D, Σ σ_cov D, Σ σ_ctx D (eq:deviation, eq:mcov-mctx)
    z_sum, zhat_sum          [2,L,H,N,dh]       Σ z and Σ ẑ (head space) -> z̄_s, E_s[ẑ] of eq:ddec
    vbar_tracked_sum         [L,H,N,dh]         Σ N_X Σ_{t<N} Â_stX v̄_tX = Σ Σ_{t∈X, t<N} W_st n_t(X) v̄_tX over the
                                                tracked key types: its mean is Σ_{t<N} P_st E_s[v̄_t] (E_s the
                                                n_t-weighted mean over type-s contexts; on W's C >= min_count
                                                support, as P_st = W_st E_s[n_t] there), estimator (b) of Sec. 4.3
    degenerate               int64 [L,H]        contexts whose error is collinear with ẑ (shares split evenly)
    top_D                    [L,H,K]            the K largest D per head (lens: top-deviation contexts), ties in
                                                corpus order, -inf pad
    top_window, top_position int64 [L,H,K]      where they are (window of the shard, query position)

Top-deviation contexts skip occurrences where the head puts more than ``other_share_max`` of its attention on
untracked (``<other>``) keys: App. P's filter (their deviation is an artifact of the pooled value).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from mfpipe.stats.engine import engine_name
from mfpipe.deviation.queries import QueryTerms, key_part, query_terms
from mfpipe.meanfield.plan import query_plan
from mfpipe.meanfield.deviation import gate_head_major, meters_head_major, stack_head_major
from mfpipe.stats.workspace import HelperThread, reducer_threads

__all__ = ["DeviationAccumulator", "window_halves", "TOP_K", "OTHER_SHARE_MAX", "ADDITIVE", "THREADED_MIN_PROBS"]

TOP_K = 32
OTHER_SHARE_MAX = 0.10
# attention elements [B*H*T*T] of a layer from which its reductions use the job's torch threads on CPU (below, one:
# small parallel ops gain nothing and stall on a busy machine). GPT-2 small at B=4, T=512: 12.6 M, where the second
# thread took pass 2 from 1.42-1.47x a bare forward to 1.26x (benchmarks/deviation_pass.py, 2-core machine)
THREADED_MIN_PROBS = 1 << 22
ADDITIVE = ("n_windows", "n_tokens", "count", "D_sum", "M_cov_sum", "M_ctx_sum", "z_sum", "zhat_sum",
            "vbar_tracked_sum", "degenerate")


def window_halves(doc_ids: np.ndarray) -> np.ndarray:
    """Split of each window ``[n]`` (0/1): the parity of the document of its first token (position 1), so both
    halves interleave whole documents."""
    doc_ids = np.asarray(doc_ids)
    return (doc_ids[:, 1] % 2).astype(np.int64) if doc_ids.shape[1] > 1 else np.zeros(len(doc_ids), np.int64)


class DeviationAccumulator:
    """Pass-2 reducer. ``W [L,H,N,K]`` (the substitution kernel, :func:`~mfpipe.meanfield.kernel.kernel_from_store`)
    and ``mu [L,H,K,dh]`` as tensors, ``grams [L,H,dh,dh]`` (:func:`~mfpipe.meanfield.deviation.residual_gram` of each layer's
    output projection slices), ``halves [n_windows]`` of the shard (:func:`window_halves`; windows arrive in order).
    ``gate``: where the attention gates its reads, ``(layer, residual rows [n, d]) -> their gates [n, H, dh]``
    (``adapter.read_gate``): the meters are then the gated reads' (:func:`~mfpipe.meanfield.deviation.gate_head_major`);
    the sums of z and ẑ stay the reads' (their means are the statistics' zbar and the mean field)."""

    select = ("attn_probs", "values", "reads")

    def __init__(self, W, mu, grams, n: int, context_length: int, halves, device, top_k: int = TOP_K,
                 other_share_max: float = OTHER_SHARE_MAX, cpu_threads: int | str | None = "auto",
                 engine: str = "auto", gate=None):
        self.device = torch.device(device)
        self.gate = gate
        if gate is not None:  # each query's gate is of the residual entering the block
            self.select = (*type(self).select, "resid_in")
        # like pass 1: the reductions run on `cpu_threads` torch threads on CPU (reducer_threads says why); "auto":
        # one for a layer below THREADED_MIN_PROBS attention elements, the job's own setting from there on
        self.cpu_threads = cpu_threads if self.device.type == "cpu" else None
        # the mixed weights: the compiled loop on CPU (query_terms' engine), on a helper thread beside this one for
        # half the heads where the layer's reductions take two or more threads
        self.engine = engine_name(engine, self.device)
        self._helper = None
        self.W = W  # stays where it is (host for big kernels); one layer moved per batch
        self.mu = mu.to(self.device, torch.float32)
        self.grams = grams.to(self.device, torch.float64)
        L, H, K, dh = mu.shape
        self.L, self.H, self.N, self.K, self.dh = L, H, int(n), K, dh
        if K != self.N + 2 or tuple(W.shape) != (L, H, self.N, K):
            raise ValueError(f"kernel W {tuple(W.shape)} / mu {tuple(mu.shape)} do not fit N={n} tracked types")
        self.halves = torch.as_tensor(np.asarray(halves), dtype=torch.long)
        self.top_k, self.other_share_max = int(top_k), float(other_share_max)
        dev, f64 = self.device, torch.float64
        self.count = torch.zeros(2, L, self.N, dtype=torch.long, device=dev)
        # D, M_cov, M_ctx and z, ẑ per layer over a flat (half, type, head) axis: one index_add_ each per layer
        self.scal = torch.zeros(3, L, 2 * self.N * H, dtype=f64, device=dev)
        self.vec = torch.zeros(2, L, 2 * self.N * H, dh, dtype=f64, device=dev)
        self.vbar_tracked = torch.zeros(L, self.N * H, dh, dtype=f64, device=dev)
        self.degenerate = torch.zeros(L, H, dtype=torch.long, device=dev)
        self.top_D = torch.full((L, H, self.top_k), -torch.inf, dtype=f64, device=dev)
        self.top_idx = torch.full((L, H, self.top_k), -1, dtype=torch.long, device=dev)  # window * T + position
        self.T = int(context_length)
        self.other_layers: set[int] = set()
        self.n_windows = 0
        self.n_tokens = 0

    # ------------------------------------------------------------------ reducer protocol
    def begin_batch(self, kb: np.ndarray, qt: np.ndarray) -> None:
        with reducer_threads(1 if self.cpu_threads == "auto" else self.cpu_threads):  # the plan: small ops
            self._begin_batch(kb, qt)

    def on_layer(self, cap) -> None:
        if cap.attn_probs is None:  # a hybrid's layer of another mixer: no attention (its sums NaN in sums())
            self.other_layers.add(cap.layer)
            return
        n = self.cpu_threads
        if n == "auto":
            n = None if cap.attn_probs.numel() >= THREADED_MIN_PROBS else 1
        l = cap.layer
        threads = n if n is not None else torch.get_num_threads()
        if self.engine == "native" and self.H > 1 and threads >= 2:
            # two threads, half the heads each (and half the job's torch threads: one each on two cores): a head's
            # terms, meters and sums need no other head's (only a row's validity is over all heads), and on two cores
            # two single-threaded halves beat every op on two OpenMP threads (no barrier per op, no OpenMP worker left
            # spinning on the core the compiled loop wants; benchmarks/HISTORY.md)
            if self._helper is None:
                self._helper = HelperThread(threads // 2)
            heads = (slice(0, self.H // 2), slice(self.H // 2, self.H))
            terms = [None, None]

            def run_terms(i: int) -> None:
                terms[i] = self._terms(cap, heads[i])

            with reducer_threads(threads - threads // 2):
                self._helper.both(lambda: run_terms(0), lambda: run_terms(1))
                valid = terms[0].valid & terms[1].valid
                if bool(valid.any()):
                    g = self._gates(cap)
                    self._helper.both(lambda: self._add_heads(l, terms[0], valid, heads[0], g),
                                      lambda: self._add_heads(l, terms[1], valid, heads[1], g))
                    self._add_counts(l, valid)
        else:
            with reducer_threads(n):
                t = self._terms(cap, slice(0, self.H))
                if bool(t.valid.any()):
                    self._add_heads(l, t, t.valid, slice(0, self.H), self._gates(cap))
                    self._add_counts(l, t.valid)

    def close(self) -> None:
        """Stop the helper thread (the shard loop calls this when the shard ends)."""
        if self._helper is not None:
            self._helper.close()
            self._helper = None

    def _begin_batch(self, kb: np.ndarray, qt: np.ndarray) -> None:
        B, T = np.shape(kb)
        # the model-free part of every layer's terms: query rows, key types, prefix counts, gather indices, and the
        # key set of mixed_tracked (made here, once, before any layer's halves run on two threads)
        self.plan = query_plan(kb, qt, self.K, self.device)
        for sp in self.plan.spans:
            key_part(sp, self.N)
        self.half = self.halves[self.n_windows : self.n_windows + B].to(self.device)
        if self.half.shape[0] != B:
            raise ValueError(f"the shard has {len(self.halves)} windows; batch {B} at window {self.n_windows} overruns it")
        self.B = B
        self.first_window = self.n_windows
        self.n_windows += B
        self.n_tokens += B * T

    def _terms(self, cap, heads: slice) -> QueryTerms:
        """The terms of heads ``heads`` of layer ``cap.layer`` at the batch's query rows (``[n, h, dh]``)."""
        l = cap.layer
        return query_terms(self.plan, cap.attn_probs[:, heads].float(), cap.values[:, heads].float(),
                           self.W[l][heads].to(self.device, torch.float32), self.mu[l][heads],
                           reads=cap.reads[:, :, heads], n_tracked=self.N, engine=self.engine)

    def _gates(self, cap) -> Tensor | None:
        """The output gates ``[n, H, dh]`` of the batch's query rows at layer ``cap.layer`` (None: no gate)."""
        rows = (self.plan.b, self.plan.j)  # (a norm of every head's reads: the factor of each row's own reads)
        return None if self.gate is None else self.gate(cap.layer, cap.resid_in[rows], cap.reads[rows])

    def _add_counts(self, l: int, valid: Tensor) -> None:
        plan = self.plan
        s = plan.s[valid]
        self.count[:, l].index_put_((self.half[plan.b[valid]], s), torch.ones_like(s), accumulate=True)

    def _add_heads(self, l: int, t: QueryTerms, valid: Tensor, heads: slice, gate: Tensor | None = None) -> None:
        """Add the terms ``t`` of heads ``heads`` at the rows ``valid`` (valid in every head) into the sums: the
        cells of these heads only (two threads add their heads' side by side; each cell's terms arrive in
        context order either way)."""
        B, T, N, dh = self.B, self.T, self.N, self.dh
        H = self.H
        plan = self.plan
        if not bool(valid.all()):  # rows whose W row is empty in this layer: dropped before the float64 work
            t = QueryTerms(t.z[valid], t.zhat[valid], t.mixed[valid], t.mixed_tracked[valid], nx=t.nx[valid],
                           valid=valid[valid], other=t.other[valid])
        g = None if gate is None else gate[valid][:, heads]  # the rows' gates, these heads'
        m = meters_head_major(gate_head_major(stack_head_major(t), g), self.grams[l][heads])  # [h, n] each
        h = m["D"].shape[0]
        # scatter-add over (half, query type) of the valid contexts; head-major rows (head, context)
        half = self.half[plan.b[valid]]
        s = plan.s[valid]
        cols = torch.arange(heads.start, heads.start + h, device=self.device)[:, None]
        flat = ((half * N + s)[None, :] * H + cols).reshape(-1)  # (half, type, head) -> index into [2 * N * H]
        self.scal[:, l].index_add_(1, flat, torch.stack([m["D"], m["M_cov"], m["M_ctx"]]).reshape(3, -1))
        # z, ẑ from the context-major terms [n, h, dh]: rows of dh (the fast index_add), (context, head) order
        zz = torch.stack([t.z, t.zhat]).to(torch.float64).reshape(2, -1, dh)
        self.vec[:, l].index_add_(1, flat.view(h, -1).T.reshape(-1), zz)
        # N_X Σ_{t<N} Â_t v̄_t = Σ_{t∈X, t<N} W_st n_t v̄_t, head-major rows
        yb = (t.mixed_tracked.transpose(0, 1).double() * t.nx.T.double()[..., None]).reshape(-1, dh)
        self.vbar_tracked[l].index_add_(0, (s[None, :] * H + cols).reshape(-1), yb)
        self.degenerate[l, heads] += m["degenerate"].sum(1)
        # top-deviation contexts (App. P filter: at most other_share_max of the attention on untracked keys)
        D = torch.where(t.other.T <= self.other_share_max, m["D"], torch.full_like(m["D"], -torch.inf))
        cand = torch.full((h, B * T), -torch.inf, dtype=D.dtype, device=self.device)
        cand[:, plan.b[valid] * T + plan.j[valid]] = D
        # ties go to the earlier context (a context the corpus repeats gives the same D bit for bit): a stable sort,
        # not topk, whose order among equal values differs between the CPU and a GPU (the lenses print these)
        v, i = _top(cand, min(self.top_k, B * T))
        idx = i + self.first_window * T  # window * T + position, windows counted from the shard's first
        # the kept contexts come first (earlier windows), so a stable sort keeps ties in corpus order
        allv = torch.cat([self.top_D[l, heads], v], 1)
        alli = torch.cat([self.top_idx[l, heads], torch.where(torch.isfinite(v), idx, torch.full_like(idx, -1))], 1)
        best, pos = _top(allv, self.top_k)
        self.top_D[l, heads] = best
        self.top_idx[l, heads] = alli.gather(1, pos)

    # no final residual: the forward stops after the last layer's attention (the last block's MLP and the final norm
    # would reach nothing pass 2 reads; Adapter.run)
    on_final = None

    def end_batch(self) -> None:
        pass

    def sums(self) -> dict[str, np.ndarray]:
        L, H, N, dh = self.L, self.H, self.N, self.dh
        # [.., L, (half, type, head), (dh)] -> [.., half, L, head, type, (dh)]
        scal = self.scal.reshape(3, L, 2, N, H).permute(0, 2, 1, 4, 3).cpu().numpy()
        vec = self.vec.reshape(2, L, 2, N, H, dh).permute(0, 2, 1, 4, 3, 5).cpu().numpy()
        vk = self.vbar_tracked.reshape(L, N, H, dh).permute(0, 2, 1, 3).cpu().numpy()
        T = self.T
        idx = self.top_idx.cpu().numpy()
        for l in self.other_layers:  # a hybrid's layers of another mixer: NaN, never 0 (merged by addition)
            scal[:, :, l], vec[:, :, l], vk[l] = np.nan, np.nan, np.nan
        return {
            "n_windows": np.asarray(self.n_windows, dtype=np.int64),
            "n_tokens": np.asarray(self.n_tokens, dtype=np.int64),
            "count": self.count.cpu().numpy(),
            "D_sum": scal[0], "M_cov_sum": scal[1], "M_ctx_sum": scal[2],
            "z_sum": vec[0], "zhat_sum": vec[1], "vbar_tracked_sum": vk,
            "degenerate": self.degenerate.cpu().numpy(),
            "top_D": self.top_D.cpu().numpy(),
            "top_window": np.where(idx >= 0, idx // T, -1), "top_position": np.where(idx >= 0, idx % T, -1),
        }


def _top(x: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The ``k`` largest values of each row of ``x`` and their columns, ties in column order (``topk`` leaves their
    order to the device's kernel)."""
    v, i = torch.sort(x, dim=1, descending=True, stable=True)
    return v[:, :k], i[:, :k]
