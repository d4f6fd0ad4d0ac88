"""Pass 1's CPU reductions as compiled loops (numba): the same sums as the torch ops of
:class:`mfpipe.stats.pass1.Accumulator`, bit for bit, in a fraction of the time on small models.

Why. On CPU the torch form of the reducer is a few dozen gather / scatter / index_add calls per layer and batch;
on the 128-wide mini models each call moves too little data to amortize its dispatch and its pass over memory,
and the reducer cost as much as the forward itself (issue 13: 2.1-2.2x a bare forward on the mini models). Here
each reduction is one loop over the data it reads, in the order torch adds it:

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
code cost ~130 MiB of resident memory and about a second to import. numba compiles them on first use in a
process (a few seconds; ``cache=True`` keeps the machine code beside that file, or in numba's user cache where
that is read-only). Without numba the torch form runs (:func:`available`).
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

import numpy as np

_loops: ModuleType | None = None


def available() -> bool:
    """Whether numba is installed (without importing it)."""
    return importlib.util.find_spec("numba") is not None


def loops() -> ModuleType:
    """The compiled loops (:mod:`mfpipe.stats._native_loops`), imported on first use."""
    global _loops
    if _loops is None:
        _loops = importlib.import_module("mfpipe.stats._native_loops")
    return _loops


class NativeEngine:
    """The native engine of one :class:`~mfpipe.stats.pass1.Accumulator`: the compiled loops, numpy views of its
    sums, and the plan's look-up tables (-1 between batches). The accumulator calls it where its torch form would
    run torch ops (``begin_batch``, per layer, ``on_final``, ``end_batch``)."""

    def __init__(self, acc):
        import torch  # the read side of mfpipe.stats loads no torch; this runs only inside a pass

        self._torch = torch
        self.loops = loops()
        self.K, self.LH, self.cooc_window = acc.K, acc.L * acc.H, acc.cooc_window
        self.cell_lut = np.full(acc.N * acc.K, -1, dtype=np.int32)
        self.rank_table = np.full(0, -1, dtype=np.int32)  # sized by the first plan (-1 between batches, as cell_lut)
        self.bucket_lut = np.full(acc.K, -1, dtype=np.int32)
        self._pending = None  # a planned batch whose cell counts (nbar, C, cooc's backward half) are not added yet
        # 1 while the forward half of cooc's tracked columns is left to symmetrize_cooc (see plan_batch), 0 after
        self.cooc_deferred = np.ones(1, dtype=np.int64)
        self.other_after = np.zeros(acc.N, dtype=np.int64)  # meanwhile, <other> keys 1..w after a type-s query
        # views of the accumulator's CPU tensors: the loops add into them in place
        self.arrays = {"P": acc.P.numpy(), "counts": acc._counts.numpy(),
                       **{name: t.numpy() for name, t in acc.pos.items()},
                       **{name: getattr(acc, name).numpy() for name in ("query_count", "key_count", "position_count")}}

    @staticmethod
    def _buf(scratch, name, n, dtype=np.int64):
        return scratch.array(name, n, dtype)

    def _rank_table(self, n: int) -> np.ndarray:
        if self.rank_table.shape[0] != n:
            self.rank_table = np.full(n, -1, dtype=np.int32)
        return self.rank_table

    def plan(self, kb, qt, group: int, rank_table_max: int, deferred_max: int, scratch) -> dict:
        """Plan a batch (``plan_batch``) and add its model-free counts (the cell counts at :meth:`end_batch`, the
        forward half of cooc's tracked columns at :meth:`flush_counts` with ``complete``); the plan's arrays live in
        ``scratch``.
        ``group`` windows per pair chunk; the batch sums ``[U, L*H]`` are kept for one add at the end of the batch
        where they take at most ``deferred_max`` bytes (else each layer adds into P at once)."""
        self.flush_counts()  # a batch planned but not ended: its counts, before this plan reuses their buffers
        torch, i32 = self._torch, np.int32
        kb = np.ascontiguousarray(torch.as_tensor(kb).cpu().numpy(), dtype=np.int64)
        qt = np.ascontiguousarray(torch.as_tensor(qt).cpu().numpy(), dtype=np.int64)
        B, T = kb.shape
        K, LH = self.K, self.LH
        n_chunks, n_pairs = -(-B // group), B * T * (T + 1) // 2

        def buf(name, n, dtype=np.int64):
            return self._buf(scratch, name, n, dtype)

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
        plan = dict(qt=qt, group=group, pinv=pinv, cells=cells[:n_cells], m_off=m_off, u_off=u_off, sums=sums,
                    n_ub=n_ub, max_u=int(np.max(np.diff(u_off))) if n_chunks else 0,
                    count32=ub_count[:n_ub].astype(np.float32), count64=ub_count[:n_ub].astype(np.float64),
                    kinv=kinv, ub=ub[:n_ub], kinv_t=torch.from_numpy(kinv), ub_t=torch.from_numpy(ub[:n_ub]),
                    cell_counts=cell_counts[:n_cells])
        self._pending = plan
        return plan

    def kernel_heads(self, plan: dict, l: int, p4: np.ndarray, heads: range, scratch) -> None:
        """Heads ``heads`` of layer ``l``'s probabilities ``p4`` [B,H,T,T] (float32, contiguous) into their columns
        of the batch sums (or of P)."""
        if not len(heads):  # the helper's half of a one-head layer
            return
        H, width = p4.shape[1], min(len(heads), self.loops.HEAD_BLOCKS[0])
        kbuf = self._buf(scratch, "kbuf", plan["max_u"] * width, np.float32).reshape(-1, width)
        self.loops.kernel_heads(p4, plan["qt"], heads.start, heads.stop, plan["group"], plan["pinv"], plan["cells"],
                                plan["m_off"], plan["u_off"], kbuf, plan["sums"], l * H, self.arrays["P"])

    def position_sum(self, plan: dict, acc: np.ndarray, acc_sq: np.ndarray | None, x: np.ndarray, scratch) -> None:
        """Rows ``x`` [B*T, c] (float32) summed by bucket into ``acc`` [K, c] (float64), their squares into
        ``acc_sq`` where given: the additions of the torch form (``Accumulator._position_sums`` / ``_square_sum``)."""
        n_u, c = plan["n_ub"], x.shape[1]
        kinv, ub = plan["kinv"], plan["ub"]
        part = self._buf(scratch, "posu", n_u * c, np.float32).reshape(n_u, c)
        self.loops.bucket_sums(x, kinv, n_u, part)
        if acc_sq is not None:
            m2 = self._buf(scratch, "m2", n_u * c, np.float32).reshape(n_u, c)
            self.loops.add_square_sums(acc_sq, x, kinv, ub, part, plan["count32"], plan["count64"], n_u, m2)
        self.loops.add_bucket_sums(acc, ub, part, n_u)

    def norm_sum(self, plan: dict, acc: np.ndarray, x: np.ndarray, form: tuple, scratch) -> None:
        """The attention-input norm of rows ``x`` [B*T, d] (float32) summed by bucket into ``acc`` [K, d] (float64)
        without the norm module: the sums of the normalised rows, then the norm's affine (``form``: see
        :func:`checked_norm_forms`)."""
        kind, eps, scale, shift = form
        n_u, c = plan["n_ub"], x.shape[1]
        part = self._buf(scratch, "posu", n_u * c, np.float32).reshape(n_u, c)
        self.loops.bucket_norm_sums(x, plan["kinv"], n_u, part, kind, eps)
        self.loops.add_affine_bucket_sums(acc, plan["ub"], part, n_u, scale, shift, plan["count64"])

    def end_batch(self, plan: dict) -> None:
        """The batch's cell counts (nbar, C, cooc's backward half) and its kernel sums (where kept, see :meth:`plan`)
        into their cells, in one pass over them (``add_batch_sums``); the counts only if no :meth:`flush_counts`
        added them already (``Accumulator.sums`` called before the batch ended)."""
        a = self.arrays
        counts = plan["cell_counts"] if self._pending is plan else plan["cell_counts"][:0]
        self.loops.add_batch_sums(a["P"], a["counts"], plan["cells"], plan["sums"], counts)
        self._pending = None

    def flush_counts(self, complete: bool = False) -> None:
        """The cell counts (nbar, C, cooc's backward half) of a batch that was planned but not ended (no kernel sums:
        its layers did not all come, or only its model-free counts are wanted); called by the next plan and by
        ``Accumulator.sums``, which completes the counts (``complete``): the deferred forward half of cooc
        (``symmetrize_cooc``; the batches after it count theirs directly)."""
        plan, self._pending = self._pending, None
        a = self.arrays
        if plan is not None:
            self.loops.add_batch_sums(a["P"], a["counts"], plan["cells"], plan["sums"][:0], plan["cell_counts"])
        if complete and self.cooc_deferred[0] == 1:
            self.loops.symmetrize_cooc(a["counts"], self.K - 2, self.K, self.other_after)
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
