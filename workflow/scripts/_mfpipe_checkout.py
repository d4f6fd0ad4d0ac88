"""Imported first by every job script: puts this checkout's src/ first on sys.path, so a job runs the library
its rule's code inputs track, not an installed mfpipe. Snakemake puts the script folder on the path of a
local script; PYTHONPATH is not used because a conda environment (`--sdm conda`) blocks it.

It also sets the job's C allocator to keep freed memory (mfpipe.workflow.heap: a forward pass frees and re-allocates
the same activations batch after batch). That changes a job's speed, not its result, so it is done here and not
through an ``mfpipe`` import of the script, which would make mfpipe/workflow/heap.py a code input of every rule.

And it turns Python's cyclic garbage collector off while the script's imports run (mfpipe.workflow.runner.run_logged turns it
back on, with what they made frozen, when the job's work starts): the ~1,500 modules of torch, numba, xarray and
pandas make hundreds of thousands of objects that live for the whole job, and the collector scanned them again
and again as they came (benchmarks/HISTORY.md, "A model job's start-up"). Speed only, like the allocator."""
import gc

gc.disable()

import sys  # noqa: E402
from pathlib import Path

_SRC = str(Path(__file__).resolve().parents[2] / "src")
if sys.path[:1] != [_SRC]:
    sys.path.insert(0, _SRC)

from mfpipe.workflow.heap import keep_freed_memory  # noqa: E402

keep_freed_memory()
