"""Pass 1's reductions as torch ops: the engine of :class:`mfpipe.stats.pass1.Accumulator` on every device (GPUs
included) and, with ``engine="torch"``, on CPU. Its sums are the reference of the compiled CPU loops of
:mod:`mfpipe.stats.native`, which add the same terms in the same order (tests/test_stats_native.py).

Per batch (:meth:`TorchEngine.plan`): the batch's distinct key buckets and each position's rank among them, the
model-free counts, and per group of windows (at most ``PAIR_CHUNK`` pairs) the (query, key <= query) pairs of the
lower triangles whose query is tracked, with each pair's flat index into head 0 of a layer's [B,H,T,T]
probabilities and its compact cell (its rank among the group's distinct (query type, key bucket) cells, found
without sorting: :meth:`TorchEngine.compact`). Per layer: the kernel sums of each head by one gather and one
float32 ``scatter_add_`` into a small [H, U] buffer, then into the layer's columns of the group's [U, L*H] batch
sums (added into P once per batch) or of P; per statistic one float32 ``index_add_`` of the [B*T, width] rows into
[U_b, width], added once into its float64 sum (the residual's square around the batch's bucket mean).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mfpipe.stats.engine import BatchPlan, Totals
from mfpipe.stats.workspace import Scratch


@dataclass
class PairChunk:
    """The (query, key <= query) pairs of a group of windows, planned once per batch for every layer (the torch
    plan's :attr:`BatchPlan.pairs` is a list of them)."""

    gidx: torch.Tensor  # [M] flat index of each pair into head 0 of a layer's contiguous [B,H,T,T] probabilities
    pinv: torch.Tensor  # [M] the pair's compact cell: its rank among the chunk's distinct cells
    cells: torch.Tensor  # [U] the chunk's distinct cells s*K + t (rows of the [N*K, L*H] kernel sum)
    sums: torch.Tensor | None  # [U, L*H] the batch's sums of the chunk's cells (all layers; filled per layer), or
    # None: each layer's sums go into P at once (above the accumulator's deferred-sums limit)
    buf: torch.Tensor  # [H, U] one layer's sums of the chunk's cells, head-major (reused by every layer)


class TorchEngine:
    """The torch engine (:class:`~mfpipe.stats.engine.Engine`): torch ops on the device of the
    :class:`~mfpipe.stats.engine.Totals` it was made with, adding into them."""

    name = "torch"

    def __init__(self, totals: Totals, cooc_window: int):
        self.totals = totals
        self.cooc_window = int(cooc_window)
        N, K, T, dev = totals.N, totals.K, totals.T, totals.P.device
        self.device = dev
        # the compaction scratch: cell -> one of its pairs (see compact; 128 MB at N = 4000)
        self.lut = torch.empty(N * K, dtype=torch.int64, device=dev)
        # the (query j, key k <= j) pairs of one window, row-major (tests: the order of causal_pairs)
        tri_j, tri_k = torch.tril_indices(T, T, device=dev)
        self.tri_j, self.tri_k, self.tri = tri_j, tri_k, tri_j * T + tri_k

    def plan(self, kb, qt, group: int, scratch: Scratch, deferred_max: int, rank_table_max: int = 0) -> BatchPlan:
        """Plan a batch and add its model-free counts (the pairs of ``group`` windows per :class:`PairChunk`). The
        batch sums ``[U, L*H]`` are kept for one add at the end of the batch where all groups' take at most
        ``deferred_max`` bytes. (``rank_table_max``: the native plan's; no such table here.)"""
        tot, dev = self.totals, self.device
        kb = torch.as_tensor(kb, dtype=torch.int64).to(dev)
        qt = torch.as_tensor(qt, dtype=torch.int64).to(dev)
        B, T = kb.shape
        N, K, H, L = tot.N, tot.K, tot.H, tot.L
        kbf = kb.reshape(-1)
        ub, kinv, cnt = torch.unique(kbf, return_inverse=True, return_counts=True)
        qmask = qt >= 0
        tot.query_count += torch.bincount(qt[qmask], minlength=N)
        tot.key_count += torch.bincount(kbf, minlength=K)
        tot.position_count += qmask.sum(0)
        arangeT = torch.arange(T, device=dev)
        nbar, ctx = tot.nbar, tot.ctx

        # n_t(X) and C_st from the (query j, key k <= j) pairs of the batch: nbar[s,t] counts the pairs with a
        # type-s query and a bucket-t key; C[s,t] the same over the first key of each bucket in its window. The
        # pairs are the lower triangle of each window where the query is tracked (the order of
        # mfpipe.stats.buckets.causal_pairs), taken for groups of windows of at most PAIR_CHUNK pairs; with their
        # compact cells they are the plan of the attention-kernel reduction.
        firstpos = torch.full((B, K), T, dtype=torch.int64, device=dev)
        firstpos.scatter_reduce_(1, kb, arangeT.expand(B, T), reduce="amin")
        first = firstpos.gather(1, kb) == arangeT  # [B,T]: first position of its bucket in the window
        tri_j, tri_k, tri = self.tri_j, self.tri_k, self.tri
        n_tri = tri.numel()
        chunks = []
        for b0 in range(0, B, group):
            b1 = min(B, b0 + group)
            nw = b1 - b0
            # gather with the triangle's index broadcast over the windows, not index_select along dim 1 (on CPU
            # markedly faster for the mini models' [32, 64] -> [32, 2080])
            qj = torch.gather(qt[b0:b1], 1, tri_j.expand(nw, -1))  # [windows, n_tri] query type of each pair
            keep = (qj >= 0).view(-1).nonzero().squeeze(1)  # the pairs whose query is tracked
            if not keep.numel():
                continue
            kt = torch.gather(kb[b0:b1], 1, tri_k.expand(nw, -1))  # [windows, n_tri] key bucket of each pair
            pc = qj.mul_(K).add_(kt).view(-1).index_select(0, keep)  # the pair's cell s*K+t
            pinv, cells = self.compact(pc)
            U = cells.numel()
            # the key is its bucket's first in the window
            fk = torch.gather(first[b0:b1], 1, tri_k.expand(nw, -1)).view(-1).index_select(0, keep)
            by_first = torch.bincount(torch.add(fk, pinv, alpha=2), minlength=2 * U).view(U, 2)  # [U, (later, first)]
            ctx.scatter_add_(0, cells, by_first[:, 1])  # (1-D: scatter_add_, see kernel_heads)
            nbar.scatter_add_(0, cells, by_first.sum(1))
            win = torch.div(keep, n_tri, rounding_mode="floor")
            gidx = (win + b0).mul_(H * T * T).add_(tri.index_select(0, keep - win * n_tri))
            # allocated here, on the calling thread: the helper thread writes half of its rows (HelperThread)
            buf = scratch.get(f"kbuf{len(chunks)}", H * cells.numel(), torch.float32).view(H, -1)
            chunks.append(PairChunk(gidx, pinv, cells, None, buf))
        if 4 * L * H * sum(ch.cells.numel() for ch in chunks) <= deferred_max:
            for i, ch in enumerate(chunks):
                ch.sums = scratch.get(f"sums{i}", ch.cells.numel() * L * H, torch.float32).view(-1, L * H)

        # ±w co-occurrence: for each query position j (tracked, j >= 1), the buckets at j±1..j±w in the window
        w = min(self.cooc_window, T - 1)
        if w > 0:
            offs = torch.cat([torch.arange(1, w + 1, device=dev), -torch.arange(1, w + 1, device=dev)])
            pos = arangeT[:, None] + offs[None, :]  # [T, 2w]
            ok = qmask[:, :, None] & ((pos >= 0) & (pos < T))[None]  # [B, T, 2w]
            nb = torch.gather(kb, 1, pos.clamp(0, T - 1).view(1, -1).expand(B, -1)).view(B, T, -1)  # neighbours' buckets
            # a (query, neighbour) that is not one (no tracked query, outside the window) counts into the spare last
            # slot of the counts instead of being masked out: on CPU the masked copy cost as much as the count itself
            cells = torch.where(ok, qt[:, :, None] * K + nb, N * K).view(-1)
            tot.counts[:, 2].scatter_add_(0, cells, scratch.get("ones", cells.numel(), torch.int64).fill_(1))
        return BatchPlan(kinv=kinv, ub=ub, count32=cnt.to(torch.float32), count64=cnt.to(torch.float64), pairs=chunks)

    def compact(self, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(rank of each element's value among the distinct values, the distinct values) of cell indices ``c [M]``
        (values < N*K), without sorting: every element writes its position into a cell-indexed table, the element
        whose position survives represents its cell, and the representatives are ranked in order of position. Which
        element survives a duplicate write does not matter (each cell reads back one consistent representative), and
        the per-cell sums do not depend on the ranks' order."""
        M = c.numel()
        pos = torch.arange(M, device=c.device)
        self.lut.scatter_(0, c, pos)
        rep = self.lut.index_select(0, c)  # [M] the representative element of each element's cell
        is_rep = rep == pos
        rank = torch.cumsum(is_rep, 0).sub_(1)
        return rank.index_select(0, rep), c.index_select(0, is_rep.nonzero().squeeze(1))

    def kernel_heads(self, plan: BatchPlan, layer: int, probs: torch.Tensor, heads: range, scratch: Scratch) -> None:
        """The kernel sums of ``heads`` of one layer's flat float32 probabilities ``probs`` into their rows of each
        pair chunk's [H, U] buffer: per head one gather of the pairs' probabilities (the pair index plus the head's
        offset: no per-head index is built or streamed) and one float32 ``scatter_add_``."""
        hstride = self.totals.T * self.totals.T
        for ch in plan.pairs:
            vals = scratch.get("kval", ch.pinv.numel(), torch.float32)
            for h in heads:  # head h of pair i is element gidx[i] + h*T*T; its cell sum is buf[h, pinv[i]]
                torch.index_select(probs[h * hstride :], 0, ch.gidx, out=vals)
                # 1-D sums by index: scatter_add_, not index_add_ (faster on CPU, the same order of additions: the
                # same float32 result)
                ch.buf[h].zero_().scatter_add_(0, ch.pinv, vals)

    def kernel_flush(self, plan: BatchPlan, layer: int) -> None:
        """Each chunk's [H, U] buffer of layer ``layer`` into the layer's columns of its batch sums (or of P)."""
        H, P = self.totals.H, self.totals.P
        for ch in plan.pairs:
            if ch.sums is not None:
                ch.sums[:, layer * H : (layer + 1) * H].copy_(ch.buf.t())
            else:
                P[:, layer * H : (layer + 1) * H].index_add_(0, ch.cells, ch.buf.t())

    def position_sum(self, plan: BatchPlan, name: str, layer: int, x: torch.Tensor, scratch: Scratch) -> None:
        """Float32 rows ``x [B*T, c]`` of statistic ``name`` summed by bucket (one ``index_add_`` into the batch's
        [U_b, c]) and added once into its [K, c] float64 sums at ``layer``; the residual's squares too
        (:meth:`square_sum`)."""
        acc64, acc_sq = self.totals.rows(name, layer)
        kinv, ub = plan.kinv, plan.ub
        U, c = ub.numel(), x.shape[1]
        part = scratch.get("posu", U * c, torch.float32).view(U, c).zero_().index_add_(0, kinv, x)
        if acc_sq is not None:
            acc_sq.index_add_(0, ub, self.square_sum(plan, x, part, scratch))
        acc64.index_add_(0, ub, scratch.get("posu64", U * c, torch.float64).view(U, c).copy_(part))

    @staticmethod
    def square_sum(plan: BatchPlan, x: torch.Tensor, s1: torch.Tensor, scratch: Scratch) -> torch.Tensor:
        """Float64 ``sum x²`` over the batch's buckets of float32 rows ``x [B*T, d]`` whose float32 bucket sums are
        ``s1 [U_b, d]``. The square is summed around the batch's bucket mean in float32 and shifted back in float64
        (``sum x² = M2 + S1²/n``), so its float32 error is relative to the spread, not to ``c²``: E[x²] - c² then
        cancels exactly in float64."""
        kinv = plan.kinv
        BT, d = x.shape
        U = s1.shape[0]
        xc = torch.index_select(s1 / plan.count32[:, None], 0, kinv,
                                out=scratch.get("xc", BT * d, torch.float32).view(BT, d))
        torch.sub(x, xc, out=xc).square_()
        m2 = scratch.get("m2", U * d, torch.float32).view(U, d).zero_().index_add_(0, kinv, xc)
        s64 = s1.to(torch.float64)
        return s64.mul_(s64 / plan.count64[:, None]).add_(m2)

    def norm_sum(self, plan: BatchPlan, layer: int, resid: torch.Tensor, scratch: Scratch) -> bool:
        """False: the torch engine sums the norm module's output (:meth:`position_sum`)."""
        return False

    def end_batch(self, plan: BatchPlan) -> None:
        """The batch's kernel sums into P, all layers at once: one run of L*H floats per cell."""
        for ch in plan.pairs:
            if ch.sums is not None:
                self.totals.P.index_add_(0, ch.cells, ch.sums)

    def complete_counts(self) -> None:
        """Nothing: :meth:`plan` adds every count at once."""
