"""Pass 1 over one shard: the shard loop (:func:`mfpipe.stats.loop.run_reducer`) with pass 1's reducer
(:class:`mfpipe.stats.pass1.Accumulator`) built for the adapter's model; a run of shards, one partial each
(:func:`shard_partials`, the ``stats_shard`` job)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import torch

from mfpipe.corpus.windows import read_shard
from mfpipe.stats.loop import Reducer, run_reducer
from mfpipe.stats.partials import partial_meta, partial_size, save_partial
from mfpipe.workflow.numerics import numerics_info
from mfpipe.stats.pass1 import Accumulator

__all__ = ["accumulate_shard", "layer_head_dims", "pass1_reducer", "shard_partials"]


def pass1_reducer(adapter, n_tracked: int, context_length: int, device, lazy_derived: bool = False,
                  kernel_dir: str | None = None) -> Accumulator:
    """Pass 1's :class:`Accumulator` for ``adapter``'s model (the reducer factory of :func:`accumulate_shard`);
    ``lazy_derived``: its derived sums computed a layer at a time as they are read (:func:`shard_partials`);
    ``kernel_dir``: its kernel sums in a file mapped from that folder (``stats.kernel_sums: disk``)."""
    return Accumulator(
        adapter.n_layers, adapter.n_heads, adapter.d_model, adapter.d_head, n_tracked, context_length,
        device=device, attn_input_norm=getattr(adapter, "attn_input_norm", None),
        value_weights=getattr(adapter, "value_weights", None),
        attn_input_norm_form=getattr(adapter, "attn_input_norm_form", None),
        attn_out_weights=getattr(adapter, "attn_out_weights", None),
        mlp_out_from_resid=bool(getattr(adapter, "mlp_out_from_resid", False)), lazy_derived=lazy_derived,
        kernel_dir=kernel_dir, layer_kinds=getattr(adapter, "layer_kinds", None),
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


def shard_partials(model, adapter, shards: list[str], tracked, folder: Path, *, model_name: str, revision: str,
                   dtype: str, commit=None, batch_size: int = 8, mantissa_bits: int | None = None,
                   log: logging.Logger | None = None, kernel_dir: str | None = None) -> None:
    """Pass 1 over each corpus shard of ``shards`` in turn (:func:`accumulate_shard`), its sums saved as the
    partial ``folder/<shard>.zarr`` (:func:`mfpipe.stats.partials.save_partial`, rounded to ``mantissa_bits``
    where given; the kernel sums in a file mapped from ``kernel_dir`` where given), recording the model
    (``model_name``, ``revision``, ``dtype``, the adapter's shape), the shard and, for a hub revision, the ``commit``
    it resolved to."""
    log = log or logging.getLogger("mfpipe")
    for shard in shards:
        tokens = read_shard(shard).tokens
        t0 = time.perf_counter()
        # the derived sums computed a layer at a time as the partial is written: never all of them beside the sums
        sums = accumulate_shard(model, adapter, tokens, tracked, batch_size=batch_size, progress=True,
                                desc=f"stats {Path(shard).stem}",
                                reducer=partial(pass1_reducer, lazy_derived=True, kernel_dir=kernel_dir))
        dt = time.perf_counter() - t0
        meta = partial_meta(tracked, tokens, {
            "model": model_name, "revision": revision, "dtype": dtype, "model_type": adapter.model_type,
            "n_layers": adapter.n_layers, "n_heads": adapter.n_heads, "n_kv_heads": adapter.n_kv_heads,
            "d_model": adapter.d_model, "d_head": adapter.d_head, "parallel_residual": adapter.parallel_residual,
            "layer_kinds": list(getattr(adapter, "layer_kinds", None) or ["attention"] * adapter.n_layers),
            "shard": shard, "numerics": numerics_info(),
        } | ({"revision_commit": str(commit)} if commit else {}) | layer_head_dims(adapter))
        part = folder / (Path(shard).stem + ".zarr")  # partial shard-NNNNN.zarr <- corpus shard-NNNNN.npz
        save_partial(part, sums, meta, mantissa_bits=mantissa_bits)
        log.info("%s: %d windows x T=%d, %d tokens in %.1f s (%.0f tok/s); %d tracked queries; partial %.0f MiB "
                 "on disk", shard, tokens.shape[0], tokens.shape[1], tokens.size, dt, tokens.size / max(dt, 1e-9),
                 int(sums["query_count"].sum()), partial_size(part) / 2**20)
        del sums  # the shard's sums go before the next shard's are made: one set at a time, not two


def layer_head_dims(adapter) -> dict:
    """``layer_head_dims`` (each layer's own head width) where the layers' heads differ in width: the store's
    ``head_dim`` coordinate is the widest, the others zero-padded (mfpipe.models.adapters.layers); {} else."""
    head_dim = getattr(adapter, "head_dim", None)
    dims = [int(head_dim(l)) for l in range(adapter.n_layers)] if callable(head_dim) else []
    return {"layer_head_dims": dims} if len(set(dims)) > 1 else {}
