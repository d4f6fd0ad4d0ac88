"""The C heap of a forward-pass job (glibc), all through one ``ctypes`` handle of the process's C library
(:func:`_glibc`): keep freed memory for the next batch (:func:`keep_freed_memory`), hold every block in the heap
while pass 1 runs its batches (:func:`hold_heap_blocks`), hand free memory back when a pass builds its results
(:func:`release_free_memory`). Other C libraries (musl, macOS) and torch's own allocators (CUDA) are left alone.
Measurements behind these settings: benchmarks/HISTORY.md, "Pass 1 (statistics)".

Why keep freed memory. glibc's malloc returns freed memory at the top of its heap to the kernel once more than the
trim threshold is free, and serves large blocks by ``mmap`` above a threshold that it moves on its own. A forward
pass frees and allocates the same activations batch after batch, so with the defaults a job paid for fresh pages
every batch: each a page fault and a 4 KiB zeroing. Which batches paid depended on the heap's history, so a pass's
speed also changed with what ran before it in the process. :func:`keep_freed_memory` fixes the ``mmap`` threshold
(blocks up to 32 MiB come from the heap, as the moving threshold already allowed at its highest), keeps up to 1 GiB
free at the heap's top and grows the heap 64 MiB at a time (a smaller trim threshold did not hold a GPT-2-small
forward's batch). The process's resident memory then stays near its peak between batches; the peak itself moves
with the heap's layout.

The workflow's job scripts call it first (workflow/scripts/_mfpipe_checkout.py), the benchmarks before any form
they time. Blocks above 32 MiB still come from the heap only while its top has room, so pass 1 holds them there for
its batches (:func:`hold_heap_blocks`), and its ``sums()`` hands the kept memory back before it builds the shard's
arrays (:func:`release_free_memory`): without that the statistics job's peak (its sums and the partial's write on
top of the kept activations) was higher than with glibc's defaults; with it, lower.
"""

from __future__ import annotations

import ctypes
import logging
import sys
from functools import lru_cache

log = logging.getLogger(__name__)

# mallopt parameters (glibc <malloc.h>)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -2, -3, -4
MMAP_THRESHOLD = 32 << 20  # glibc's largest (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit)
TRIM_THRESHOLD = 1 << 30
TOP_PAD = 64 << 20
_GLIBC_MMAP_MAX = 65536  # M_MMAP_MAX's default (malloc.c DEFAULT_MMAP_MAX)

_applied: bool | None = None  # keep_freed_memory's outcome in this process (None: not called)


@lru_cache(maxsize=1)
def _glibc():
    """This process's C library where it is glibc (``ctypes.CDLL(None)``: the library already loaded, no
    ``ctypes.util.find_library``, which runs ``ldconfig`` in a subprocess, a fork of a process that may hold many
    GB), with ``mallopt`` and ``malloc_trim`` typed; looked up once per process. None off glibc."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 (glibc only: musl has no such symbol, nor malloc_trim)
        libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
        libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    except (OSError, AttributeError):
        return None
    return libc


def keep_freed_memory() -> bool:
    """Set glibc's malloc to keep freed memory (see the module docstring); once per process. Returns whether the
    settings are in effect (False where the C library is not glibc)."""
    global _applied
    if _applied is not None:
        return _applied
    libc = _glibc()
    if libc is None:
        _applied = False
        return False
    ok = all(libc.mallopt(param, value) == 1 for param, value in (
        (_M_MMAP_THRESHOLD, MMAP_THRESHOLD), (_M_TRIM_THRESHOLD, TRIM_THRESHOLD), (_M_TOP_PAD, TOP_PAD)))
    if not ok:
        log.warning("glibc's mallopt refused the allocator settings; forward passes may page-fault batch after batch")
    _applied = ok
    return ok


def hold_heap_blocks(hold: bool) -> bool:
    """Where the job keeps freed memory (:func:`keep_freed_memory` ran in this process), serve every C heap block
    from the heap while a pass runs its batches (``hold=True``: glibc ``M_MMAP_MAX`` = 0), and let glibc map blocks
    above its threshold on their own again after (``False``; pass 1's ``sums()``). Returns whether the setting was
    made (False without glibc or without the kept-memory setting: the process's allocator is left alone).

    Why. Above 32 MiB (glibc's largest mmap threshold) a block comes from the heap only while the heap's top has
    room; else it is mapped on its own and unmapped when freed, and the next one is fresh pages. A GPT-2-small
    forward's attention tensors at batch 4 x 512 are 48 MiB: the bare forward settled after one batch, but the
    statistics job, whose reducer keeps blocks live between the forward's, never did: it paged in up to a GB in one
    batch of every two or three, through the whole run; holding the blocks, it settled after a few batches. After
    the batches the arrays that ``sums()`` builds and the partial's write go back to mapped blocks, which are handed
    back when freed (a job that held every block throughout, the merge, peaked higher)."""
    if _applied is not True:
        return False
    libc = _glibc()
    return libc is not None and libc.mallopt(_M_MMAP_MAX, 0 if hold else _GLIBC_MMAP_MAX) == 1


def release_free_memory() -> bool:
    """Hand the C heap's free memory back to the kernel now (glibc ``malloc_trim(0)``: the free top and the free
    pages between live blocks). Pass 1's ``sums()`` calls it between the batches and the arrays it builds: where the
    job keeps freed memory (:func:`keep_freed_memory`), those arrays then reuse pages that are no longer resident
    instead of adding to the job's peak. Returns whether glibc released any (False off glibc)."""
    libc = _glibc()
    return bool(libc.malloc_trim(0)) if libc is not None else False
