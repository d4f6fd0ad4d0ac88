"""Per-shard partial sums of the statistics pass: save, load, merge by addition, provenance.

A partial is a compressed, chunked Zarr (v3) store (a folder, ``shard-<i>.zarr``; ``xarray.open_zarr`` opens it too:
every array carries dimension names) of the sums (keys :data:`SUM_KEYS`, see :mod:`mfpipe.stats.pass1`) plus the JSON
attributes ``partial_format`` and ``meta`` (what it was computed from: model, revision, tracked set, shard
fingerprint, …). Stored dtypes (:data:`STORED_DTYPES`): counts int64, the residual sums and their squares float64 (the
variance E[x²] - c² cancels), every other sum float32 (pass 1 accumulates the kernel in float32; the error bound is in
:mod:`mfpipe.stats.pass1` and tests/test_stats_precision.py). ``resid_mid_sum`` is not stored: it is ``resid_sum[:L] +
attn_out_sum`` (the adapter's definition of resid_mid) and :func:`load_partial` rebuilds it. Chunks: one (layer, head)
of the kernel, one layer of the per-position sums; Blosc-zstd at level 1 with byte shuffle (bit shuffle for the counts
and rounded floats; a higher level writes markedly slower for little less on disk: the shuffled mantissa bits do not
compress further; benchmarks/HISTORY.md), then a CRC-32C checksum per chunk, and every chunk written: a truncated,
altered or missing chunk file is an error when read, never a silent zero.

Smaller partials, at a stated precision (``mantissa_bits``, the workflow's ``stats.partial_mantissa_bits``): the
float32 sums are rounded to that many explicit mantissa bits (:func:`round_mantissa`, to nearest, ties to even: each
stored (normal) value within 2^-(bits+1) of itself) and the float64 residual sums to :data:`RESIDUAL_EXTRA_BITS` more;
the dropped bits are zeros, which Blosc's bit shuffle compresses away. A float32 value carries about three bytes of
incompressible mantissa, so this is what shrinks a partial whose kernel cells are nearly all reached (a GPT-2-small
partial at N = 1000 of a 0.5 M-token shard: ~800 MB exact, ~480 MB at the presets' 11 bits). The kernel sums are sums
of non-negative attention, so the merged kernel sum keeps the same relative bound (:func:`rounding_bound`), and so
does each row's total: the rows of the store's P sum to 1 within it. The partial's ``meta`` records ``mantissa_bits``
(null: exact float32 / float64 storage); the merged store's attribute ``partial_mantissa_bits`` is the coarsest of its
partials' (absent when all are exact).

Partials of one (model, revision, half) merge by element-wise addition in float64 / int64, so any split of the windows
into shards gives the same store (up to the float32 rounding of each batch, and of each partial when rounded);
:func:`check_partial` refuses a partial whose shapes or provenance differ from what the merge expects, naming the
file. The kernel sum is merged one layer at a time (:func:`open_partial` leaves it on disk, :func:`merge_sums` sums it
lazily as a :class:`LayerSum`, and :func:`mfpipe.stats.store.write_stats` writes the store's ``P`` layer by layer), so
the merge's memory is one layer of P in float64 plus the per-position sums. Format-1 partials (``.npz``, float64)
still load. No torch here: merging and reading need only numpy and zarr."""

from __future__ import annotations

import hashlib
import json
import zipfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from mfpipe.workflow.io import atomic_dir
from mfpipe.stats.buckets import bucket_luts
from mfpipe.stats.errors import PartialError, StatsError
from mfpipe.stats.layered import LayerDerived, LayerSum
from mfpipe.stats.rounding import round_mantissa

PARTIAL_FORMAT = 2
INT_KEYS = ("n_windows", "n_tokens", "query_count", "key_count", "position_count", "nbar_sum", "context_count", "cooc")
FLOAT_KEYS = ("P_sum", "resid_sum", "resid_sq_sum", "attn_out_sum", "resid_mid_sum", "mlp_out_sum", "ln_in_sum",
              "value_sum", "read_sum")
