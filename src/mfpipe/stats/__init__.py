"""Corpus-pass statistics of the attention mean field: accumulate per shard, merge, store, read.

- :mod:`mfpipe.stats.buckets` — windows -> key buckets / query types; prefix counts ``n_t(X_j)``.
- :mod:`mfpipe.stats.pass1` — the pass-1 reducer (:class:`Accumulator`): additive sums of every statistic.
- :mod:`mfpipe.stats.loop` — the shard loop, generic over a reducer (one traced forward per batch).
- :mod:`mfpipe.stats.shards` — pass 1 over one shard (the loop with pass 1's reducer); a run of shards, one
  partial each.
- :mod:`mfpipe.stats.partials` — per-shard partials: save, load, merge by addition, provenance;
  :mod:`mfpipe.stats.rounding` the rounding of a partial's sums to fewer mantissa bits; :mod:`mfpipe.stats.layered`
  sums made a layer at a time (the merge's kernel sum, pass 1's derived sums as its partial is written).
- :mod:`mfpipe.stats.merge` — a half's partials checked against their shards and merged into its store.
- :mod:`mfpipe.stats.store` — merged sums -> labelled xarray means -> zarr store (one layer per chunk).
- :mod:`mfpipe.stats.api` — :func:`open_stats` with provenance checks and accessors.
- :mod:`mfpipe.stats.halves` — a statistics half paired with an evaluation half, each refused if it belongs to
  another model, revision, tracked set or corpus; a model checked against a store.
- :mod:`mfpipe.stats.buckets`, :mod:`mfpipe.stats.derived`, :mod:`mfpipe.stats.native`,
  :mod:`mfpipe.stats.torch_engine`, :mod:`mfpipe.stats.workspace` — pass 1's machinery (the
  C allocator's settings are :mod:`mfpipe.workflow.heap`); :mod:`mfpipe.stats.engine` — the protocol of its two
  engines (the compiled loops and the torch ops) and which one a pass runs on.
- :mod:`mfpipe.stats.errors` — the stage's errors, each saying what to change.
- :mod:`mfpipe.stats.rules` — the targets and input functions of workflow/rules/stats.smk.
- :mod:`mfpipe.stats.jobs` — the jobs of workflow/rules/stats.smk, one function per rule.

The read side (``api``, ``store``, ``partials``) never imports torch. Every name is exported lazily, each from the
module that defines it, so ``from mfpipe.stats import open_stats`` stays light and importing the package (its
``rules``, at every plan of the workflow) imports none of its modules.
"""

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
    # every name lazily, each branch importing only what it serves (mfpipe.workflow.codedeps follows each branch for
    # the names asked for): the workflow's planning imports mfpipe.stats.rules without xarray, and a reader of the store
    # does not depend on the pass
    if name in ("MeanFieldStats", "ProvenanceError", "check_provenance", "open_stats"):
        from mfpipe.stats import api

        return getattr(api, name)
    if name == "StatsError":
        from mfpipe.stats.errors import StatsError

        return StatsError
    if name in ("load_partial", "merge_sums", "partial_meta", "save_partial"):
        from mfpipe.stats import partials

        return getattr(partials, name)
    if name in ("PROVENANCE_KEYS", "finalize", "read_attrs", "write_store"):
        from mfpipe.stats import store

        return getattr(store, name)
    if name == "Accumulator":
        from mfpipe.stats.pass1 import Accumulator

        return Accumulator
    if name == "accumulate_shard":
        from mfpipe.stats.shards import accumulate_shard

        return accumulate_shard
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
