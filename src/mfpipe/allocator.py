"""The C allocator of a forward-pass job: keep freed memory for the next batch instead of handing it back.

Why. glibc's malloc returns freed memory at the top of its heap to the kernel once more than the trim threshold is
free, and serves large blocks by ``mmap`` above a threshold that it moves on its own. A forward pass frees and
allocates the same activations batch after batch, so with the defaults a job paid for fresh pages every batch: each
a page fault and a 4 KiB zeroing (measured on the 2-core CPU machine: the mini models' bare forward 5-6 k minor
faults per batch of 32 x 64 tokens, 16-17 ms per batch, and 0 faults, 9-10.5 ms with :func:`keep_freed_memory`;
GPT-2 small at batch 4 x 512: 114 k faults, 2.85 s, and 0 faults, 2.61 s). Which batches paid depended on the
heap's history, so a pass's speed also changed with what ran before it in the process.

:func:`keep_freed_memory` fixes the ``mmap`` threshold (blocks up to 32 MiB come from the heap, as the moving
threshold already allowed at its highest), keeps up to 1 GiB free at the heap's top and grows the heap 64 MiB at a
time. A smaller trim threshold did not hold a GPT-2-small forward's batch: 128 MiB left it at 475 k faults per batch,
256 MiB at 23 k, 1 GiB at 0. The process's resident memory then stays near its peak between batches; the peak
itself moves with the heap's layout. Other C libraries (musl, macOS) and torch's own allocators (CUDA) are left alone.
Blocks above 32 MiB still come from the heap only while its top has room; pass 1 holds them in the heap for its
batches on top of this setting (:func:`mfpipe.stats.workspace.hold_heap_blocks`: a GPT-2-small stats job's 48 MiB
attention tensors were otherwise mapped afresh in one batch of every two or three), but not every job does: the
merge, holding them throughout, peaked 330-430 MiB higher.

The workflow's job scripts call it first (workflow/scripts/_mfpipe_checkout.py), the benchmarks before any form
they time. Kept memory is handed back where a pass ends and builds its results
(:func:`mfpipe.stats.workspace.release_free_memory`, called by pass 1's ``sums()``; it lives there so that this
module, which changes no result, is no code input of the statistics rules): without that the statistics job's peak (its sums and the partial's write on top of the
kept activations) was 150-350 MiB higher than with glibc's defaults; with it, lower (GPT-2 small: +1352 and +1367
MiB over the bare forward up to the partial's write, against +1378..+1556 with the defaults).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

log = logging.getLogger(__name__)

# mallopt parameters (glibc <malloc.h>)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit)
TRIM_THRESHOLD = 1 << 30
TOP_PAD = 64 << 20

_applied: bool | None = None


def keep_freed_memory() -> bool:
    """Set glibc's malloc to keep freed memory (see the module docstring); once per process. Returns whether the
    settings are in effect (False where the C library is not glibc)."""
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018 (glibc only: musl has no such symbol)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = all(mallopt(param, value) == 1 for param, value in (
        (_M_MMAP_THRESHOLD, MMAP_THRESHOLD), (_M_TRIM_THRESHOLD, TRIM_THRESHOLD), (_M_TOP_PAD, TOP_PAD)))
    if not ok:
        log.warning("glibc's mallopt refused the allocator settings; forward passes may page-fault batch after batch")
    _applied = ok
    return ok

