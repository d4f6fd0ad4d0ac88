"""Which engine a corpus pass's reductions run on: the compiled CPU loops (numba) or torch ops. One rule for pass 1
(:mod:`mfpipe.stats.engine`) and pass 2 (:mod:`mfpipe.experiments.ranking.queries`), in a module that imports
neither's loops, so a job's code inputs list only the loops of its own pass."""

from __future__ import annotations

import importlib.util

__all__ = ["engine_name", "numba_available"]


def numba_available() -> bool:
    """Whether numba is installed (without importing it)."""
    return importlib.util.find_spec("numba") is not None


def engine_name(engine: str, device, error: type[Exception] = ValueError) -> str:
    """The engine that ``engine`` names on ``device``: "native" (the compiled loops: CPU with numba installed),
    "torch" (torch ops: any device) or, for "auto", native where it can run, else torch. ``error``: the exception
    class for an engine that cannot run here."""
    import torch

    if engine not in ("auto", "native", "torch"):
        raise ValueError(f"engine must be 'auto', 'native' or 'torch', not {engine!r}")
    runs_native = torch.device(device).type == "cpu" and numba_available()
    if engine == "native" and not runs_native:
        raise error("engine='native' runs on CPU with numba installed (pip install numba); use engine='torch'")
    return "native" if engine != "torch" and runs_native else "torch"
