"""The deviation store's reading side (``results/deviation/<model>/<revision>/deviation.zarr``, written by
:mod:`mfpipe.deviation.shards`): open it, provenance-checked, and the fingerprint of the
statistics store it was computed from, and the check against the statistics half it was computed over. No torch: the
ranking, Exp. 3 and error-accounting jobs read it without loading the pass's machinery."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from mfpipe.stats.api import ProvenanceError, check_provenance

__all__ = ["open_deviation", "stats_fingerprint", "check_against_half"]


def stats_fingerprint(stats) -> str:
    """What identifies pass 1's store: model, revision, half, corpus and tracked fingerprints and N tokens."""
    a = stats.attrs
    return "|".join(str(a.get(k)) for k in ("model", "revision", "half", "corpus_fingerprint", "tracked_fingerprint",
                                            "n_tokens"))


def open_deviation(path, expect: Mapping[str, Any] | None = None):
    """A deviation store (``deviation.zarr``), loaded and provenance-checked (:func:`check_provenance`)."""
    from mfpipe.stats.store import open_zarr

    ds = open_zarr(path, "deviation store", "run its deviation_merge job").load()
    check_provenance(ds.attrs, expect, path)
    return ds


def check_against_half(ds, path, shards, shard_paths: Sequence, info: Mapping[str, Any]) -> None:
    """Check a deviation store against the statistics half it was computed over: the store ``ds`` (read from
    ``path``) indexes its top contexts by (shard, window) of the half's sorted shard list ``shard_paths`` (the half
    of the corpus shards folder ``shards``), so the half must hold at least the shards and windows the store was
    computed over, at the store's context length (``info``: the corpus's info,
    :func:`mfpipe.stats.halves.corpus_info`). Raises :class:`ProvenanceError` otherwise."""
    half = info.get("halves", {}).get("stats", {})
    for key, have, want in (("shards", len(shard_paths), ds.attrs.get("n_partials")),
                            ("windows", half.get("n_windows"), ds.attrs.get("n_windows"))):
        if want is not None and have is not None and int(want) > int(have):
            raise ProvenanceError(f"deviation store {path} was computed over {want} {key} of the "
                                  f"statistics half, {shards} has {have}: rerun the deviation stage for this corpus")
    if int(ds.attrs.get("context_length", info["context_length"])) != int(info["context_length"]):
        raise ProvenanceError(f"deviation store {path} has context length {ds.attrs['context_length']}, "
                              f"the corpus {info['context_length']}: rerun the deviation stage for this corpus")
