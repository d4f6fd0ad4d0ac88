"""The shard loop of a corpus pass, generic over a reducer: one traced forward per batch (all layers at once)
through the adapter's read site, each layer handed to the reducer while the forward runs.

A reducer has the adapter-callback protocol (:class:`Reducer`): ``begin_batch(kb, qt)`` with the batch's key
buckets and query types ``[B, T]`` (:func:`mfpipe.stats.buckets.window_buckets`), ``on_layer(LayerCapture)``
per layer in order, ``on_final(resid)`` with the final residual before the last norm (``on_final = None``: the
reducer reads no final residual, and the forward stops after the last layer's ``on_layer``), ``end_batch()``, and
``sums()`` -> the additive numpy sums of everything seen (and, optionally, ``close()`` once done). Pass 1's is
:class:`mfpipe.stats.pass1.Accumulator` (run by :func:`mfpipe.stats.shards.accumulate_shard`); pass 2's is
:class:`mfpipe.deviation.pass2.DeviationAccumulator`. This module knows neither, so a pass-2 job does
not depend on pass 1's engines.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np
import torch

from mfpipe.stats.buckets import bucket_luts, window_buckets
from mfpipe.stats.errors import StatsError

__all__ = ["Reducer", "run_reducer"]


class Reducer(Protocol):
    def begin_batch(self, kb: np.ndarray, qt: np.ndarray) -> None: ...
    def on_layer(self, cap) -> None: ...
    on_final: Callable[[torch.Tensor], None] | None
    def end_batch(self) -> None: ...
    def sums(self) -> dict[str, np.ndarray]: ...


def _progress(iterable, total: int, enabled: bool, desc: str):
    if not enabled:
        return iterable
    from tqdm.auto import tqdm

    return tqdm(iterable, total=total, desc=desc, unit="batch", dynamic_ncols=True, mininterval=1.0)


def run_reducer(
    model,
    adapter,
    tokens: np.ndarray,
    tracked,
    reducer: Callable[..., Reducer],
    batch_size: int = 8,
    device: str | torch.device | None = None,
    progress: bool = True,
    desc: str = "pass",
) -> dict[str, np.ndarray]:
    """The additive sums of ``reducer`` over the windows ``tokens`` [n_windows, T] of one shard.

    ``model`` is the loaded HF model (only its device is used), ``adapter`` its
    :class:`~mfpipe.models.adapters.Adapter`; ``tracked`` a TrackedSet (or plain lookup tables, see
    :func:`bucket_luts`). Position 0 of every window must hold the tracked set's BOS id. ``device`` defaults
    to the model's device. ``reducer(adapter, n_tracked, context_length, device)`` builds the pass's reducer.
    """
    tokens = np.asarray(tokens)
    if tokens.ndim != 2:
        raise StatsError(f"tokens must be [n_windows, T], got shape {tokens.shape}")
    key_lut, query_lut, n, bos = bucket_luts(tracked)
    if bos is not None and tokens.shape[0] and not np.all(tokens[:, 0] == bos):
        bad = int(np.nonzero(tokens[:, 0] != bos)[0][0])
        raise StatsError(
            f"window {bad} starts with token {int(tokens[bad, 0])}, not the BOS id {bos} of the tracked set; "
            "windows must be [BOS, t1 … t(T-1)] (rebuild the corpus shards)"
        )
    if device is None:
        device = getattr(adapter, "device", None) or next(model.parameters()).device
    device = torch.device(device)
    batch_size = max(1, int(batch_size))
    acc = reducer(adapter, n, tokens.shape[1], device)
    n_batches = (tokens.shape[0] + batch_size - 1) // batch_size
    try:
        for i in _progress(range(n_batches), n_batches, progress, desc):
            chunk = tokens[i * batch_size : (i + 1) * batch_size]
            kb, qt = window_buckets(chunk, key_lut, query_lut, n)
            ids = torch.as_tensor(chunk.astype(np.int64), device=device)
            acc.begin_batch(kb, qt)
            # a reducer names the capture fields it reads (Accumulator.select; default: all of them)
            adapter.run(ids, select=getattr(acc, "select", "all"), on_layer=acc.on_layer, on_final=acc.on_final)
            acc.end_batch()
        return acc.sums()
    finally:
        if hasattr(acc, "close"):
            acc.close()  # pass 1's helper thread


