"""Pass 1 over one shard: the shard loop (:func:`mfpipe.stats.loop.run_reducer`) with pass 1's reducer
(:class:`mfpipe.stats.pass1.Accumulator`) built for the adapter's model."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from mfpipe.stats.loop import Reducer, run_reducer
from mfpipe.stats.pass1 import Accumulator

__all__ = ["accumulate_shard", "pass1_reducer"]


def pass1_reducer(adapter, n_tracked: int, context_length: int, device) -> Accumulator:
    """Pass 1's :class:`Accumulator` for ``adapter``'s model (the reducer factory of :func:`accumulate_shard`)."""
    return Accumulator(
        adapter.n_layers, adapter.n_heads, adapter.d_model, adapter.d_head, n_tracked, context_length,
        device=device, attn_input_norm=getattr(adapter, "attn_input_norm", None),
        value_weights=getattr(adapter, "value_weights", None),
        attn_input_norm_form=getattr(adapter, "attn_input_norm_form", None),
        attn_out_weights=getattr(adapter, "attn_out_weights", None),
        mlp_out_from_resid=bool(getattr(adapter, "mlp_out_from_resid", False)),
    )


def accumulate_shard(
    model,
    adapter,
    tokens: np.ndarray,
    tracked,
    batch_size: int = 8,
    device: str | torch.device | None = None,
    progress: bool = True,
    desc: str = "stats",
    reducer: Callable[..., Reducer] | None = None,
) -> dict[str, np.ndarray]:
    """Pass 1's additive sums of every statistic over the windows ``tokens`` [n_windows, T] of one shard
    (:func:`mfpipe.stats.loop.run_reducer`; ``reducer`` replaces pass 1's own, as the tests and benchmarks do)."""
    return run_reducer(model, adapter, tokens, tracked, reducer or pass1_reducer, batch_size=batch_size,
                       device=device, progress=progress, desc=desc)
