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
  pairs into it is stored or gathered), a pair's heads side by side, summed per compact cell;
- ``bucket_sums`` / ``add_bucket_sums`` / ``add_square_sums``: the per-position statistics by bucket.

Each float sum adds the same terms in the same order and precision as the torch op it replaces (float32 scatter /
index_add in pair / row order from zero, the float64 shift of the squares), so the sums are identical; the
ranks of the compact cells and buckets differ, which no sum depends on (tests/test_stats_native.py compares the
two engines' sums exactly). All functions release the GIL (pass 1's helper thread runs them side by side).

The loops live in :mod:`mfpipe.stats._native_loops`, imported on first use (:func:`loops`): numba and its machine
code cost ~130 MiB of resident memory and about a second to import. numba compiles them on first use in a
process (a few seconds; ``cache=True`` keeps the machine code beside that file, or in numba's user cache where
that is read-only). Without numba the torch form runs (:func:`available`).
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

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
