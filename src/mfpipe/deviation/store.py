"""The deviation store's reading side (``results/deviation/<model>/<revision>/deviation.zarr``, written by
:mod:`mfpipe.deviation.shards`): open it, provenance-checked, and the fingerprint of the
statistics store it was computed from. No torch: the ranking, Exp. 3 and error-accounting jobs read it without
loading the pass's machinery."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mfpipe.stats.api import check_provenance

__all__ = ["open_deviation", "stats_fingerprint"]


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