SUM_KEYS = INT_KEYS + FLOAT_KEYS
DERIVED_KEYS = ("resid_mid_sum",)  # not stored; rebuilt on load
DIMS = {
    "n_windows": (), "n_tokens": (), "query_count": ("query",), "key_count": ("key",), "position_count": ("position",),
    "nbar_sum": ("query", "key"), "context_count": ("query", "key"), "cooc": ("query", "key"),
    "P_sum": ("layer", "head", "query", "key"),
    "resid_sum": ("depth", "key", "dim"), "resid_sq_sum": ("depth", "key", "dim"),
    "attn_out_sum": ("layer", "key", "dim"), "resid_mid_sum": ("layer", "key", "dim"),
    "mlp_out_sum": ("layer", "key", "dim"), "ln_in_sum": ("layer", "key", "dim"),
    "value_sum": ("layer", "head", "key", "head_dim"), "read_sum": ("layer", "head", "key", "head_dim"),
}
STORED_DTYPES = {k: np.dtype(np.int64) for k in INT_KEYS}
STORED_DTYPES.update({k: np.dtype(np.float32) for k in FLOAT_KEYS})
STORED_DTYPES.update({"resid_sum": np.dtype(np.float64), "resid_sq_sum": np.dtype(np.float64)})
# the residual sums (resid_var = E[x²] - c² cancels by up to (|c| / σ)²; GPT-2's massive-activation dimensions
# reach |c| / σ ~ 1e3) keep this many mantissa bits more than the other float sums when a partial is rounded
RESIDUAL_EXTRA_BITS = 24
EXTRA_BITS_KEYS = ("resid_sum", "resid_sq_sum")  # (float64) the other float sums are float32
# bytes of one sum written per Zarr call (save_partial): bounds the converted / rounded copy, lets Zarr compress the
# call's chunks side by side
WRITE_BLOCK_BYTES = 1 << 26
# what check_partial compares between a partial's meta and the merge's expectation (when both have it)
MATCH_KEYS = ("tracked_fingerprint", "n_tracked", "context_length", "model", "revision", "dtype", "model_type",
              "n_layers", "n_heads", "d_model", "d_head")


def sum_shapes(n_layers: int, n_heads: int, d_model: int, d_head: int, n_tracked: int, context_length: int) -> dict:
    """The shape of every sum (what a partial of this model / tracked set / context length must hold)."""
    L, H, d, dh, N, T = n_layers, n_heads, d_model, d_head, n_tracked, context_length
    K = N + 2
    return {
        "n_windows": (), "n_tokens": (), "query_count": (N,), "key_count": (K,), "position_count": (T,),
        "nbar_sum": (N, K), "context_count": (N, K), "cooc": (N, K), "P_sum": (L, H, N, K),
        "resid_sum": (L + 1, K, d), "resid_sq_sum": (L + 1, K, d), "attn_out_sum": (L, K, d),
        "resid_mid_sum": (L, K, d), "mlp_out_sum": (L, K, d), "ln_in_sum": (L, K, d),
        "value_sum": (L, H, K, dh), "read_sum": (L, H, K, dh),
    }


def shapes_of(sums: Mapping[str, np.ndarray]) -> dict:
    """The expected shapes of every sum, from the kernel and per-position sums of one partial."""
    L, H, N, K = np.shape(sums["P_sum"])
    return sum_shapes(L, H, np.shape(sums["resid_sum"])[-1], np.shape(sums["value_sum"])[-1], N,
                      np.shape(sums["position_count"])[0])


