"""mfpipe.workflow.heap: the C allocator setting of the workflow's forward-pass jobs (glibc)."""

from __future__ import annotations

import ctypes
import ctypes.util
import subprocess
import sys
import textwrap

import pytest


def _glibc_with_mallinfo2() -> bool:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return hasattr(libc, "gnu_get_libc_version") and hasattr(libc, "mallinfo2")
    except OSError:
        return False


pytestmark = pytest.mark.skipif(not _glibc_with_mallinfo2(), reason="needs glibc >= 2.33 (mallopt, mallinfo2)")

_PROBE = textwrap.dedent("""
    import ctypes, ctypes.util, sys
    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in
                    ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                     "keepcost")]
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    if sys.argv[1] == "keep":
        from mfpipe.workflow.heap import keep_freed_memory
        assert keep_freed_memory()
    before = libc.mallinfo2().hblkhd
    block = bytearray(30 << 20)  # 30 MiB through malloc
    print(libc.mallinfo2().hblkhd - before)
""")


def _mmapped_bytes_of_a_30_mib_block(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, check=True)
    return int(out.stdout.strip())


def test_keep_freed_memory_serves_large_blocks_from_the_heap():
    """With the setting a 30 MiB block comes from the heap (memory a freed block leaves is reused by the next batch);
    with glibc's defaults a fresh process maps it on its own (and unmaps it when freed: fresh pages next time)."""
    assert _mmapped_bytes_of_a_30_mib_block("default") >= 30 << 20
    assert _mmapped_bytes_of_a_30_mib_block("keep") == 0


_ONCE = textwrap.dedent("""
    import mfpipe.workflow.heap as a
    calls = []
    real = a.ctypes.CDLL
    a.ctypes.CDLL = lambda *args, **kw: calls.append(args) or real(*args, **kw)
    print(a.keep_freed_memory(), a.keep_freed_memory(), len(calls))
""")


def test_keep_freed_memory_is_applied_once():
    """Once per process: the second call answers from the first (no second mallopt)."""
    out = subprocess.run([sys.executable, "-c", _ONCE], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "True", "1"]


_RELEASE = textwrap.dedent("""
    import os, torch
    from mfpipe.workflow.heap import keep_freed_memory, release_free_memory
    assert keep_freed_memory()
    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    blocks = [torch.ones(4 << 20) for _ in range(12)]  # 12 x 16 MiB from the heap
    blocks.append(torch.ones(16))  # a live block above them: the freed ones are not the heap's top
    del blocks[:12]
    kept = rss()
    released = release_free_memory()
    print(kept - rss(), released)
""")


def test_release_free_memory_hands_the_kept_memory_back():
    """The setting keeps freed blocks resident (the next batch reuses them); release_free_memory hands them back,
    below the heap's top too (pass 1 calls it before sums() builds the shard's arrays)."""
    out = subprocess.run([sys.executable, "-c", _RELEASE], capture_output=True, text=True, check=True)
    dropped, released = out.stdout.split()
    assert released == "True" and float(dropped) > 150, out.stdout


_HOLD = textwrap.dedent("""
    import ctypes, sys
    import numpy as np
    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in
                    ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                     "keepcost")]
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = MallInfo2
    if sys.argv[1] == "keep":
        from mfpipe.workflow.heap import keep_freed_memory
        assert keep_freed_memory()
    from mfpipe.stats.pass1 import Accumulator

    def mapped_by_a_48_mib_block():
        before = libc.mallinfo2().hblkhd
        block = bytearray(48 << 20)
        return libc.mallinfo2().hblkhd - before

    acc = Accumulator(1, 1, 4, 4, 3, 4, device="cpu")
    out = [mapped_by_a_48_mib_block()]
    acc.begin_batch(np.zeros((1, 4), dtype=np.int64), np.zeros((1, 4), dtype=np.int64))
    out += [acc._holding_heap, mapped_by_a_48_mib_block()]
    acc.sums()
    out += [acc._holding_heap, mapped_by_a_48_mib_block()]
    print(*out)
""")


@pytest.mark.parametrize("mode", ["keep", "default"])
def test_pass1_holds_large_blocks_in_the_heap_from_its_batches_to_sums(mode):
    """Where the job keeps freed memory, pass 1's batches get every block from the heap, also above glibc's largest
    mmap threshold of 32 MiB (48 MiB: a GPT-2-small attention tensor at batch 4 x 512, which else was mapped and
    unmapped batch after batch); from sums() on, large blocks are mapped again (handed back when freed). Without the
    kept-memory setting the process's allocator is left alone."""
    out = subprocess.run([sys.executable, "-c", _HOLD, mode], capture_output=True, text=True, check=True)
    before, holding, during, holding_after, after = out.stdout.split()
    assert int(before) >= 48 << 20 and int(after) >= 48 << 20
    assert holding_after == "False"
    if mode == "keep":
        assert holding == "True" and int(during) == 0
    else:
        assert holding == "False" and int(during) >= 48 << 20
