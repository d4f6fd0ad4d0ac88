"""The compiled loops of :mod:`mfpipe.stats.native` (imported on first use: importing numba and loading its
machine code costs resident memory and time, which a process that never runs pass 1 on CPU should not pay;
measured: benchmarks/HISTORY.md)."""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

_jit = njit(nogil=True, cache=True, boundscheck=False)
# rows this far ahead are prefetched in the scattered adds: after the forward none of them is in the cache, and
# asking early keeps more misses in flight (measured on the kernel add: benchmarks/HISTORY.md)
PREFETCH_AHEAD = 16


@intrinsic
def prefetch(typingctx, arr, idx):
    """Ask the CPU to bring element ``idx`` of contiguous ``arr`` (flat index) into the cache, for writing
    (``llvm.prefetch``: a hint with no effect on the result; the legacy ``p0i8`` name, which LLVM versions with
    typed and with opaque pointers both accept)."""
    def codegen(context, builder, signature, args):
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        ptr = builder.bitcast(builder.gep(ary.data, [args[1]]), i8p)
        fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0i8")
        builder.call(fn, [ptr, ir.Constant(i32, 1), ir.Constant(i32, 3), ir.Constant(i32, 1)])  # write, keep, data
        return context.get_dummy_value()

    return types.void(arr, idx), codegen

@_jit
def symmetrize_cooc(counts, N, K, other_after):
    """``cooc[s, t] += cooc[t, s]`` at once for all tracked ``s, t < N`` (the diagonal doubled), in place in the
    cooc column of ``counts`` [N*K(+1), 3], in tiles (a column's stride is a row of K cells), and ``other_after``
    [N] (then zeroed) into the ``<other>`` column: where only the backward half of cooc was counted (keys 1..w
    before a query), this adds the forward half (see :func:`plan_batch`)."""
    for s in range(N):
        counts[s * K + K - 1, 2] += other_after[s]
        other_after[s] = 0
    tile = 64
    for s0 in range(0, N, tile):
        for t0 in range(s0, N, tile):
            for s in range(s0, min(N, s0 + tile)):
                for t in range(max(t0, s), min(N, t0 + tile)):
                    both = counts[s * K + t, 2] + counts[t * K + s, 2]
                    counts[s * K + t, 2] = both
                    counts[t * K + s, 2] = both


