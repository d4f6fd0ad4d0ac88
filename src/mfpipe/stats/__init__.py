"""Corpus-pass statistics of the attention mean field: accumulate per shard, merge, store, read.

- :mod:`mfpipe.stats.buckets` — windows -> key buckets / query types; prefix counts ``n_t(X_j)``.
- :mod:`mfpipe.stats.pass1` — the pass-1 reducer (:class:`Accumulator`): additive sums of every statistic.
- :mod:`mfpipe.stats.shards` — the shard loop, generic over a reducer (one traced forward per batch).
- :mod:`mfpipe.stats.partials` — per-shard partials: save, load, merge by addition, provenance.
- :mod:`mfpipe.stats.store` — merged sums -> labelled xarray means -> zarr store (one layer per chunk).
- :mod:`mfpipe.stats.api` — :func:`open_stats` with provenance checks and accessors.

The read side (``api``, ``store``, ``partials``) never imports torch; the names of the torch-using modules
are exported lazily, so ``from mfpipe.stats import open_stats`` stays light.
"""

from .api import MeanFieldStats, ProvenanceError, check_provenance, open_stats
from .errors import StatsError
from .partials import load_partial, merge_sums, partial_meta, save_partial
from .store import PROVENANCE_KEYS, finalize, read_attrs, write_store

_LAZY = {"Accumulator": "pass1", "accumulate_shard": "shards"}

__all__ = [
    "Accumulator",
    "StatsError",
    "accumulate_shard",
    "merge_sums",
    "save_partial",
    "load_partial",
    "partial_meta",
    "finalize",
    "write_store",
    "read_attrs",
    "open_stats",
    "MeanFieldStats",
    "ProvenanceError",
    "check_provenance",
    "PROVENANCE_KEYS",
]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
