"""Pass 1's engines behind one protocol (:class:`Engine`): what :class:`mfpipe.stats.pass1.Accumulator` calls,
whichever engine computes its sums (:func:`mfpipe.stats.pass1.make_engine`): the compiled CPU loops
(:mod:`mfpipe.stats.native`) or the torch ops (:mod:`mfpipe.stats.torch_engine`), and which engine a pass runs on
(:func:`engine_name`). It imports neither engine, so the engines import their protocol from here without a cycle.

The accumulator owns the shard's sums (:class:`Totals`) and hands them to its engine at construction; the engine
adds into them and owns everything else it needs (its look-up tables, its plan). Per batch the engine plans once
(:meth:`Engine.plan` -> :class:`BatchPlan`, shared by all layers), then reduces each layer's tensors with that plan
(:meth:`Engine.kernel_heads` / :meth:`Engine.kernel_flush`, :meth:`Engine.position_sum`, :meth:`Engine.norm_sum`)
and ends the batch (:meth:`Engine.end_batch`); :meth:`Engine.complete_counts` before the sums are read.
Every method may run on pass 1's helper thread beside another call on the same plan: two calls write disjoint
sums, each with its own ``scratch``.

No torch import at module level: this module is imported by :mod:`mfpipe.stats.native`, whose :func:`available`
the read side may ask.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol

if TYPE_CHECKING:
    import torch

    from mfpipe.stats.workspace import Scratch


@dataclass
class Totals:
    """The shard's sums that an engine adds into (see :mod:`mfpipe.stats.pass1` for their meaning). The counts of a
    cell (``nbar``, ``C``, ``cooc``) are side by side in ``counts`` [N*K + 1, 3] (a batch adds into a few thousand
    scattered cells of it: one cache miss per cell instead of three), its last row a spare slot of cooc (the torch
    plan counts what is no (query, neighbour) there). ``nbar`` / ``ctx`` / ``cooc`` are complete only after
    :meth:`Engine.complete_counts`."""

    L: int
    H: int
    N: int
    T: int
    P: torch.Tensor  # [N*K, L*H] float32 kernel sums, cell-major and layer-minor
    counts: torch.Tensor  # [N*K + 1, 3] int64
    query_count: torch.Tensor  # [N] int64
    key_count: torch.Tensor  # [K] int64
    position_count: torch.Tensor  # [T] int64
    pos: dict[str, torch.Tensor]  # name -> [depth, K, width] float64 per-position sums (resid, resid_sq: depth L + 1)

    @classmethod
    def zeros(cls, L: int, H: int, N: int, T: int, cols: dict[str, int], device, kernel_dir=None) -> Totals:
        """All sums zero; ``cols``: the per-position statistics summed, name -> row width (``resid`` among them:
        its square ``resid_sq`` is added). ``kernel_dir`` (CPU): the kernel sums in a file mapped from that folder
        (:func:`mapped_zeros`), not in the process's memory."""
        import torch

        K = N + 2
        i64, f64 = dict(dtype=torch.int64, device=device), dict(dtype=torch.float64, device=device)
        pos = {name: torch.zeros(L + (name == "resid"), K, width, **f64) for name, width in cols.items()}
        pos["resid_sq"] = torch.zeros(L + 1, K, cols["resid"], **f64)
        P = (mapped_zeros(kernel_dir, (N * K, L * H)) if kernel_dir is not None
             else torch.zeros(N * K, L * H, dtype=torch.float32, device=device))
        return cls(L, H, N, T, P,
                   torch.zeros(N * K + 1, 3, **i64), torch.zeros(N, **i64), torch.zeros(K, **i64),
                   torch.zeros(T, **i64), pos)

    @property
    def K(self) -> int:
        return self.N + 2

    @property
    def nbar(self) -> torch.Tensor:
        return self.counts[: self.N * self.K, 0]

    @property
    def ctx(self) -> torch.Tensor:
        return self.counts[: self.N * self.K, 1]

    @property
    def cooc(self) -> torch.Tensor:
        return self.counts[: self.N * self.K, 2]

    def rows(self, name: str, layer: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the [K, width] sums of statistic ``name`` at ``layer``, those of its square where one is kept)."""
        return self.pos[name][layer], self.pos["resid_sq"][layer] if name == "resid" else None


def mapped_zeros(folder, shape: tuple) -> torch.Tensor:
    """A float32 tensor of zeros backed by a file in ``folder`` (sparse: a page takes disk once written), unlinked at
    once: the mapping keeps it while the tensor lives and the system frees it after, an interrupted job included, so
    nothing is left behind. Its pages are the page cache's, written back and dropped under memory pressure, so the
    kernel sums (the largest of pass 1's sums: L H N (N+2) floats) need not fit in memory beside the weights."""
    import tempfile

    import numpy as np
    import torch

    fd, name = tempfile.mkstemp(prefix=".kernel-sums-", suffix=".f32", dir=folder)
    try:
        os.ftruncate(fd, int(np.prod(shape)) * 4)
        arr = np.memmap(name, dtype=np.float32, mode="r+", shape=tuple(shape))
    finally:
        os.close(fd)
        os.unlink(name)
    return torch.from_numpy(arr)


@dataclass
class BatchPlan:
    """An engine's plan of one batch (:meth:`Engine.plan`), shared by all its layers: numpy arrays on the native
    engine, tensors on the torch engine."""

    kinv: Any  # [B*T] each position's rank among the batch's buckets
    ub: Any  # [U_b] the batch's distinct buckets
    count32: Any  # [U_b] positions per distinct bucket, float32 ...
    count64: Any  # ... and float64
    pairs: Any  # the engine's plan of the kernel: its (query, key <= query) pairs and their compact cells

    @property
    def n_positions(self) -> int:
        """B*T: the rows of a layer's per-position tensors."""
        return int(self.kinv.shape[0])


class Engine(Protocol):
    """What :class:`~mfpipe.stats.pass1.Accumulator` calls; each engine adds into the :class:`Totals` it was made
    with. ``scratch`` (:class:`~mfpipe.stats.workspace.Scratch`): the calling thread's work buffers."""

    name: str  # "native" or "torch"

    def plan(self, kb, qt, group: int, scratch: Scratch, deferred_max: int, rank_table_max: int) -> BatchPlan:
        """Plan a batch of key buckets / query types ``[B,T]`` and add its model-free counts (``group`` windows per
        pair chunk; the batch's kernel sums ``[U, L*H]`` kept for one add at :meth:`end_batch` where they take at
        most ``deferred_max`` bytes, else each layer adds into P at once; ``rank_table_max``: the entries of the
        native plan's bucket-pair table)."""

    def kernel_heads(self, plan: BatchPlan, layer: int, probs: torch.Tensor, heads: range, scratch: Scratch) -> None:
        """The kernel sums of ``heads`` of one layer's flat float32 probabilities ``probs`` ([B,H,T,T] contiguous)."""

    def kernel_flush(self, plan: BatchPlan, layer: int) -> None:
        """After :meth:`kernel_heads` of every head of ``layer``: its sums into the batch sums (or P)."""

    def position_sum(self, plan: BatchPlan, name: str, layer: int, x: torch.Tensor, scratch: Scratch) -> None:
        """Float32 rows ``x`` [B*T, width] of statistic ``name`` at ``layer`` summed by bucket into its sums (the
        residual's square too)."""

    def norm_sum(self, plan: BatchPlan, layer: int, resid: torch.Tensor, scratch: Scratch) -> bool:
        """The attention-input norm of ``resid`` [B,T,d] summed into ``ln_in`` without the norm module, where the
        engine can (True); False: the caller sums the module's output with :meth:`position_sum`."""

    def end_batch(self, plan: BatchPlan) -> None:
        """The batch's kernel sums (and what else it deferred) into the sums."""

    def complete_counts(self) -> None:
        """Complete the counts before the sums are read (also mid-batch: they are not counted twice)."""


def numba_available() -> bool:
    """Whether numba is installed (without importing it)."""
    return importlib.util.find_spec("numba") is not None


def engine_name(engine: str, device, error: type[Exception] = ValueError) -> str:
    """The engine that ``engine`` names on ``device``: "native" (the compiled loops: CPU with numba installed),
    "torch" (torch ops: any device) or, for "auto", native where it can run, else torch. ``error``: the exception
    class for an engine that cannot run here. One rule for pass 1 and pass 2 (:mod:`mfpipe.deviation.queries`),
    in a module that imports neither's loops, so a job's code inputs list only the loops of its own pass."""
    import torch

    if engine not in ("auto", "native", "torch"):
        raise ValueError(f"engine must be 'auto', 'native' or 'torch', not {engine!r}")
    runs_native = torch.device(device).type == "cpu" and numba_available()
    if engine == "native" and not runs_native:
        raise error("engine='native' runs on CPU with numba installed (pip install numba); use engine='torch'")
    return "native" if engine != "torch" and runs_native else "torch"