@_jit
def plan_batch(kb, qt, K, group, cooc_window, cell_lut, rank_table, bucket_lut, stamp, first,
               query_count, key_count, position_count, counts,
               kinv, ub, ub_count, pinv, cells, slots, cell_counts, m_off, u_off, cooc_deferred, other_after):
    """Plan one batch (``kb``, ``qt`` int64 [B, T]; see the module docstring) and add its model-free counts:
    ``query_count`` [N], ``key_count`` [K], ``position_count`` [T] and the forward half of cooc (keys after the
    query): of the ``<other>`` column into ``other_after`` [N] while the tracked columns are deferred (below), of
    every column into ``counts`` [N*K(+1), 3] once the deferral has ended (contiguous int64: nbar, C, cooc side by
    side; the rest of a cell's counts goes to ``cell_counts``, below).

    The forward half of cooc (keys 1..w after a type-s query) of a tracked key bucket t is the backward half of
    cooc[t, s]: a key of tracked type t after the query is itself a query, the earlier one a key of bucket s in its
    prefix, wherever every tracked key is a query of its own type (``mirror``, always for window_buckets' buckets of
    a TrackedSet). So while ``cooc_deferred[0]`` is 1 a batch with ``mirror`` counts the forward half only for the
    ``<other>`` column, into ``other_after`` [N] (the BOS never follows a query), and leaves the tracked columns to
    :func:`symmetrize_cooc`, run once when the sums are read (``NativeEngine.complete_counts``): not ~8 k scattered
    increments of the [N*K, 3] counts per mini batch, each a cache miss after the forward. A batch without ``mirror`` symmetrizes what was deferred, sets ``cooc_deferred[0]`` to 0 and counts the
    forward half directly, as do all batches after it.

    ``cell_lut`` [N*K], ``bucket_lut`` [K] and ``rank_table`` [R] int32 are -1 on entry and left so (the rank
    table: the batch's [n_ub, n_ub] table where n_ub² <= R; only the slots a group used are reset, not the whole
    table, which cost a cold 0.85 MB write per mini batch); ``stamp`` [K], ``first`` [T] and ``slots`` (as
    ``cells``) int64 scratch.
    Outputs: ``kinv`` [B*T] int32 (each position's rank among the batch's buckets), ``ub`` / ``ub_count`` (the
    buckets in order of first appearance and their positions), per group of ``group`` windows ``c``: its pairs'
    compact cells ``pinv[m_off[c]:m_off[c+1]]`` (windows in order, each window's lower triangle row-major over
    its tracked queries) and its distinct cells ``cells[u_off[c]:u_off[c+1]]``, with, at the same rows of
    ``cell_counts`` [>= U, 3] int32, their pairs, their first-key pairs and their pairs of a key 1..w before the
    query (the batch's parts of nbar, C and the backward half of cooc: :func:`add_batch_sums` adds them, with the
    kernel sums of the same cells; the forward half of cooc, keys after the query, is added into ``counts`` here).
    Returns the number of buckets.
    """
    B, T = kb.shape
    N = K - 2
    n_ub, same, mirror = count_batch(kb, qt, N, kinv, ub, ub_count, bucket_lut, query_count, key_count,
                                     position_count)
    # ±w co-occurrence, excluding the query itself: the keys after it here (all of them, or only <other> ones while
    # the tracked ones are deferred, see above); the keys before it are pairs of the query's causal prefix, counted
    # per compact cell below (cache-resident there: every increment here is a cache miss in the [N*K, 3] counts)
    if cooc_deferred[0] == 1 and not mirror:
        symmetrize_cooc(counts, N, K, other_after)
        cooc_deferred[0] = 0
    count_cooc_after(kb, qt, K, cooc_window, cooc_deferred[0] == 1, counts, other_after)
    for u in range(n_ub):
        bucket_lut[ub[u]] = -1
    for t in range(K):
        stamp[t] = -1
    # The pairs' compact cells through a table of slots, -1 between batches: where a tracked query's type is its
    # key bucket (always, for window_buckets' buckets) and the batch has few buckets, the [n_ub, n_ub] table of
    # (query's bucket rank, key's bucket rank), cache-resident (the [N*K] one is not: after the forward every
    # first look-up of a cell was a cache miss); else the cell-indexed one
    small = same and n_ub * n_ub <= rank_table.shape[0]
    lut = rank_table if small else cell_lut
    n_chunks = (B + group - 1) // group
    m = 0
    m_off[0] = 0
    u_off[0] = 0
    for c in range(n_chunks):
        u0 = u_off[c]
        m, n_u = plan_group(kb, qt, K, c * group, min(B, (c + 1) * group), cooc_window, kinv, n_ub, small, lut,
                            stamp, first, m, u0, pinv, cells, slots, cell_counts)
        m_off[c + 1] = m
        u_off[c + 1] = u0 + n_u
        for r in range(n_u):
            lut[slots[r]] = -1
    return n_ub