def check_partial(name: str, sums: Mapping[str, np.ndarray], meta: Mapping[str, Any] | None = None,
                  shapes: Mapping[str, tuple] | None = None, expect: Mapping[str, Any] | None = None) -> None:
    """Refuse a partial that cannot be merged: missing sums, shapes other than ``shapes`` (default: consistent
    with its own kernel sum), or ``meta`` values that differ from ``expect`` (keys :data:`MATCH_KEYS` and any
    other given). ``name`` (the file) goes into the error, with what to do."""
    missing = [key for key in SUM_KEYS if key not in sums]
    if missing:
        raise StatsError(f"partial {name} lacks {missing}; delete it and rerun the stats_shard step with this mfpipe")
    want = dict(shapes) if shapes is not None else shapes_of(sums)
    for key in SUM_KEYS:
        got = tuple(np.shape(sums[key]))
        if got != tuple(want[key]):
            raise StatsError(
                f"partial {name}: {key} has shape {got}, expected {tuple(want[key])} — partials from different models, "
                "tracked sets or context lengths cannot be merged; delete it and rerun the stats_shard step"
            )
    meta = dict(meta or {})
    if "n_windows" in meta and int(meta["n_windows"]) != int(np.asarray(sums["n_windows"])):
        raise StatsError(f"partial {name} holds {int(np.asarray(sums['n_windows']))} windows, its shard has "
                         f"{meta['n_windows']}; delete it and rerun the stats_shard step")
    for key, value in dict(expect or {}).items():
        if value is not None and key in meta and meta[key] is not None and meta[key] != value:
            raise StatsError(f"partial {name} was computed for {key}={meta[key]!r}, this merge needs {value!r}; "
                             "delete it and rerun the stats_shard step")


def merge_sums(partials: Iterable[Mapping[str, np.ndarray]], names: Iterable[str] | None = None,
               shapes: Mapping[str, tuple] | None = None) -> dict[str, np.ndarray]:
    """Element-wise float64 / int64 sum of partial sums; each partial is checked (:func:`check_partial`) against
    ``shapes`` (default: the first partial's) before it is added. ``names`` label the partials in errors. A sum
    left on disk (:func:`open_partial`) is summed lazily: the result holds a :class:`LayerSum` for it, which
    adds the partials one layer at a time when indexed."""
    out: dict[str, np.ndarray] | None = None
    names = iter(names) if names is not None else None
    for k, p in enumerate(partials):
        name = next(names) if names is not None else f"#{k}"
        check_partial(name, p, shapes=shapes if shapes is not None else (shapes_of(out) if out is not None else None))
        if out is None:
            out = {key: LayerSum(p[key]) if isinstance(p[key], _OnDisk) else
                   np.array(p[key], dtype=np.int64 if key in INT_KEYS else np.float64, copy=True) for key in SUM_KEYS}
            continue
        for key in SUM_KEYS:
            if isinstance(out[key], LayerSum):
                out[key].add(p[key])
            else:
                out[key] += np.asarray(p[key])
    if out is None:
        raise StatsError("merge_sums: no partials given")
    return out


def _chunks(key: str, shape: tuple) -> tuple:
    if key == "P_sum":
        return (1, 1) + tuple(shape[2:])
    if DIMS[key] and DIMS[key][0] in ("layer", "depth"):
        return (1,) + tuple(shape[1:])
    return tuple(shape)


def stored_mantissa_bits(key: str, bits: int | None) -> int | None:
    """The mantissa bits a partial rounded to ``bits`` keeps for sum ``key`` (None: not rounded)."""
    if bits is None or key in INT_KEYS:
        return None
    full = 52 if STORED_DTYPES[key] == np.float64 else 23
    return min(full, int(bits) + (RESIDUAL_EXTRA_BITS if key in EXTRA_BITS_KEYS else 0))


def rounding_bound(bits: int | None) -> float:
    """The relative error that rounding partials to ``bits`` mantissa bits adds to a merged sum of one sign (every
    kernel sum, every row total of P): 2^-(bits+1); 0.0 for exact partials (``bits`` None)."""
    return 0.0 if bits is None else 2.0 ** -(int(bits) + 1)


