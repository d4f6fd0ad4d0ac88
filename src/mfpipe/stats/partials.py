"""Per-shard partial sums of the statistics pass: save, load, merge by addition, provenance.

A partial is an ``.npz`` of float64 / int64 sums (keys :data:`SUM_KEYS`, see :mod:`mfpipe.stats.pass1`) plus a
JSON ``__meta__`` recording what it was computed from (model, revision, tracked set, shard fingerprint, …).
Partials of one (model, revision, half) merge by element-wise addition, so any split of the windows into
shards gives the same store. No torch here: merging and reading need only numpy.
"""

from __future__ import annotations

import hashlib
import json
import zipfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ..io import atomic_file
from .buckets import bucket_luts
from .errors import StatsError

PARTIAL_FORMAT = 1
INT_KEYS = ("n_windows", "n_tokens", "query_count", "key_count", "position_count", "nbar_sum", "context_count", "cooc")
FLOAT_KEYS = ("P_sum", "resid_sum", "resid_sq_sum", "attn_out_sum", "resid_mid_sum", "mlp_out_sum", "ln_in_sum",
              "value_sum", "read_sum")
SUM_KEYS = INT_KEYS + FLOAT_KEYS


def merge_sums(partials: Iterable[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Element-wise float64 / int64 sum of partial sums (shapes must agree)."""
    out: dict[str, np.ndarray] | None = None
    for k, p in enumerate(partials):
        missing = [key for key in SUM_KEYS if key not in p]
        if missing:
            raise StatsError(f"partial #{k} lacks {missing}; recompute it with this version of mfpipe")
        if out is None:
            out = {key: np.array(p[key], dtype=np.int64 if key in INT_KEYS else np.float64, copy=True) for key in SUM_KEYS}
            continue
        for key in SUM_KEYS:
            a = np.asarray(p[key])
            if a.shape != out[key].shape:
                raise StatsError(
                    f"partial #{k}: {key} has shape {a.shape}, earlier partials {out[key].shape} — partials from "
                    "different models, tracked sets or context lengths cannot be merged"
                )
            out[key] += a
    if out is None:
        raise StatsError("merge_sums: no partials given")
    return out


def save_partial(path: str | Path, sums: Mapping[str, np.ndarray], meta: Mapping[str, Any] | None = None, compress: bool = False) -> None:
    """Write a partial as ``.npz`` atomically (temp file in the same folder, then rename).

    ``meta`` (JSON-able) is stored under ``__meta__``. Stored uncompressed by default: zlib runs at ~30 MB/s
    (a GPT-2-small partial at N=1000 is 1.6 GB: ~50 s to deflate to ~0.5 GB, vs. a few seconds raw);
    ``compress=True`` deflates at level 1.
    """
    from numpy.lib import format as npformat

    meta = {"partial_format": PARTIAL_FORMAT, **dict(meta or {})}
    mode = zipfile.ZIP_DEFLATED if compress else zipfile.ZIP_STORED
    with atomic_file(path) as tmp, zipfile.ZipFile(tmp, "w", compression=mode, compresslevel=1 if compress else None,
                                                  allowZip64=True) as zf:
        items = dict(sums)
        items["__meta__"] = np.asarray(json.dumps(meta, sort_keys=True))
        for key, arr in items.items():
            with zf.open(f"{key}.npy", "w", force_zip64=True) as fh:
                npformat.write_array(fh, np.asanyarray(arr), allow_pickle=False)


def load_partial(path: str | Path) -> tuple[dict[str, np.ndarray], dict]:
    """(sums, meta) of a partial written by :func:`save_partial`."""
    path = Path(path)
    try:
        with np.load(path, allow_pickle=False) as z:
            sums = {k: z[k] for k in z.files if k != "__meta__"}
            meta = json.loads(str(z["__meta__"])) if "__meta__" in z.files else {}
    except FileNotFoundError:
        raise FileNotFoundError(f"statistics partial {path} does not exist; rerun the stats_shard step") from None
    except (zipfile.BadZipFile, ValueError, OSError) as e:
        raise StatsError(f"statistics partial {path} is unreadable ({e}); delete it and rerun the stats_shard step") from e
    return sums, meta


def tokens_fingerprint(tokens: np.ndarray) -> str:
    a = np.ascontiguousarray(tokens)
    h = hashlib.sha256(str(a.shape).encode())
    h.update(a.astype(np.int64).tobytes())
    return h.hexdigest()[:16]


def partial_meta(tracked, tokens: np.ndarray, extra: Mapping[str, Any] | None = None) -> dict:
    """What a partial records about its inputs (the merge refuses a partial whose meta does not match)."""
    meta = {
        "tracked_fingerprint": getattr(tracked, "fingerprint", None),
        "n_tracked": bucket_luts(tracked)[2],
        "context_length": int(np.asarray(tokens).shape[1]),
        "n_windows": int(np.asarray(tokens).shape[0]),
        "shard_fingerprint": tokens_fingerprint(tokens),
    }
    meta.update(dict(extra or {}))
    return meta


