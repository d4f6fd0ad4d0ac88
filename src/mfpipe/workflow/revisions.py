"""Revisions: the one place that knows how a checkpoint is named.

A hub model's revision is whatever the hub calls it (a branch such as ``main`` or Pythia's ``step143000``,
a tag or a commit) and is passed through unchanged. A mini-suite checkpoint is ``step<k>`` (optimizer step
``k``) in ``results/minisuite/<model>/checkpoints/step<k>/``; the alias ``final`` names the last one. The
mini suite saves at :func:`checkpoint_steps`: ``0, 1, 2, 4, …`` (powers of two) and the last step.

Pure Python (no torch): the Snakefile resolves revisions while it builds the DAG.
"""

from __future__ import annotations

import re
from pathlib import Path

__all__ = [
    "FINAL",
    "ALL_CHECKPOINTS",
    "linear_steps",
    "checkpoint_steps",
    "step_name",
    "parse_step",
    "resolve_minisuite_revision",
    "minisuite_checkpoint_dir",
]

FINAL = "final"
ALL_CHECKPOINTS = "checkpoints"
_STEP_RE = re.compile(r"^step(\d+)$")


def linear_steps(linear: dict | None, total_steps: int) -> list[int]:
    """``start + every, start + 2 every, …`` below ``min(stop, total_steps)`` for ``{start, stop, every}``
    (a mini model's ``linear_checkpoints``); ``[]`` for None."""
    if not linear:
        return []
    start, stop, every = int(linear["start"]), int(linear["stop"]), int(linear["every"])
    if every < 1:
        raise ValueError(f"linear_checkpoints.every must be >= 1, got {every}")
    return list(range(start + every, min(stop, int(total_steps)), every))


def checkpoint_steps(total_steps: int, linear: dict | None = None) -> list[int]:
    """Checkpoint steps: log-spaced ``0, 1, 2, 4, 8, ...`` (powers of two below ``total_steps``), the
    :func:`linear_steps` of ``linear``, then ``total_steps``; sorted, unique. ``checkpoint_steps(0) == [0]``."""
    total = int(total_steps)
    if total < 0:
        raise ValueError(f"total_steps must be >= 0, got {total_steps}")
    steps = {0}
    p = 1
    while p < total:
        steps.add(p)
        p *= 2
    steps.update(linear_steps(linear, total))
    if total > 0:
        steps.add(total)
    return sorted(steps)


def step_name(step: int) -> str:
    """The revision name of optimizer step ``step``: ``step<k>``."""
    step = int(step)
    if step < 0:
        raise ValueError(f"a checkpoint step is >= 0, got {step}")
    return f"step{step}"


def parse_step(revision: str) -> int | None:
    """``k`` for a revision named ``step<k>``, else None."""
    m = _STEP_RE.match(str(revision))
    return int(m.group(1)) if m else None


def resolve_minisuite_revision(revision: str | None, steps: list[int], model: str = "?") -> str:
    """A concrete mini-suite revision ``step<k>`` for ``revision`` (``None`` / ``final`` = the last of
    ``steps``); raises ``ValueError`` naming the model and the valid names when ``k`` is not saved.
    (``checkpoints``, every saved step, is expanded by the caller.)"""
    if revision in (None, FINAL):
        return step_name(steps[-1])
    k = parse_step(revision)
    if k is None or k not in steps:
        raise ValueError(
            f"models: {model!r} revision {revision!r} is not a mini-suite checkpoint; "
            f"use {FINAL!r} or one of {[step_name(s) for s in steps]}"
        )
    return step_name(k)


def minisuite_checkpoint_dir(results_dir: str | Path, name: str, revision: str | None) -> Path:
    """Folder of a mini-suite checkpoint; ``final`` (or None) is the highest ``step<k>`` saved there."""
    root = Path(results_dir) / "minisuite" / name / "checkpoints"
    if revision in (None, FINAL):
        saved = sorted((k, p) for p in root.glob("step*") if (k := parse_step(p.name)) is not None)
        return saved[-1][1] if saved else root / FINAL
    return root / revision
