"""Pass 2's compiled CPU loop (numba), imported on first use by :mod:`mfpipe.deviation.queries` (numba and its
machine code cost import time and resident memory that a process not running pass 2 on CPU should not pay).

:func:`span_mixed_weights` is the middle of :func:`~mfpipe.deviation.queries.query_terms` for one span, in
one pass over each query row's attention instead of five tensor ops over ``[H, B, R, k]`` (the rows' gather out of
the layer's probabilities, the scatter-add of the attention per key type, the ratio's gather, its product with the
attention, and the exact weights' where): the same float32 operations in the same order, so at every valid query row
its weights and ``<other>`` shares equal the torch ops' bit for bit (tests/test_deviation.py). It reads the keys
``i <= j`` of a query row only (the causal attention is 0 above j, where it writes 0; the torch ops write 0 times the
ratio there, NaN on rows that are not valid, which callers drop) and releases the GIL, so two threads can each run
it on views of half the heads.
"""

from __future__ import annotations

import numpy as np
from numba import njit

# as queries._UNDERFLOW and deviation.TINY (float32 constants: the arithmetic stays float32 as torch's; numba bakes
# them into the machine code, and tests/test_deviation.py checks they equal those)
_UNDERFLOW = np.float32(1e-30)
_TINY = np.float32(1e-30)
_ONE = np.float32(1.0)
_ZERO = np.float32(0.0)


@njit(nogil=True, cache=True, boundscheck=False)
def span_mixed_weights(probs, rows, key_ranks, ahat, absent, counts, other, has_other, part_cols, part_count, h0, h1,
                       mixed_w, other_out, w_part):
    """For heads ``h0 <= h < h1`` of the arrays given (pass 2 gives each thread views of its half, 0..H), every window
    ``b`` and span row ``r`` (query position ``j = rows[b, r]``):

    - ``A[u]`` = Σ_{i <= j, rank(i) = u} probs[b, h, j, i] (the attention per key type, in key order: torch's
      scatter-add order); ``other_out[h, b, r]`` = A[other[b]] · has_other[b];
    - A[u] += absent[b, r, u] (types not in the prefix: 1, their Â is 0); ``mixed_w[h, b, r, i]`` = (Â_u / max(A_u,
      underflow)) · probs[.., i] for i <= j of type u, 0 above j; where a prefix type's A_u is below the underflow,
      the exact per-position weight instead: Â_u · probs / max(A_u, tiny) where A_u > 0, else Â_u / max(n_u, 1).

    Also the weights of the key columns ``part_cols [B, m]`` (the first ``part_count[b]`` of window b; 0 after):
    ``w_part[h, b, r, c]`` = mixed_w[h, b, r, part_cols[b, c]] (the gather that ``mixed_tracked`` takes).

    ``probs [B, H, T, T]``, ``ahat [H, B, R, U]`` (Â per key type, normalised), ``absent``/``counts [B, R, U]``,
    ``rows [B, R]``, ``key_ranks [B, k]``, ``other [B]`` (int64), ``has_other [B]`` (float32); writes ``mixed_w
    [H, B, R, k]``, ``other_out [H, B, R]`` and ``w_part [H, B, R, m]`` in place."""
    B, R = rows.shape
    U = ahat.shape[3]
    k = key_ranks.shape[1]
    A = np.empty(U, np.float32)
    ratio = np.empty(U, np.float32)
    for h in range(h0, h1):
        for b in range(B):
            ranks = key_ranks[b]
            for r in range(R):
                j = rows[b, r]
                p = probs[b, h, j]
                for u in range(U):
                    A[u] = _ZERO
                for i in range(j + 1):
                    A[ranks[i]] += p[i]
                other_out[h, b, r] = A[other[b]] * has_other[b]
                exact = False
                for u in range(U):
                    a = A[u] + absent[b, r, u]
                    A[u] = a
                    if a < _UNDERFLOW:
                        exact = True
                        a = _UNDERFLOW
                    ratio[u] = ahat[h, b, r, u] / a
                w = mixed_w[h, b, r]
                for i in range(j + 1):
                    w[i] = ratio[ranks[i]] * p[i]
                if exact:
                    for i in range(j + 1):
                        u = ranks[i]
                        a = A[u]
                        if a < _UNDERFLOW:
                            if a > _ZERO:
                                w[i] = ahat[h, b, r, u] * p[i] / max(a, _TINY)
                            else:
                                w[i] = ahat[h, b, r, u] / max(counts[b, r, u], _ONE)
                for i in range(j + 1, k):
                    w[i] = _ZERO
                wp = w_part[h, b, r]
                cols = part_cols[b]
                c_end = part_count[b]
                for c in range(c_end):
                    wp[c] = w[cols[c]]
                for c in range(c_end, wp.shape[0]):
                    wp[c] = _ZERO