@_jit
def count_batch(kb, qt, N, kinv, ub, ub_count, bucket_lut, query_count, key_count, position_count):
    """:func:`plan_batch`'s first pass: the query / key / position counts, the batch's buckets in order of first
    appearance (``ub``, ``ub_count``; ``bucket_lut`` left set for them) and each position's rank among them
    (``kinv``) -> (their number, whether every query's type is its key bucket, whether moreover every tracked key
    (type < ``N``) is a query: ``same`` and ``mirror`` there)."""
    B, T = kb.shape
    n_ub = 0
    same = True
    mirror = True
    for b in range(B):
        for j in range(T):
            t = kb[b, j]
            key_count[t] += 1
            u = bucket_lut[t]
            if u < 0:
                u = n_ub
                bucket_lut[t] = u
                ub[u] = t
                ub_count[u] = 0
                n_ub += 1
            kinv[b * T + j] = u
            ub_count[u] += 1
            s = qt[b, j]
            if s >= 0:
                same = same and s == t
                query_count[s] += 1
                position_count[j] += 1
            if s >= 0 or t < N:
                mirror = mirror and s == t
    return n_ub, same, mirror


@_jit
def count_cooc_after(kb, qt, K, cooc_window, deferred, counts, other_after):
    """The forward half of cooc (keys 1..w after each query) into ``counts``, or where ``deferred`` only that of
    the ``<other>`` column, into ``other_after`` (see :func:`plan_batch`)."""
    B, T = kb.shape
    for b in range(B):
        for j in range(T):
            s = qt[b, j]
            if s >= 0:
                for o in range(1, cooc_window + 1):
                    if j + o < T:
                        t = kb[b, j + o]
                        if not deferred:
                            counts[s * K + t, 2] += 1
                        elif t == K - 1:
                            other_after[s] += 1


@_jit
def plan_group(kb, qt, K, b0, b1, cooc_window, kinv, n_ub, small, lut, stamp, first, m, u0, pinv, cells, slots,
               cell_counts):
    """One group of :func:`plan_batch` (windows ``b0 <= b < b1``): its pairs' compact cells into ``pinv`` from row
    ``m``, its distinct cells (and their slots in ``lut``, left set) into ``cells`` from row ``u0`` and their counts
    into ``cell_counts`` -> (the next row of ``pinv``, the group's number of cells)."""
    T = kb.shape[1]
    n_u = 0
    for b in range(b0, b1):
        for k in range(T):  # a key is its bucket's first in the window (-> C: buckets present in a prefix)
            t = kb[b, k]
            first[k] = stamp[t] != b
            stamp[t] = b
        for j in range(T):
            s = qt[b, j]
            if s < 0:
                continue
            row = s * K
            trow = kinv[b * T + j] * n_ub
            for k in range(j + 1):
                if small:  # the cell's slot by the batch ranks of its query and key buckets
                    slot = trow + kinv[b * T + k]
                else:
                    slot = row + kb[b, k]
                r = lut[slot]
                if r < 0:
                    r = n_u
                    lut[slot] = r
                    cells[u0 + r] = row + kb[b, k]
                    slots[r] = slot
                    cell_counts[u0 + r, 0] = 0
                    cell_counts[u0 + r, 1] = 0
                    cell_counts[u0 + r, 2] = 0
                    n_u += 1
                pinv[m] = r
                m += 1
                # counted per compact cell (cache-resident); add_batch_sums adds them into nbar / C / cooc
                cell_counts[u0 + r, 0] += 1
                cell_counts[u0 + r, 1] += first[k]
                if j - k <= cooc_window and k < j:
                    cell_counts[u0 + r, 2] += 1
    return m, n_u

# Head blocks of a constant width: with the width a compile-time constant, the adds of a pair's heads into its
# cell's row are one vector add (the same per-head float32 additions in the same order as any other width), markedly
# faster than a width known only at run time. HEAD_BLOCKS: the widths compiled, widest first (a layer's heads go in blocks of these).
HEAD_BLOCKS = (8, 4, 2, 1)


