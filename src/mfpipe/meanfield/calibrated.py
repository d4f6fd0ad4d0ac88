"""The calibrated kernel U as a labelled store (paper App. B, Alg. ``alg:sinkhorn``; computed by
:func:`mfpipe.experiments.substitution.calibration.calibrate_stats`): built with the statistics store's coordinates and provenance,
written atomically by the ``calibrate_kernel`` job, and loaded, provenance checked, by the substitution and
pass-2 jobs in place of W.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["CALIBRATED_FORMAT", "calibrated_dataset", "write_calibrated", "load_calibrated"]

CALIBRATED_FORMAT = 1


# the provenance a calibrated U shares with the statistics store whose P it was calibrated against
PAIRED = ("model", "revision", "half", "corpus_fingerprint", "tracked_fingerprint", "context_length")


def calibrated_dataset(U, stats, attrs: Mapping[str, Any] | None = None):
    """The calibrated kernel as a labelled :class:`xarray.Dataset`: ``U`` (layer, head, query, key) float32
    with the coordinates of the statistics store's ``P`` (``query_str``, ``key_str``, token ids), the store's
    attributes (provenance: model, revision, tracked and corpus fingerprints, ...) plus ``attrs``
    (``kind = "calibrated"`` and the calibration parameters). ``stats``: a :class:`MeanFieldStats`."""
    import xarray as xr

    P = stats.ds["P"]
    U = np.asarray(U, dtype=np.float32)
    if U.shape != tuple(P.shape):
        raise ValueError(f"U has shape {U.shape}, the statistics store's P {tuple(P.shape)}")
    coords = {name: c for name, c in P.coords.items()}
    a = dict(stats.attrs)
    a.update({"kind": "calibrated", "calibrated_format": CALIBRATED_FORMAT})
    a.update({k: v for k, v in dict(attrs or {}).items() if v is not None})
    da = xr.DataArray(U, dims=P.dims, coords=coords)
    da.attrs["description"] = "calibrated kernel U (App. B, Alg. sinkhorn): E_s[Â(U)] = P; use in place of W"
    return xr.Dataset({"U": da}, attrs=a)


def write_calibrated(ds, path: str | Path) -> Path:
    """Write :func:`calibrated_dataset`'s result as a zarr store, atomically, one layer per chunk."""
    from mfpipe.stats.store import write_store

    return write_store(ds, path)


def load_calibrated(path: str | Path, expect: Mapping[str, Any] | None = None, layer: int | None = None):
    """The calibrated kernel ``U`` as an :class:`xarray.DataArray` with the dims and coordinates of
    :meth:`MeanFieldStats.W` (layer, head, query, key; one layer loaded with ``layer``), after checking the store's
    provenance against ``expect`` (:func:`mfpipe.stats.api.check_provenance`: e.g. ``model``, ``revision``,
    ``tracked_fingerprint``); a mismatch raises :class:`~mfpipe.stats.api.ProvenanceError`. Without ``layer`` it is
    read from the store as it is indexed (``kernel_from_store`` reads a layer at a time): the recomputation's jobs held
    all of U beside the kernel they built from it (7.2 GB at Qwen3-14B's shape)."""
    from mfpipe.stats.api import check_provenance
    from mfpipe.stats.store import open_zarr

    path = Path(path)
    ds = open_zarr(path, "calibrated kernel store", "run its calibrate_kernel job")
    if ds.attrs.get("kind") != "calibrated" or "U" not in ds:
        raise ValueError(f"{path} is not a calibrated kernel store (no U / kind != 'calibrated')")
    check_provenance(ds.attrs, expect, path)
    U = ds["U"] if layer is None else ds["U"].isel(layer=layer).load()
    U.attrs.update({"min_count": ds.attrs.get("min_count"), "kind": "calibrated"})
    # what it was calibrated on, for the statistics it is paired with (kernel_from_store checks them)
    U.attrs.update({k: ds.attrs[k] for k in PAIRED if k in ds.attrs})
    return U
