"""Pass 1's CPU reductions as compiled loops (numba): the same sums as the torch ops of
:class:`mfpipe.stats.pass1.Accumulator`, bit for bit, in a fraction of the time on small models.

Why. On CPU the torch form of the reducer is a few dozen gather / scatter / index_add calls per layer and batch;
on the 128-wide mini models each call moves too little data to amortize its dispatch and its pass over memory,
and the reducer cost as much as the forward itself (issue 13; measurements: benchmarks/HISTORY.md).
Here each reduction is one loop over the data it reads, in the order torch adds it:

- ``plan_batch``: the batch's model-free counts (query / key / position counts, ``nbar``, ``C``, ``cooc``), its
  distinct key buckets and each position's rank among them, and per group of windows (the torch plan's pair
  chunks) each (query, key <= query) pair's compact cell: the cells numbered in order of first appearance
  through a table of slots that is reset after the batch (no sort, no [N*K] pass): the batch's [n_ub, n_ub]
  table of (query bucket rank, key bucket rank), cache-resident, or where that is too large the [N*K] one;
- ``kernel_heads``: the pairs' probabilities read row by row from the layer's [B,H,T,T] tensor (no index of the
  pairs into it is stored or gathered), a pair's heads side by side in blocks of a compile-time width (8, 4, 2, 1:
  the block's adds into a cell's row vectorize), summed per compact cell;
- ``add_batch_sums``: at the end of a batch, its cells' counts and kernel sums into their rows, in one pass;
- ``symmetrize_cooc``: once, when the sums are read, the forward half of cooc's tracked columns, which the plan
  leaves out (the transpose of the backward half, see ``plan_batch``);
- ``bucket_sums`` / ``add_bucket_sums`` / ``add_square_sums``: the per-position statistics by bucket;
- ``bucket_norm_sums`` / ``add_affine_bucket_sums``: the attention-input norm's sums without its module, where the
  adapter gives the norm's form (:func:`checked_norm_forms`): the normalised rows by bucket, then the affine.

Each float sum adds the same terms in the same order and precision as the torch op it replaces (float32 scatter /
index_add in pair / row order from zero, the float64 shift of the squares), so the sums are identical; the
ranks of the compact cells and buckets differ, which no sum depends on (tests/test_stats_native.py compares the
two engines' sums exactly). The exception is the norm path: its row moments are not the module's float32 ops, so
``ln_in`` (and the value sums made from it) agree with the torch engine's to float32 rounding. All functions release
the GIL (pass 1's helper thread runs them side by side).

The loops live in :mod:`mfpipe.stats._native_loops`, imported on first use (:func:`loops`): numba and its machine
code take much resident memory and time to import, which a process that never runs pass 1 on CPU should not pay.
numba compiles them on first use in a process (``cache=True`` keeps the machine code beside that file, or in
numba's user cache where that is read-only). Without numba the torch form runs (:func:`available`).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np

from mfpipe.stats.engine import BatchPlan, Totals

if TYPE_CHECKING:
    import torch

    from mfpipe.stats.workspace import Scratch

_loops: ModuleType | None = None


def available() -> bool:
    """Whether numba is installed (without importing it)."""
    from mfpipe.stats.engine import numba_available

    return numba_available()


def loops() -> ModuleType:
    """The compiled loops (:mod:`mfpipe.stats._native_loops`), imported on first use."""
    global _loops
    if _loops is None:
        from mfpipe.stats import _native_loops

        _loops = _native_loops
    return _loops


@dataclass
class PairGroups:
    """The native plan of a batch's kernel (:attr:`BatchPlan.pairs`): per group of ``group`` windows ``c``, its
    pairs' compact cells ``pinv[m_off[c]:m_off[c+1]]`` and its distinct cells ``cells[u_off[c]:u_off[c+1]]`` (see
    ``plan_batch``), with their counts ``cell_counts`` [U, 3] (the batch's parts of nbar, C and cooc's backward
    half) and the batch's kernel sums ``sums`` [U, L*H] (no rows: each layer adds into P at once)."""

    qt: np.ndarray  # [B, T] int64 query types
    group: int
    pinv: np.ndarray
    cells: np.ndarray
    m_off: np.ndarray
    u_off: np.ndarray
    sums: np.ndarray
    cell_counts: np.ndarray
    max_u: int  # the most cells of one group