@njit(nogil=True, boundscheck=False, inline="always")
def _kernel_block(p, qt, h0, W, group, pinv, cells, m_off, u_off, buf, sums, col, P):
    B, _, T, _ = p.shape
    n_chunks = m_off.shape[0] - 1
    for c in range(n_chunks):
        u0, n_u = u_off[c], u_off[c + 1] - u_off[c]
        if m_off[c + 1] == m_off[c]:
            continue
        for r in range(n_u):
            for h in range(W):
                buf[r, h] = 0
        i = m_off[c]
        for b in range(c * group, min(B, (c + 1) * group)):
            for j in range(T):
                if qt[b, j] < 0:
                    continue
                for k in range(j + 1):
                    r = pinv[i]
                    for h in range(W):
                        buf[r, h] += p[b, h0 + h, j, k]
                    i += 1
        if sums.shape[0]:
            for r in range(n_u):
                for h in range(W):
                    sums[u0 + r, col + h] = buf[r, h]
        else:
            for r in range(n_u):
                for h in range(W):
                    P[cells[u0 + r], col + h] += buf[r, h]


def _block_kernel(width: int):
    """The compiled kernel of heads blocks of ``width``: a closure, so numba freezes ``width`` as a compile-time
    constant (one specialisation per width, each cached under its own name)."""

    def kernel_block(p, qt, h0, group, pinv, cells, m_off, u_off, buf, sums, col, P):
        _kernel_block(p, qt, h0, width, group, pinv, cells, m_off, u_off, buf, sums, col, P)

    kernel_block.__name__ = kernel_block.__qualname__ = f"kernel_block{width}"
    return _jit(kernel_block)


_BLOCK_KERNELS = {w: _block_kernel(w) for w in HEAD_BLOCKS}


def kernel_heads(p, qt, h0, h1, group, pinv, cells, m_off, u_off, buf, sums, col0, P):
    """Heads ``h0 <= h < h1`` of one layer's contiguous float32 probabilities ``p`` [B, H, T, T] summed per
    compact cell (``pinv``, see :func:`plan_batch`): per (cell, head) a float32 sum in pair order from zero, in
    ``buf`` [U, >= the widest block used] (a block of heads' sums of a cell side by side), then into columns ``col0 + h`` of the group's
    rows of ``sums`` [sum U, L*H] or, where ``sums`` has no rows, added into those columns of the kernel sum ``P``
    [N*K, L*H] at the group's cells. The heads go in blocks of :data:`HEAD_BLOCKS` widths, widest first."""
    h = h0
    for W in HEAD_BLOCKS:
        fn = _BLOCK_KERNELS[W]
        while h + W <= h1:
            fn(p, qt, h, group, pinv, cells, m_off, u_off, buf, sums, col0 + h, P)
            h += W

@_jit
def zero_rows(a, n):
    """``a[:n] = 0`` for a 2-D array."""
    for r in range(n):
        for c in range(a.shape[1]):
            a[r, c] = 0

@_jit
def add_batch_sums(P, counts, cells, sums, cell_counts):
    """The batch's cells ``cells`` [U], one pass: their counts ``cell_counts`` [U, 3] (see :func:`plan_batch`) into
    nbar / C / cooc of ``counts`` [N*K(+1), 3] and, where ``sums`` [U, L*H] has rows, their kernel sums into the rows
    of ``P`` (float32, contiguous); where ``cell_counts`` has no rows, the kernel sums alone. Both rows of a cell are
    asked for ahead: after the forward neither is in the cache, and one pass keeps the two misses of a cell in flight
    together."""
    n, width = cells.shape[0], P.shape[1]
    with_sums = sums.shape[0] > 0
    with_counts = cell_counts.shape[0] > 0
    for r in range(n):
        if r + PREFETCH_AHEAD < n:
            ahead = cells[r + PREFETCH_AHEAD]
            prefetch(counts, ahead * counts.shape[1])
            if with_sums:
                prefetch(P, ahead * width)
        row = cells[r]
        if with_counts:
            counts[row, 0] += cell_counts[r, 0]  # nbar
            counts[row, 1] += cell_counts[r, 1]  # C
            counts[row, 2] += cell_counts[r, 2]  # cooc, keys before the query
        if with_sums:
            for c in range(sums.shape[1]):
                P[row, c] += sums[r, c]