def _write_blocks(shape: tuple, n_lead: int, itemsize: int) -> list:
    """Index tuples that cover an array of ``shape`` whose first ``n_lead`` axes are chunked by 1: per index of the
    first ``n_lead - 1`` axes, runs along axis ``n_lead - 1`` of at most :data:`WRITE_BLOCK_BYTES` (at least one
    chunk)."""
    if n_lead == 0:
        return [...]
    chunk_bytes = itemsize * int(np.prod(shape[n_lead:], dtype=np.int64))
    run = max(1, WRITE_BLOCK_BYTES // max(chunk_bytes, 1))
    n = shape[n_lead - 1]
    return [(*idx, slice(i, min(i + run, n))) for idx in np.ndindex(*shape[: n_lead - 1]) for i in range(0, n, run)]


def save_partial(path: str | Path, sums: Mapping[str, np.ndarray], meta: Mapping[str, Any] | None = None,
                 clevel: int = 1, mantissa_bits: int | None = None) -> Path:
    """Write a partial as a compressed Zarr store at ``path`` (a folder), atomically: written to a temporary
    sibling and renamed into place when complete, so an interrupted write leaves no partial. ``clevel``: zstd's
    level (see the module docstring).

    ``meta`` (JSON-able) goes to the attribute ``meta``, with ``mantissa_bits``. Dtypes :data:`STORED_DTYPES`; a
    float64 sum stored as float32 is rounded once (relative error <= 2^-24). ``mantissa_bits`` (1..23, None: exact)
    rounds the float sums (:func:`round_mantissa`; the residual sums keep :data:`RESIDUAL_EXTRA_BITS` more)."""
    import zarr
    from zarr.codecs import BloscCodec, Crc32cCodec

    path = Path(path)
    check_partial(str(path), sums)
    if mantissa_bits is not None and not 1 <= int(mantissa_bits) <= 23:
        raise StatsError(f"partial {path}: mantissa_bits={mantissa_bits} is outside 1..23 (null keeps every bit); "
                         "fix stats.partial_mantissa_bits in the config")
    meta = {"partial_format": PARTIAL_FORMAT, **dict(meta or {}),
            "mantissa_bits": None if mantissa_bits is None else int(mantissa_bits)}
    with atomic_dir(path) as tmp:
        g = zarr.open_group(str(tmp), mode="w", zarr_format=3)
        g.attrs.update({"partial_format": PARTIAL_FORMAT, "meta": json.loads(json.dumps(meta))})
        for key in SUM_KEYS:
            if key in DERIVED_KEYS:
                continue
            a = sums[key]
            a = a if isinstance(a, LayerDerived) else np.asarray(a)  # a derived sum: computed a layer at a time
            dt = STORED_DTYPES[key]
            # bit shuffle where whole bit planes are zero (counts, rounded mantissas), byte shuffle for exact floats
            rounded = stored_mantissa_bits(key, mantissa_bits) is not None
            shuffle = "bitshuffle" if np.issubdtype(dt, np.integer) or rounded else "shuffle"
            # every chunk written (none left to the fill value) and checksummed: a missing, truncated or altered
            # chunk file is an error on reading (open_partial), never a silent zero
            arr = g.create_array(key, shape=a.shape, dtype=dt, chunks=_chunks(key, a.shape) if a.ndim else "auto",
                                 compressors=[BloscCodec(cname="zstd", clevel=clevel, shuffle=shuffle), Crc32cCodec()],
                                 fill_value=0, dimension_names=DIMS[key] or None,
                                 config={"write_empty_chunks": True})
            # a run of chunks at a time along the last axis chunked by 1 (the kernel's heads of one layer), as many
            # as WRITE_BLOCK_BYTES hold (GPT-2 small: a layer's 12 heads at N = 1000, one head's 64 MB at N = 4000,
            # not a layer's 0.8 GB): no full-size converted / rounded copy, and Zarr compresses the run's chunks
            # side by side (one chunk per call was markedly slower: benchmarks/HISTORY.md)
            chunks = _chunks(key, a.shape) if a.ndim else ()
            n_lead = next((i for i, c in enumerate(chunks) if c != 1), len(chunks))
            for idx in _write_blocks(a.shape, n_lead, np.dtype(dt).itemsize):
                arr[idx] = stored_form(key, a[idx], mantissa_bits)
    return path


def stored_form(key: str, a: np.ndarray, mantissa_bits: int | None = None) -> np.ndarray:
    """Sum ``key`` (or a block of it) as a partial stores it: in :data:`STORED_DTYPES`, rounded to ``mantissa_bits``
    (:func:`stored_mantissa_bits`). An in-memory run (``mfpipe.collect_stats``) passes its sums through this too."""
    part = np.asarray(a).astype(STORED_DTYPES[key], copy=False)
    bits = stored_mantissa_bits(key, mantissa_bits)
    return part if bits is None else round_mantissa(part, bits)


def with_derived(sums: dict) -> dict:
    """``sums`` with :data:`DERIVED_KEYS` rebuilt from the stored sums (float64), as :func:`open_partial` does."""
    sums["resid_mid_sum"] = sums["resid_sum"][: sums["attn_out_sum"].shape[0]].astype(np.float64) + sums["attn_out_sum"]
    return sums


def open_partial(path: str | Path, lazy: Iterable[str] = ("P_sum",)) -> tuple[dict, dict]:
    """(sums, meta) of a partial written by :func:`save_partial` (or a format-1 ``.npz``), with the sums named in
    ``lazy`` left on disk: Zarr arrays read when indexed (``sums["P_sum"][l]``: one layer), so that a merge never
    holds a whole kernel sum (9.2 GB of float32 for GPT-2 small at N = 4000). The other sums come back as numpy
    arrays in their stored dtypes; ``resid_mid_sum`` is rebuilt (float64). Raises :class:`PartialError` when
    the partial is unreadable: its metadata, a sum it lacks, a missing chunk, or a chunk whose checksum fails."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"statistics partial {path} does not exist; rerun the stats_shard step")
    if path.is_file():
        return _load_npz(path)
    import zarr

    lazy = set(lazy)
    try:
        g = zarr.open_group(str(path), mode="r")
        meta = dict(g.attrs.get("meta", {}))
        if g.attrs.get("partial_format") != PARTIAL_FORMAT:
            raise PartialError(path, f"has format {g.attrs.get('partial_format')!r}, this mfpipe reads {PARTIAL_FORMAT}")
        sums = {}
        for key in SUM_KEYS:
            if key in DERIVED_KEYS:
                continue
            if key not in g:
                raise PartialError(path, f"lacks {key}")
            arr = g[key]
            if arr.nchunks_initialized != arr.nchunks:
                raise PartialError(path, f"is unreadable ({key} has {arr.nchunks_initialized} of its {arr.nchunks} chunks)")
            sums[key] = _OnDisk(path, arr) if key in lazy else np.asarray(arr[...])
    except StatsError:
        raise
    except Exception as e:  # zarr / codec / checksum / JSON errors of a damaged store
        raise PartialError(path, f"is unreadable ({e})") from e
    return with_derived(sums), meta


def load_partial(path: str | Path) -> tuple[dict[str, np.ndarray], dict]:
    """(sums, meta) of a partial written by :func:`save_partial` (or a format-1 ``.npz``), all in memory. Sums come
    back in their stored dtypes; ``resid_mid_sum`` is rebuilt (float64)."""
    sums, meta = open_partial(path)
    return {k: np.asarray(v) for k, v in sums.items()}, meta


class _OnDisk:
    """A partial's sum left on disk (:func:`open_partial`): ``shape``, ``dtype``; ``[l]`` reads layer ``l``;
    ``np.asarray`` reads it all. A read error is a :class:`PartialError` naming the partial."""

    def __init__(self, path: Path, arr):
        self.path, self.arr = path, arr
        self.shape, self.dtype, self.ndim = tuple(arr.shape), np.dtype(arr.dtype), len(arr.shape)

    def __getitem__(self, index):
        try:
            return np.asarray(self.arr[index])
        except Exception as e:
            raise PartialError(self.path, f"is unreadable ({e})") from e

    def __array__(self, dtype=None, copy=None):
        a = self[...]
        return a if dtype is None else a.astype(dtype, copy=False)


def _load_npz(path: Path) -> tuple[dict[str, np.ndarray], dict]:
    try:
        with np.load(path, allow_pickle=False) as z:
            sums = {k: z[k] for k in z.files if k != "__meta__"}
            meta = json.loads(str(z["__meta__"])) if "__meta__" in z.files else {}
    except (zipfile.BadZipFile, ValueError, OSError) as e:
        raise PartialError(path, f"is unreadable ({e})") from e
    return sums, meta


def partial_size(path: str | Path) -> int:
    """Bytes on disk of a partial (a Zarr folder or a file)."""
    path = Path(path)
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


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


