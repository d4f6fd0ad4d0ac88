"""The statistics store: merged sums -> labelled means (xarray) -> one zarr store per (model, revision, half).

``results/stats/<model>/<revision>/<half>.zarr`` holds (``L`` layers, ``H`` heads, ``N`` tracked types,
``K = N + 2`` buckets, ``d`` width, ``dh`` head width, ``T`` context length):

=====================  ===============================  ===============================================
variable               dims                             meaning
=====================  ===============================  ===============================================
``P``                  layer, head, query, key          mean attention of type-s queries on bucket t (eq:P);
                                                        rows sum to 1 over the K buckets (within
                                                        2^-(k+1) when attribute partial_mantissa_bits = k)
``nbar``               query, key                       mean n_t(X) over type-s contexts (App. A)
``context_count``      query, key                       C_st: type-s contexts with n_t(X) >= 1 (App. E)
``cooc``               query, key                       keys of bucket t within ±5 of a type-s query (Sec. 4.2)
``query_count``        query                            n_s, number of type-s contexts
``key_count``          key                              positions per bucket (``<bos>``: n_windows)
``position_count``     position                         tracked-query positions per position index
``centroid``           depth, key, dim                  mean residual entering block ``depth`` over positions of
                                                        the bucket (depth L: final residual before the last
                                                        norm); ``key=N`` is the BOS representation b
``resid_var``          depth, key, dim                  within-bucket per-dimension variance (App. D)
``mu``                 layer, head, key, head_dim       mean value vector of the head over the bucket's positions
``zbar``               layer, head, key, head_dim       mean read of the head (input of the output projection)
                                                        over the bucket's positions = per query type for
                                                        ``key < N`` (eq:exact-contribution, measured)
``attn_out_mean``      layer, key, dim                  mean attention-branch output (what joins the residual)
``resid_mid_mean``     layer, key, dim                  mean post-attention residual m (App. K)
``mlp_out_mean``       layer, key, dim                  mean MLP-branch output (App. K)
``ln_in_mean``         layer, key, dim                  mean attention-input norm output E[ln1(x)] (App. D Jensen
                                                        gap: compare with ln1(centroid))
=====================  ===============================  ===============================================

Per-position statistics are grouped by the position's bucket along ``key`` (so ``P`` contracts with ``mu``
and ``centroid`` along ``key``); tracked rows ``key < N`` are the query types. Coordinates: ``query`` and
``key`` are bucket ranks (``query`` = ``key`` = s for tracked type s) with ``query_str`` / ``key_str``
(``<bos>``, ``<other>``) and ``query_token_id`` / ``key_token_id`` (``<other>``: -1). Means with no
observation are NaN (never 0 or inf). The ``layer`` and ``depth`` dims are chunked by 1: one layer per
chunk; unwritten chunks read as NaN. Provenance lives in the attributes (see :data:`PROVENANCE_KEYS`).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import xarray as xr

from mfpipe.stats.buckets import COOC_WINDOW, bucket_luts
from mfpipe.stats.errors import StatsError
from mfpipe.stats.partials import SUM_KEYS

STORE_FORMAT = 1
DEFAULT_MIN_COUNT = 20
# what open_stats(expect=...) compares; `model`, `revision`, `half` and `corpus_fingerprint` come from the caller
PROVENANCE_KEYS = (
    "model",
    "revision",
    "half",
    "corpus_fingerprint",
    "tracked_fingerprint",
    "n_tracked",
    "context_length",
)


def code_version() -> str:
    try:
        from mfpipe.version import __version__

        return str(__version__)
    except Exception:  # pragma: no cover
        return "unknown"


def _mean(total: np.ndarray, count: np.ndarray, axis_shape: tuple[int, ...]) -> np.ndarray:
    """total / count broadcast as ``axis_shape``; NaN where count == 0."""
    c = np.asarray(count, dtype=np.float64).reshape(axis_shape)
    out = np.full(np.broadcast_shapes(total.shape, c.shape), np.nan, dtype=np.float64)
    np.divide(total, c, out=out, where=np.broadcast_to(c > 0, out.shape))
    return out


def _jsonable(v: Any) -> Any:
    if isinstance(v, (np.integer,)):
        return int(v)
    if isinstance(v, (np.floating,)):
        return float(v)
    if isinstance(v, np.ndarray):
        return v.tolist()
    if isinstance(v, Path):
        return str(v)
    if isinstance(v, Mapping):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    return v


def _labels(tracked, n: int) -> tuple[list[str], np.ndarray, int]:
    strings = getattr(tracked, "strings", None)
    ids = getattr(tracked, "type_ids", None)
    if isinstance(tracked, Mapping):
        strings = tracked.get("strings")
        ids = tracked.get("type_ids")
    if strings is None:
        strings = [f"t{i}" for i in range(n)]
    if ids is None:
        ids = np.full(n, -1, dtype=np.int64)
    return [str(s) for s in strings], np.asarray(ids, dtype=np.int64), n


def finalize(
    sums: Mapping[str, np.ndarray],
    tracked,
    meta: Mapping[str, Any] | None = None,
    dtype: Any = np.float32,
    min_count: int = DEFAULT_MIN_COUNT,
) -> xr.Dataset:
    """Turn merged sums (:func:`~mfpipe.stats.partials.merge_sums`) into the labelled dataset.

    ``meta``: provenance for the attributes — ``model``, ``revision``, ``half``, ``corpus_fingerprint``
    (and anything else JSON-able, e.g. ``model_type``, ``dtype``, ``corpus``). ``tracked_fingerprint``,
    ``n_tracked``, ``context_length``, ``n_tokens``, ``n_windows`` and ``mfpipe_version`` are filled in.
    Large means are stored as ``dtype`` (float32); ``nbar`` stays float64. The whole dataset is in memory
    (``P`` is ``L H N K`` of ``dtype``); :func:`write_stats` writes the same store holding one layer of P at a time.
    """
    return _finalize(sums, tracked, meta, dtype, min_count, kernel=True)


KERNEL_DIMS = ("layer", "head", "query", "key")
KERNEL_DESCRIPTION = "mean attention of type-s queries on key bucket t (eq:P)"


def _kernel_mean(sums: Mapping[str, Any], l: int) -> np.ndarray:
    """Layer ``l`` of P (float64): the kernel sum of layer ``l`` over the query counts; NaN for unseen types."""
    N = np.shape(sums["P_sum"])[2]
    return _mean(np.asarray(sums["P_sum"][l], dtype=np.float64), np.asarray(sums["query_count"]), (1, N, 1))


def _finalize(sums, tracked, meta, dtype, min_count, kernel: bool) -> xr.Dataset:
    missing = [k for k in SUM_KEYS if k not in sums]
    if missing:
        raise StatsError(f"finalize: sums lack {missing}")
    _, _, n, bos = bucket_luts(tracked)
    L, H, N, K = np.shape(sums["P_sum"])
    if N != n:
        raise StatsError(f"finalize: sums are for N={N} tracked types, the tracked set has N={n}")
    d = sums["resid_sum"].shape[-1]
    dh = sums["value_sum"].shape[-1]
    T = sums["position_count"].shape[0]
    qc = np.asarray(sums["query_count"], dtype=np.int64)
    kc = np.asarray(sums["key_count"], dtype=np.int64)
    strings, ids, _ = _labels(tracked, n)
    key_str = strings + ["<bos>", "<other>"]
    key_ids = np.concatenate([ids, [-1 if bos is None else bos, -1]]).astype(np.int64)

    data_vars = _mean_vars(sums, qc, kc, np.dtype(dtype), kernel)
    coords = {
        "layer": np.arange(L),
        "depth": np.arange(L + 1),
        "head": np.arange(H),
        "query": np.arange(N),
        "key": np.arange(K),
        "dim": np.arange(d),
        "head_dim": np.arange(dh),
        "position": np.arange(T),
        "query_str": ("query", np.asarray(strings, dtype=object)),
        "query_token_id": ("query", ids),
        "key_str": ("key", np.asarray(key_str, dtype=object)),
        "key_token_id": ("key", key_ids),
        # each layer's kind: "attention", or a hybrid's other mixer ("mamba", ...), whose P, mu, zbar, ln_in and
        # branch means are NaN (the centroid entering it is measured)
        "layer_kind": ("layer", np.asarray(list((meta or {}).get("layer_kinds") or ["attention"] * L), dtype=object)),
    }
    attrs = _store_attrs(sums, tracked, meta, min_count, bos)
    attrs.pop("layer_kinds", None)  # the `layer_kind` coordinate records them (the same store from the notebook API)
    ds = xr.Dataset(data_vars, coords=coords, attrs=attrs)
    if kernel:
        ds["P"].attrs["description"] = KERNEL_DESCRIPTION
    ds["centroid"].attrs["description"] = "mean residual entering block `depth` (depth L: final, before the last norm)"
    return ds


def _mean_vars(sums, qc: np.ndarray, kc: np.ndarray, f: np.dtype, kernel: bool) -> dict:
    """The store's variables (module docstring) from the sums and the query / key counts ``qc`` / ``kc``: the
    means as ``f`` (``nbar`` float64), the counts int64; ``P`` only where ``kernel``."""
    L, H, N, K = np.shape(sums["P_sum"])
    if kernel:
        P = np.empty((L, H, N, K), dtype=f)
        for l in range(L):  # layer by layer: the float64 kernel sums can be > 1 GB
            P[l] = _kernel_mean(sums, l)
    nbar = _mean(sums["nbar_sum"], qc, (N, 1))
    centroid = _mean(sums["resid_sum"], kc, (1, K, 1))
    ex2 = _mean(sums["resid_sq_sum"], kc, (1, K, 1))
    with np.errstate(invalid="ignore"):
        resid_var = np.maximum(ex2 - centroid * centroid, 0.0, where=~np.isnan(ex2), out=np.full_like(ex2, np.nan))
    mu = _mean(sums["value_sum"], kc, (1, 1, K, 1))
    zbar = _mean(sums["read_sum"], kc, (1, 1, K, 1))
    attn_out = _mean(sums["attn_out_sum"], kc, (1, K, 1))
    resid_mid = _mean(sums["resid_mid_sum"], kc, (1, K, 1))
    mlp_out = _mean(sums["mlp_out_sum"], kc, (1, K, 1))
    ln_in = _mean(sums["ln_in_sum"], kc, (1, K, 1))
    return {
        **({"P": (KERNEL_DIMS, P)} if kernel else {}),
        "nbar": (("query", "key"), nbar),
        "context_count": (("query", "key"), np.asarray(sums["context_count"], dtype=np.int64)),
        "cooc": (("query", "key"), np.asarray(sums["cooc"], dtype=np.int64)),
        "query_count": (("query",), qc),
        "key_count": (("key",), kc),
        "position_count": (("position",), np.asarray(sums["position_count"], dtype=np.int64)),
        "centroid": (("depth", "key", "dim"), centroid.astype(f)),
        "resid_var": (("depth", "key", "dim"), resid_var.astype(f)),
        "mu": (("layer", "head", "key", "head_dim"), mu.astype(f)),
        "zbar": (("layer", "head", "key", "head_dim"), zbar.astype(f)),
        "attn_out_mean": (("layer", "key", "dim"), attn_out.astype(f)),
        "resid_mid_mean": (("layer", "key", "dim"), resid_mid.astype(f)),
        "mlp_out_mean": (("layer", "key", "dim"), mlp_out.astype(f)),
        "ln_in_mean": (("layer", "key", "dim"), ln_in.astype(f)),
    }


def _store_attrs(sums, tracked, meta, min_count, bos) -> dict:
    """The store's attributes: ``meta`` (JSON-able) and the provenance filled in (:func:`finalize`), None left out."""
    L, H, N, _ = np.shape(sums["P_sum"])
    d = sums["resid_sum"].shape[-1]
    dh = sums["value_sum"].shape[-1]
    T = sums["position_count"].shape[0]
    attrs = {k: _jsonable(v) for k, v in dict(meta or {}).items()}
    attrs.update(
        {
            "store_format": STORE_FORMAT,
            "tracked_fingerprint": getattr(tracked, "fingerprint", None) if not isinstance(tracked, Mapping) else tracked.get("fingerprint"),
            "n_tracked": int(N),
            "context_length": int(T),
            "n_tokens": int(sums["n_tokens"]),
            "n_windows": int(sums["n_windows"]),
            "n_layers": int(L),
            "n_heads": int(H),
            "d_model": int(d),
            "d_head": int(dh),
            "bos_id": None if bos is None else int(bos),
            "min_count": int(min_count),
            "cooc_window": int(attrs.get("cooc_window", COOC_WINDOW)),
            "mfpipe_version": code_version(),
        }
    )
    return {k: v for k, v in attrs.items() if v is not None}