class NativeEngine:
    """The native engine (:class:`~mfpipe.stats.engine.Engine`): the compiled loops adding into numpy views of the
    :class:`~mfpipe.stats.engine.Totals` (CPU tensors) it was made with, and the plan's look-up tables (-1 between
    batches). ``norm_forms``: per layer the attention-input norm's checked form (:func:`checked_norm_forms`), with
    which it sums that norm without its module, or None."""

    name = "native"

    def __init__(self, totals: Totals, cooc_window: int, norm_forms: list[tuple] | None = None):
        self.loops = loops()
        self.H, self.T, self.K, self.LH = totals.H, totals.T, totals.K, totals.L * totals.H
        self.cooc_window = int(cooc_window)
        self.norm_forms = norm_forms
        self.cell_lut = np.full(totals.N * totals.K, -1, dtype=np.int32)
        self.rank_table = np.full(0, -1, dtype=np.int32)  # sized by the first plan (-1 between batches, as cell_lut)
        self.bucket_lut = np.full(totals.K, -1, dtype=np.int32)
        self._pending: BatchPlan | None = None  # a planned batch whose cell counts are not added yet (end_batch)
        # 1 while the forward half of cooc's tracked columns is left to symmetrize_cooc (see plan_batch), 0 after
        self.cooc_deferred = np.ones(1, dtype=np.int64)
        self.other_after = np.zeros(totals.N, dtype=np.int64)  # meanwhile, <other> keys 1..w after a type-s query
        # views of the CPU sums: the loops add into them in place
        self.arrays = {"P": totals.P.numpy(), "counts": totals.counts.numpy(),
                       **{name: t.numpy() for name, t in totals.pos.items()},
                       **{name: getattr(totals, name).numpy() for name in ("query_count", "key_count", "position_count")}}

    def _rank_table(self, n: int) -> np.ndarray:
        if self.rank_table.shape[0] != n:
            self.rank_table = np.full(n, -1, dtype=np.int32)
        return self.rank_table

    def plan(self, kb, qt, group: int, scratch: Scratch, deferred_max: int, rank_table_max: int) -> BatchPlan:
        """Plan a batch (``plan_batch``) and add its model-free counts (the cell counts at :meth:`end_batch`, the
        forward half of cooc's tracked columns at :meth:`complete_counts`); the plan's arrays live in ``scratch``.
        ``group`` windows per pair chunk; the batch sums ``[U, L*H]`` are kept for one add at the end of the batch
        where they take at most ``deferred_max`` bytes (else each layer adds into P at once); the bucket-pair table
        where it has at most ``rank_table_max`` entries (else the [N*K] one)."""
        import torch  # the read side of mfpipe.stats loads no torch; this runs only inside a pass

        self._flush_counts()  # a batch planned but not ended: its counts, before this plan reuses their buffers
        i32 = np.int32
        kb = np.ascontiguousarray(torch.as_tensor(kb).cpu().numpy(), dtype=np.int64)
        qt = np.ascontiguousarray(torch.as_tensor(qt).cpu().numpy(), dtype=np.int64)
        B, T = kb.shape
        K, LH = self.K, self.LH
        n_chunks, n_pairs = -(-B // group), B * T * (T + 1) // 2

        def buf(name, n, dtype=np.int64):
            return scratch.array(name, n, dtype)

        kinv, ub, ub_count = buf("kinv", B * T, i32), buf("ub", min(B * T, K)), buf("ub_count", min(B * T, K))
        pinv, cells = buf("pinv", n_pairs, i32), buf("cells", n_pairs)
        cell_counts = buf("cell_counts", 3 * n_pairs, i32).reshape(n_pairs, 3)
        m_off, u_off = buf("m_off", n_chunks + 1), buf("u_off", n_chunks + 1)
        a = self.arrays
        n_ub = self.loops.plan_batch(
            kb, qt, K, group, self.cooc_window, self.cell_lut, self._rank_table(rank_table_max),
            self.bucket_lut, buf("stamp", K), buf("first", T),
            a["query_count"], a["key_count"], a["position_count"], a["counts"],
            kinv, ub, ub_count, pinv, cells, buf("slots", n_pairs), cell_counts, m_off, u_off, self.cooc_deferred,
            self.other_after)
        n_cells = int(u_off[n_chunks])
        deferred = 4 * LH * n_cells <= deferred_max
        sums = buf("sums0", n_cells * LH if deferred else 0, np.float32).reshape(-1, LH)
        pairs = PairGroups(qt=qt, group=group, pinv=pinv, cells=cells[:n_cells], m_off=m_off, u_off=u_off, sums=sums,
                           cell_counts=cell_counts[:n_cells], max_u=int(np.max(np.diff(u_off))) if n_chunks else 0)
        plan = BatchPlan(kinv=kinv, ub=ub[:n_ub], count32=ub_count[:n_ub].astype(np.float32),
                         count64=ub_count[:n_ub].astype(np.float64), pairs=pairs)
        self._pending = plan
        return plan

    def kernel_heads(self, plan: BatchPlan, layer: int, probs: torch.Tensor, heads: range, scratch: Scratch) -> None:
        """Heads ``heads`` of layer ``layer``'s flat float32 probabilities (``[B,H,T,T]``, contiguous) into their
        columns of the batch sums (or of P)."""
        if not len(heads):  # the helper's half of a one-head layer
            return
        H, T, pg = self.H, self.T, plan.pairs
        width = min(len(heads), self.loops.HEAD_BLOCKS[0])
        kbuf = scratch.array("kbuf", pg.max_u * width, np.float32).reshape(-1, width)
        self.loops.kernel_heads(probs.numpy().reshape(-1, H, T, T), pg.qt, heads.start, heads.stop, pg.group,
                                pg.pinv, pg.cells, pg.m_off, pg.u_off, kbuf, pg.sums, layer * H, self.arrays["P"])

    def kernel_flush(self, plan: BatchPlan, layer: int) -> None:
        """Nothing: :meth:`kernel_heads` wrote the layer's sums where they go."""

    def position_sum(self, plan: BatchPlan, name: str, layer: int, x: torch.Tensor, scratch: Scratch) -> None:
        """Rows ``x`` [B*T, c] (float32) summed by bucket into statistic ``name``'s [K, c] float64 sums at ``layer``,
        the residual's squares too: the additions of the torch form (``TorchEngine.position_sum``)."""
        acc, acc_sq = self.arrays[name][layer], self.arrays["resid_sq"][layer] if name == "resid" else None
        x = x.contiguous().numpy()
        n_u, c = plan.ub.shape[0], x.shape[1]
        part = scratch.array("posu", n_u * c, np.float32).reshape(n_u, c)
        self.loops.bucket_sums(x, plan.kinv, n_u, part)
        if acc_sq is not None:
            m2 = scratch.array("m2", n_u * c, np.float32).reshape(n_u, c)
            self.loops.add_square_sums(acc_sq, x, plan.kinv, plan.ub, part, plan.count32, plan.count64, n_u, m2)
        self.loops.add_bucket_sums(acc, plan.ub, part, n_u)

    def norm_sum(self, plan: BatchPlan, layer: int, resid: torch.Tensor, scratch: Scratch) -> bool:
        """Where the norm has a form: the attention-input norm of ``resid`` [B,T,d] summed by bucket into ``ln_in``
        without the norm module: the sums of the normalised rows, then the norm's affine (:func:`checked_norm_forms`)."""
        if self.norm_forms is None:
            return False
        import torch

        kind, eps, scale, shift = self.norm_forms[layer]
        x = resid.reshape(plan.n_positions, resid.shape[-1])
        x = (x if x.is_contiguous() and x.dtype == torch.float32 else x.to(torch.float32).contiguous()).numpy()
        n_u, c = plan.ub.shape[0], x.shape[1]
        part = scratch.array("posu", n_u * c, np.float32).reshape(n_u, c)
        self.loops.bucket_norm_sums(x, plan.kinv, n_u, part, kind, eps)
        self.loops.add_affine_bucket_sums(self.arrays["ln_in"][layer], plan.ub, part, n_u, scale, shift, plan.count64)
        return True

    def end_batch(self, plan: BatchPlan) -> None:
        """The batch's cell counts (nbar, C, cooc's backward half) and its kernel sums (where kept, see :meth:`plan`)
        into their cells, in one pass over them (``add_batch_sums``); the counts only if no :meth:`complete_counts`
        added them already (the sums read before the batch ended)."""
        pg = plan.pairs
        counts = pg.cell_counts if self._pending is plan else pg.cell_counts[:0]
        self.loops.add_batch_sums(self.arrays["P"], self.arrays["counts"], pg.cells, pg.sums, counts)
        self._pending = None

    def _flush_counts(self) -> None:
        """The cell counts (nbar, C, cooc's backward half) of a batch that was planned but not ended (no kernel sums:
        its layers did not all come, or only its model-free counts are wanted)."""
        plan, self._pending = self._pending, None
        if plan is not None:
            pg = plan.pairs
            self.loops.add_batch_sums(self.arrays["P"], self.arrays["counts"], pg.cells, pg.sums[:0], pg.cell_counts)

    def complete_counts(self) -> None:
        """The counts of a batch planned and not ended (as the next plan adds them), and the deferred forward half of
        cooc (``symmetrize_cooc``; the batches after it count theirs directly)."""
        self._flush_counts()
        if self.cooc_deferred[0] == 1:
            self.loops.symmetrize_cooc(self.arrays["counts"], self.K - 2, self.K, self.other_after)
            self.cooc_deferred[0] = 0


NORM_KINDS = {"layer": 0, "rms": 1, "identity": 2}
# the probe's tolerance: a form that is the module's norm agrees to float32 rounding (~1e-6 of the output's scale)
NORM_PROBE_RTOL = 1e-4


def checked_norm_forms(norm_form, attn_input_norm, n_layers: int, d: int, seed: int = 0) -> list[tuple] | None:
    """Per layer ``(kind code, eps, scale [d], shift [d])`` (float64 numpy) of ``norm_form(layer)`` (e.g.
    ``Adapter.attn_input_norm_form``) where every layer has a form that reproduces ``attn_input_norm(layer, x)`` on
    a probe (random rows of scales from 1e-3 to 30, half of them far from zero mean); None where any layer has no form or its
    form does not match (a norm this code does not know: the pass then calls the module)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    # rows from 1e-3 to 30 in scale (at the small ones a norm's eps shows), the larger half off zero mean
    x = torch.randn(16, d, generator=g) * torch.logspace(-3.0, 1.5, 16)[:, None]
    x[8:] += torch.randn(8, 1, generator=g) * 5
    x64 = x.double()
    forms = []
    for layer in range(n_layers):
        form = norm_form(layer)
        if form is None or form.kind not in NORM_KINDS:
            return None
        scale = np.ones(d) if form.scale is None else form.scale.detach().to("cpu", torch.float64).numpy().reshape(-1)
        shift = np.zeros(d) if form.shift is None else form.shift.detach().to("cpu", torch.float64).numpy().reshape(-1)
        if scale.shape != (d,) or shift.shape != (d,):
            return None
        if form.kind == "identity":
            z = x64
        else:
            c = x64 - x64.mean(-1, keepdim=True) if form.kind == "layer" else x64
            z = c / torch.sqrt(c.square().mean(-1, keepdim=True) + form.eps)
        want = attn_input_norm(layer, x).double().cpu().numpy()
        got = z.numpy() * scale + shift
        if want.shape != got.shape or not np.allclose(got, want, rtol=NORM_PROBE_RTOL,
                                                      atol=NORM_PROBE_RTOL * float(np.abs(want).max())):
            return None
        forms.append((NORM_KINDS[form.kind], float(form.eps), np.ascontiguousarray(scale), np.ascontiguousarray(shift)))
    return forms
