"""Corpus-pass statistics of the attention mean field: accumulate per shard, merge, store, read.

- :mod:`mfpipe.stats.accumulate` — additive sums per shard (one traced forward per batch, all layers).
- :mod:`mfpipe.stats.store` — merged sums -> labelled xarray means -> zarr store (one layer per chunk).
- :mod:`mfpipe.stats.api` — :func:`open_stats` with provenance checks and accessors.
"""

from .accumulate import (
    Accumulator,
    StatsError,
    accumulate_shard,
    load_partial,
    merge_sums,
    partial_meta,
    run_shards,
    save_partial,
)
from .api import MeanFieldStats, ProvenanceError, check_provenance, open_stats
from .store import PROVENANCE_KEYS, finalize, read_attrs, write_store

__all__ = [
    "Accumulator",
    "StatsError",
    "accumulate_shard",
    "merge_sums",
    "save_partial",
    "load_partial",
    "partial_meta",
    "run_shards",
    "finalize",
    "write_store",
    "read_attrs",
    "open_stats",
    "MeanFieldStats",
    "ProvenanceError",
    "check_provenance",
    "PROVENANCE_KEYS",
]