def _encoding(ds: xr.Dataset) -> dict:
    enc = {}
    for name, var in ds.data_vars.items():
        chunks = tuple(1 if dim in ("layer", "depth") else size for dim, size in zip(var.dims, var.shape))
        e: dict[str, Any] = {"chunks": chunks}
        if np.issubdtype(var.dtype, np.floating):
            e["_FillValue"] = np.nan
        enc[name] = e
    return enc


def _record_numerics(ds: xr.Dataset) -> None:
    """Give ``ds`` the attribute ``numerics`` (:func:`mfpipe.workflow.numerics.numerics_info`) of this process, where
    it does not carry one: a store computed here (a merge carries its parts' numerics instead)."""
    if "numerics" not in ds.attrs:
        from mfpipe.workflow.numerics import numerics_info

        ds.attrs["numerics"] = numerics_info()


def write_store(ds: xr.Dataset, path: str | Path) -> Path:
    """Write ``ds`` as a zarr (v3) store at ``path``, atomically: everything goes to a temporary sibling
    folder which is renamed into place only once complete, so an interrupted write leaves no store (only a
    hidden ``.<name>.tmp-*`` folder that the next write ignores). One layer per chunk. The attribute ``numerics``
    (:func:`mfpipe.workflow.numerics.numerics_info`) is this process's where ``ds`` does not carry it."""
    from mfpipe.workflow.io import atomic_dir

    path = Path(path)
    _record_numerics(ds)
    with atomic_dir(path) as tmp, warnings.catch_warnings():
        # consolidated metadata lets a plain `xr.open_zarr(path)` open the store quietly and in one read;
        # zarr 3 warns that it is an extension of the v3 format (readers without it still open the store)
        warnings.filterwarnings("ignore", message="Consolidated metadata is currently not part")
        ds.to_zarr(tmp, mode="w", encoding=_encoding(ds), zarr_format=3, consolidated=True)
    return path