@_jit
def bucket_sums(x, kinv, n_u, part):
    """``part[:n_u]`` = float32 sums of the rows of ``x`` [B*T, c] by bucket rank ``kinv``, in row order."""
    width = x.shape[1]
    zero_rows(part, n_u)
    for r in range(x.shape[0]):
        u = kinv[r]
        for c in range(width):
            part[u, c] += x[r, c]

@_jit
def add_bucket_sums(acc, ub, part, n_u):
    """``acc[ub[u]] += part[u]`` in float64 (``acc`` [K, c] float64)."""
    for u in range(n_u):
        row = ub[u]
        for c in range(part.shape[1]):
            acc[row, c] += np.float64(part[u, c])

@_jit
def add_square_sums(acc_sq, x, kinv, ub, part, count32, count64, n_u, m2):
    """Float64 ``sum x²`` by bucket into ``acc_sq`` [K, c]: the float32 sum of ``(x - c_b)²`` around the
    batch's bucket mean ``c_b = part / count32`` plus ``S1² / n`` in float64 (as
    :meth:`mfpipe.stats.torch_engine.TorchEngine.square_sum`)."""
    width = x.shape[1]
    zero_rows(m2, n_u)
    for r in range(x.shape[0]):
        u = kinv[r]
        n = count32[u]
        for c in range(width):
            d = x[r, c] - part[u, c] / n
            m2[u, c] += d * d
    for u in range(n_u):
        row = ub[u]
        n = count64[u]
        for c in range(width):
            s = np.float64(part[u, c])
            v = s * (s / n)
            acc_sq[row, c] += v + np.float64(m2[u, c])


# The norm's row moments may add in any order (they are checked against the norm module to a tolerance, not to
# the bit), so their sums vectorize; the sums of the normalised rows themselves keep the pass's fixed order. In
# float32, as the norm modules compute them (float64 moments took about twice as long).
@njit(nogil=True, boundscheck=False, fastmath={"reassoc", "contract", "nsz"})
def _row_moments(x, r, kind, eps):
    """(mean, 1 / sqrt(second moment + eps)) of row ``r`` of float32 ``x`` for a norm of kind ``kind`` (0: layer
    norm, around the mean; 1: RMS norm, mean 0; 2: identity, (0, 1))."""
    width = x.shape[1]
    if kind == 2:
        return np.float32(0.0), np.float32(1.0)
    mean = np.float32(0.0)
    if kind == 0:
        s = np.float32(0.0)
        for c in range(width):
            s += x[r, c]
        mean = s / np.float32(width)
    v = np.float32(0.0)
    for c in range(width):
        d = x[r, c] - mean
        v += d * d
    return mean, np.float32(1.0) / np.sqrt(v / np.float32(width) + np.float32(eps))


@_jit
def bucket_norm_sums(x, kinv, n_u, part, kind, eps):
    """``part[:n_u]`` = float32 sums by bucket rank ``kinv`` of the normalised rows ``z = (x - mean) * rstd`` of
    ``x`` [B*T, d] (float32, see :func:`_row_moments`), in row order."""
    width = x.shape[1]
    zero_rows(part, n_u)
    for r in range(x.shape[0]):
        mean, rstd = _row_moments(x, r, kind, eps)
        u = kinv[r]
        for c in range(width):
            part[u, c] += (x[r, c] - mean) * rstd


@_jit
def add_affine_bucket_sums(acc, ub, part, n_u, scale, shift, count64):
    """``acc[ub[u]] += scale * part[u] + count64[u] * shift`` in float64 (the norm's affine applied to the bucket's sum of
    ``z``; ``scale`` / ``shift`` float64 [d], ``count64`` the buckets' positions in the batch)."""
    for u in range(n_u):
        row, n = ub[u], count64[u]
        for c in range(part.shape[1]):
            acc[row, c] += scale[c] * np.float64(part[u, c]) + n * shift[c]
