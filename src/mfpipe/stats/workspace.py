"""The statistics reducers' CPU workspace: reusable work buffers (:class:`Scratch`), the reducers' torch threads
(:func:`reducer_threads`) and the helper thread of pass 1 and pass 2 (:class:`HelperThread`)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

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
    barriers make their many small parallel ops many times slower (the model's forward keeps its own setting)."""
    prev = torch.get_num_threads()
    if n is None or n == prev:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(prev)