def write_stats(sums: Mapping[str, Any], tracked, meta: Mapping[str, Any] | None, path: str | Path,
                dtype: Any = np.float32, min_count: int = DEFAULT_MIN_COUNT) -> xr.Dataset:
    """``write_store(finalize(sums, tracked, meta), path)`` -- the same store -- holding one layer of ``P`` at a
    time: ``sums["P_sum"]`` may be any ``[L, H, N, K]`` array-like whose ``[l]`` gives one layer (a
    :class:`~mfpipe.stats.layered.LayerSum` of partials left on disk), and is read, divided and written one
    layer at a time. Memory: one layer of P in float64 plus the per-position means, at N = 4000 for GPT-2 small
    ~2 GB instead of 18 GB of merged kernel sums and 9 GB of P. Atomic like :func:`write_store`. Returns the
    dataset without ``P`` (what was written besides it)."""
    import shutil

    import zarr

    from mfpipe.workflow.io import atomic_dir

    path = Path(path)
    ds = _finalize(sums, tracked, meta, dtype, min_count, kernel=False)
    _record_numerics(ds)
    L, H, N, K = np.shape(sums["P_sum"])
    f = np.dtype(dtype)
    with atomic_dir(path) as tmp, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Consolidated metadata is currently not part")
        ds.to_zarr(tmp, mode="w", encoding=_encoding(ds), zarr_format=3, consolidated=False)
        # P's metadata exactly as xarray encodes it (attributes, fill value, codecs), from a one-layer template with
        # the store's coordinates (no chunk is written: it is all fill value), then given all L layers
        one = xr.Dataset({"P": (KERNEL_DIMS, np.broadcast_to(np.asarray(np.nan, dtype=f), (1, H, N, K)),
                                {"description": KERNEL_DESCRIPTION})},
                         coords={**{c: ds.coords[c] for c in ("query_str", "query_token_id", "key_str", "key_token_id")},
                                 "layer_kind": ("layer", ds.coords["layer_kind"].values[:1])})
        scratch = tmp / ".P-template"
        one.to_zarr(scratch, mode="w", encoding=_encoding(one), zarr_format=3, consolidated=False)
        meta_json = json.loads((scratch / "P" / "zarr.json").read_text())
        meta_json["shape"][0] = L
        (tmp / "P").mkdir()
        (tmp / "P" / "zarr.json").write_text(json.dumps(meta_json, indent=2))
        shutil.rmtree(scratch)
        arr = zarr.open_array(str(tmp / "P"), mode="r+")
        for l in range(L):
            arr[l] = _kernel_mean(sums, l).astype(f)
        zarr.consolidate_metadata(str(tmp))
    return ds


def open_zarr(path: str | Path, what: str, remedy: str) -> xr.Dataset:
    """A Zarr (v3) store written by mfpipe, opened lazily: ``FileNotFoundError`` naming ``what`` and ``remedy``
    when it is absent or incomplete (no ``zarr.json``: an interrupted write never publishes one)."""
    path = Path(path)
    if not (path / "zarr.json").is_file():
        raise FileNotFoundError(f"{what} {path} does not exist or is incomplete; {remedy}")
    with warnings.catch_warnings():
        # Snakemake drops a `.snakemake_timestamp` file into directory outputs; zarr warns about it
        warnings.filterwarnings("ignore", message=".*not recognized as a component of a Zarr hierarchy")
        return xr.open_zarr(path, chunks=None, consolidated=False, zarr_format=3)


def read_attrs(path: str | Path) -> dict:
    """The store's attributes without opening it with xarray."""
    meta = Path(path) / "zarr.json"
    try:
        return dict(json.loads(meta.read_text()).get("attributes", {}))
    except FileNotFoundError:
        raise FileNotFoundError(f"statistics store {path} does not exist (no zarr.json); run the stats stage") from None
