"""The held-out windows the substitution runs on: the first windows of the ``eval`` half, in shard order
(disjoint from the statistics half that gives W and μ)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from mfpipe.corpus.windows import list_shards, read_shard

__all__ = ["eval_windows"]


def eval_windows(shards_dir: Path, n_tokens: int) -> tuple[np.ndarray, list[str]]:
    """The first ceil(n_tokens / T) windows of the eval half, in shard order (fewer if the half is smaller)."""
    out, used, have = [], [], 0
    for p in list_shards(shards_dir / "eval"):
        tok = read_shard(p).tokens
        need = math.ceil((n_tokens - have) / tok.shape[1])
        out.append(tok[:need])
        used.append(p.name)
        have += out[-1].size
        if have >= n_tokens:
            break
    return np.concatenate(out), used
