"""The statistics reducers' CPU workspace: reusable work buffers (:class:`Scratch`), the reducers' torch threads
(:func:`reducer_threads`) and pass 1's helper thread (:class:`HelperThread`)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from functools import lru_cache

import numpy as np
import torch


class Scratch:
    """Reusable work buffers, one per name, grown when a larger one is asked for. On CPU a fresh tensor of a few MB
    comes from mmap and is page-faulted in on first touch (on a VM that cost is close to the arithmetic of the
    reductions themselves), so the per-batch temporaries of the hot path live here instead."""

    def __init__(self, device: torch.device):
        self.device = device
        self._bufs: dict[str, torch.Tensor] = {}
        self._arrays: dict[str, np.ndarray] = {}

    def get(self, name: str, n: int, dtype: torch.dtype) -> torch.Tensor:
        return _grown(self._bufs, name, n, dtype, lambda size: torch.empty(size, dtype=dtype, device=self.device))

    def array(self, name: str, n: int, dtype) -> np.ndarray:
        """As :meth:`get`, a numpy array in host memory (the compiled loops' buffers: no tensor is made and converted
        per call)."""
        return _grown(self._arrays, name, n, dtype, lambda size: np.empty(size, dtype=dtype))


def _grown(store: dict, name: str, n: int, dtype, make):
    """The first ``n`` elements of buffer ``name`` in ``store``, made anew (``make(size)``) where it is missing, of
    another dtype or too small."""
    buf = store.get(name)
    if buf is None or buf.dtype != dtype or buf.shape[0] < n:
        buf = make(max(int(n), 1))
        store[name] = buf
    return buf[:n]


class HelperThread:
    """One more CPU thread for the reducer: per layer the work splits into two halves that write disjoint sums (half
    the heads of the kernel, part of the per-position statistics), one run here and one there. The reductions are
    gather / scatter loops that torch runs on one thread each, and while the reducer runs the forward is parked, so
    the job's second core is idle; the halves' torch ops release the GIL and run side by side. Each sum is computed
    by one thread with the same operations as without the helper: the sums are bit for bit the same."""

    def __init__(self, threads: int | None):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mfpipe-reducer")
        self._threads = threads

    def _run(self, fn):
        with torch.no_grad(), reducer_threads(self._threads):  # grad mode and torch threads are per thread
            fn()

    def both(self, here: Callable[[], None], there: Callable[[], None]) -> None:
        """``here()`` on this thread and ``there()`` on the helper, returning when both are done (an exception of
        either is raised here, after both finished)."""
        fut = self._pool.submit(self._run, there)
        try:
            here()
        finally:
            fut.result()

    def close(self) -> None:
        self._pool.shutdown(wait=True)


@contextmanager
def reducer_threads(n: int | None):
    """Run a reducer's work on ``n`` torch threads (None: leave torch alone), restoring the caller's setting after:
    gather / scatter dominated reductions gain little from intra-op threads on CPU, and on a busy machine OpenMP
    barriers make their many small parallel ops 10-100x slower (the model's forward keeps its own setting)."""
    prev = torch.get_num_threads()
    if n is None or n == prev:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(prev)


def release_free_memory() -> bool:
    """Hand the C heap's free memory back to the kernel now (glibc ``malloc_trim(0)``: the free top and the free
    pages between live blocks). Pass 1's ``sums()`` calls it between the batches and the arrays it builds: where the
    job keeps freed memory (:func:`mfpipe.allocator.keep_freed_memory`), those arrays then reuse pages that are no
    longer resident instead of adding to the job's peak. Returns whether glibc released any (False off glibc)."""
    libc = _glibc()
    return bool(libc.malloc_trim(0)) if libc is not None else False


# glibc's mallopt parameter M_MMAP_MAX and its default (<malloc.h>, malloc.c DEFAULT_MMAP_MAX)
_M_MMAP_MAX, _GLIBC_MMAP_MAX = -4, 65536


def hold_heap_blocks(hold: bool) -> bool:
    """Where the job keeps freed memory (:func:`mfpipe.allocator.keep_freed_memory` ran in this process), serve
    every C heap block from the heap while a pass runs its batches (``hold=True``: glibc ``M_MMAP_MAX`` = 0), and let
    glibc map blocks above its threshold on their own again after (``False``; pass 1's ``sums()``). Returns whether
    the setting was made (False without glibc or without the kept-memory setting: the process's allocator is left
    alone).

    Why. Above 32 MiB (glibc's largest mmap threshold) a block comes from the heap only while the heap's top has
    room; else it is mapped on its own and unmapped when freed, and the next one is fresh pages. A GPT-2-small
    forward's attention tensors at batch 4 x 512 are 48 MiB: the bare forward settled after one batch, but the
    statistics job, whose reducer keeps blocks live between the forward's, never did: over 20 batches it paged in
    12-307 k pages (up to 1.2 GB) in one batch of every two or three, through the whole run (median batch 2.86-3.19 s
    in three runs); holding the blocks, it settled after 2-5 batches to 0-3 faults per batch (2.81-2.84 s). After the
    batches the arrays that ``sums()`` builds and the partial's write go back to mapped blocks, which are handed back
    when freed: a job that held every block throughout (the merge, tried through keep_freed_memory) peaked 330-430 MiB
    higher.

    ``mfpipe.allocator`` is looked up, not imported: it changes no result and is no code input of the statistics
    rules."""
    allocator = sys.modules.get("mfpipe.allocator")
    if getattr(allocator, "_applied", None) is not True:
        return False
    libc = _glibc()
    return libc is not None and libc.mallopt(_M_MMAP_MAX, 0 if hold else _GLIBC_MMAP_MAX) == 1


@lru_cache(maxsize=1)
def _glibc():
    """This process's C library where it is glibc (``ctypes.CDLL(None)``: the library already loaded, no
    ``ctypes.util.find_library``, which runs ``ldconfig`` in a subprocess: 7 ms a call, and a fork of a process that
    may hold many GB), with ``mallopt`` and ``malloc_trim`` typed; looked up once per process. None off glibc."""
    import ctypes

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
