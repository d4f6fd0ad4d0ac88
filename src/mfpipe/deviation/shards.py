"""Pass 2 end to end (paper Sec. 6, App. P): one shard's deviation sums from pass 1's statistics store, the partials'
merge, and the labelled deviation store ``results/deviation/<model>/<revision>/deviation.zarr``.

The reducer and what it sums are in :mod:`mfpipe.deviation.pass2`, the per-context math in :mod:`mfpipe.meanfield.deviation`.
A partial is an xarray Zarr store (atomic, like every mfpipe output) of those sums plus the layer grams; partials of
one (model, revision) merge by addition (the top-deviation lists by a top-K over their union), so any split of the
half into shards gives the same store. The store holds, per head, the occurrence means D, M_cov, M_ctx
(eq:head-meters) and the corpus deviation S̄ (eq:ddec) of both halves together and of each half (split-half
stability), per query type the same terms and S_s, the means z̄_s, E_s[ẑ], Σ_{t<N} P_st E_s[v̄_t], the top-deviation
contexts, and provenance (model, revision, tracked set, corpus, pass-1 store, N, code version).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from mfpipe.version import __version__
from mfpipe.workflow.numerics import numerics_info
from mfpipe.deviation.pass2 import ADDITIVE, OTHER_SHARE_MAX, TOP_K
from mfpipe.meanfield.deviation import MIN_OCCURRENCES, corpus_deviation
from mfpipe.deviation.store import open_deviation, stats_fingerprint
from mfpipe.stats.api import ProvenanceError
from mfpipe.stats.errors import StatsError

__all__ = ["deviation_shard", "save_partial", "open_partial", "merge_partials", "deviation_dataset", "open_deviation",
           "MATCH_KEYS"]

DIMS = {
    "n_windows": (), "n_tokens": (), "count": ("half", "layer", "query"),
    "D_sum": ("half", "layer", "head", "query"), "M_cov_sum": ("half", "layer", "head", "query"),
    "M_ctx_sum": ("half", "layer", "head", "query"),
    "z_sum": ("half", "layer", "head", "query", "head_dim"), "zhat_sum": ("half", "layer", "head", "query", "head_dim"),
    "vbar_tracked_sum": ("layer", "head", "query", "head_dim"), "degenerate": ("layer", "head"),
    "top_D": ("layer", "head", "rank"), "top_window": ("layer", "head", "rank"),
    "top_position": ("layer", "head", "rank"), "top_shard": ("layer", "head", "rank"),
    "gram": ("layer", "head", "head_dim", "head_dim2"),
}
# what every partial of one merge must agree on
MATCH_KEYS = ("model", "revision", "tracked_fingerprint", "n_tracked", "context_length", "stats_fingerprint",
              "min_count", "kernel", "top_k", "other_share_max", "n_layers", "n_heads", "d_head")


def deviation_shard(model, adapter, tokens: np.ndarray, doc_ids: np.ndarray, tracked, stats, *, min_count=None,
                    calibrated=None, batch_size: int = 8, top_k: int = TOP_K, other_share_max: float = OTHER_SHARE_MAX,
                    progress: bool = True, desc: str = "deviation") -> tuple[dict, dict]:
    """Pass 2 over one shard's windows ``tokens``/``doc_ids [n, T]`` with the kernel and μ of ``stats`` (pass 1's
    store of the same half, :class:`~mfpipe.stats.api.MeanFieldStats`) -> (sums incl. ``gram``, meta). ``calibrated``:
    the calibrated kernel U of App. B instead of W (as the substitution: ``substitution.kernel``)."""
    import torch

    from mfpipe.deviation.pass2 import DeviationAccumulator, window_halves
    from mfpipe.meanfield.deviation import layer_grams
    from mfpipe.meanfield.kernel import kernel_from_store
    from mfpipe.models.adapters.gate import has_gate
    from mfpipe.stats.loop import run_reducer

    kernel = kernel_from_store(stats, tracked, min_count=min_count, calibrated=calibrated).to(adapter.device)
    if kernel.W.shape[:2] != (adapter.n_layers, adapter.n_heads):
        raise ProvenanceError(f"statistics store {stats.path} has (layers, heads) = {tuple(kernel.W.shape[:2])}, the "
                              f"model ({adapter.n_layers}, {adapter.n_heads}): it belongs to another model")
    grams = layer_grams(adapter)
    halves = window_halves(doc_ids)

    def reducer(ad, n, T, device):
        # a gated attention's meters are its gated reads' (meanfield.deviation.gate_head_major): the query's own gate
        gate = adapter.read_gate if has_gate(adapter) else None
        return DeviationAccumulator(kernel.W, kernel.mu, grams, n, T, halves, device, top_k, other_share_max,
                                    gate=gate)

    with torch.no_grad():
        sums = run_reducer(model, adapter, tokens, tracked, reducer, batch_size=batch_size, device=adapter.device,
                           progress=progress, desc=desc)
    sums["gram"] = grams.cpu().numpy()
    a = kernel.attrs
    meta = {"model": a.get("model"), "revision": a.get("revision"), "revision_commit": a.get("revision_commit"),
            "tracked_fingerprint": tracked.fingerprint,
            "n_tracked": int(tracked.n), "context_length": int(tokens.shape[1]), "n_windows": int(tokens.shape[0]),
            "corpus_fingerprint": a.get("corpus_fingerprint"), "stats_fingerprint": stats_fingerprint(stats),
            "stats_tokens": a.get("n_tokens"), "min_count": a.get("min_count"), "kernel": a.get("kernel"),
            "top_k": int(top_k), "other_share_max": float(other_share_max), "n_layers": adapter.n_layers,
            "n_heads": adapter.n_heads, "d_head": adapter.d_head, "model_type": adapter.model_type,
            "layer_kinds": list(getattr(adapter, "layer_kinds", None) or ["attention"] * adapter.n_layers),
            "mfpipe_version": __version__, "numerics": numerics_info()}
    return sums, meta


def _dataset(sums: Mapping[str, Any], meta: Mapping[str, Any]):
    import xarray as xr

    data = {k: (DIMS[k], np.asarray(v)) for k, v in sums.items() if k in DIMS}
    ds = xr.Dataset(data)
    ds.attrs["meta"] = {k: (v.item() if isinstance(v, np.generic) else v) for k, v in meta.items()}
    ds.attrs["pass2_format"] = 1
    return ds


def save_partial(path, sums: Mapping[str, Any], meta: Mapping[str, Any]) -> Path:
    """One shard's pass-2 sums as a Zarr store, written atomically (:func:`mfpipe.stats.store.write_store`)."""
    from mfpipe.stats.store import write_store

    return write_store(_dataset(sums, meta), path)


def open_partial(path) -> tuple[dict, dict]:
    """(sums, meta) of a pass-2 partial; a missing, incomplete or foreign-format one is refused by name."""
    from mfpipe.stats.store import open_zarr

    try:
        ds = open_zarr(path, "deviation partial", "rerun its deviation_shard job").load()
    except FileNotFoundError:
        raise
    except Exception as e:  # damaged chunks / metadata
        raise StatsError(f"deviation partial {path} is unreadable ({e}); delete it and rerun its deviation_shard job") from e
    if ds.attrs.get("pass2_format") != 1 or "meta" not in ds.attrs:
        raise StatsError(f"deviation partial {path} is not a pass-2 partial of this mfpipe; delete it and rerun its "
                         "deviation_shard job")
    missing = [k for k in DIMS if k not in ds and k != "top_shard"]
    if missing:
        raise StatsError(f"deviation partial {path} lacks {missing}; delete it and rerun its deviation_shard job")
    return {k: ds[k].values for k in ds.data_vars}, dict(ds.attrs["meta"])


def open_job_partials(folders: Sequence[str | Path], groups: Mapping[str, Sequence[str]]) -> tuple[list, list[str]]:
    """(parts, names) of a (model, revision)'s pass-2 partials in shard order, for :func:`merge_partials`.

    Each pass-2 job writes one partial per corpus shard of its run into its folder ``group-<first shard id>``;
    ``groups`` is ``{first shard id: [shard ids]}`` in shard order (``deviation.shards_per_job``). A partial that is
    missing, unreadable or computed from another shard is not merged: it is deleted with its job's folder (so that a
    rerun runs that job again) and refused by name."""
    import re
    import shutil

    by_first = {Path(f).name.removeprefix("group-"): Path(f) for f in folders}
    parts, names = [], []
    for first, ids in groups.items():
        folder = by_first.get(str(first))
        if folder is None:
            raise StatsError(f"no pass-2 job folder holds the run of shards from shard-{first}: rerun")
        for i in ids:
            path = folder / f"shard-{i}.zarr"
            try:
                if not path.exists():
                    raise StatsError(f"deviation partial {path} is missing")
                sums, meta = open_partial(path)
                if meta.get("shard") not in (None, f"shard-{i}.npz"):
                    raise StatsError(f"deviation partial {path} was computed from corpus shard {meta.get('shard')}, "
                                     f"not shard-{i}.npz")
            except (StatsError, FileNotFoundError) as e:
                shutil.rmtree(folder, ignore_errors=True)
                why = re.split(r"; (?:delete it|rerun)", str(e))[0]  # the remedy is this one now
                raise StatsError(f"{why}; deleted it with its job's folder {folder}: rerun to rebuild it") from e
            parts.append((sums, meta))
            names.append(str(path))
    return parts, names


def merge_partials(parts: Sequence[tuple[dict, dict]], names: Sequence[str] | None = None,
                   expect: Mapping[str, Any] | None = None) -> tuple[dict, dict]:
    """Sum the additive sums of shards' partials; the top-deviation lists become the top-K of their union (with
    ``top_shard`` = the partial's index). Partials that disagree on :data:`MATCH_KEYS` (or ``expect``) are refused."""
    names = list(names) if names is not None else [f"#{i}" for i in range(len(parts))]
    if not parts:
        raise StatsError("no deviation partials to merge")
    first_meta = parts[0][1]
    want = {k: first_meta.get(k) for k in MATCH_KEYS}
    want.update(dict(expect or {}))
    out: dict[str, np.ndarray] = {}
    tops = []
    for i, ((sums, meta), name) in enumerate(zip(parts, names)):
        for k, v in want.items():
            if v is not None and meta.get(k) is not None and str(meta.get(k)) != str(v):
                raise ProvenanceError(f"deviation partial {name} was computed for {k}={meta.get(k)!r}, this merge needs "
                                      f"{v!r}; delete it and rerun its deviation_shard job")
        for k in ADDITIVE:
            x = np.asarray(sums[k])
            if k in out and out[k].shape != x.shape:
                raise StatsError(f"deviation partial {name}: {k} has shape {x.shape}, expected {out[k].shape}")
            out[k] = x.astype(np.float64 if x.dtype.kind == "f" else np.int64) + (out[k] if k in out else 0)
        if "gram" not in out:
            out["gram"] = np.asarray(sums["gram"])
        elif not np.allclose(out["gram"], sums["gram"], rtol=1e-6, atol=0, equal_nan=True):  # NaN: a hybrid's others
            raise ProvenanceError(f"deviation partial {name} was computed with other output-projection weights")
        shard = np.asarray(sums["top_shard"]) if "top_shard" in sums else np.full_like(sums["top_window"], i)
        tops.append((np.asarray(sums["top_D"]), np.asarray(sums["top_window"]), np.asarray(sums["top_position"]),
                     np.where(np.asarray(sums["top_window"]) >= 0, shard, -1)))
    D, w, p, s = (np.concatenate(x, axis=-1) for x in zip(*tops))
    k = tops[0][0].shape[-1]
    order = np.argsort(-D, axis=-1, kind="stable")[..., :k]
    for key, x in (("top_D", D), ("top_window", w), ("top_position", p), ("top_shard", s)):
        out[key] = np.take_along_axis(x, order, axis=-1)
    meta = {k: v for k, v in first_meta.items() if k not in ("n_windows",)}
    meta["n_windows"] = int(out["n_windows"])
    meta["n_partials"] = len(parts)
    return out, meta


def _mean(total, count):
    count = np.asarray(count, dtype=np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(count > 0, total / np.where(count > 0, count, 1.0), np.nan)


def deviation_dataset(sums: Mapping[str, Any], meta: Mapping[str, Any], tracked, min_occurrences: int = MIN_OCCURRENCES):
    """The labelled deviation store of merged pass-2 sums (see the module docstring). Coordinates: ``layer``,
    ``head``, ``query`` (0..N-1) with ``query_str`` / ``query_token_id``, ``half`` (0, 1)."""
    import xarray as xr

    count = np.asarray(sums["count"])  # [2, L, N]
    L, H, N, dh = np.shape(sums["vbar_tracked_sum"])
    c_lhn = np.broadcast_to(count.sum(0)[:, None, :], (L, H, N))
    c_half = np.broadcast_to(count[:, :, None, :], (2, L, H, N))
    tot = {k: np.asarray(sums[k]).sum(0) for k in ("D_sum", "M_cov_sum", "M_ctx_sum", "z_sum", "zhat_sum")}
    n_head = c_lhn.sum(-1)  # occurrences per (layer, head)
    zbar = _mean(tot["z_sum"], c_lhn[..., None])
    zhat_bar = _mean(tot["zhat_sum"], c_lhn[..., None])
    gram = np.asarray(sums["gram"])
    S, S_bar = corpus_deviation(zbar, zhat_bar, c_lhn, gram, min_occurrences)
    S_half = []
    for i in range(2):
        zb = _mean(np.asarray(sums["z_sum"])[i], c_half[i][..., None])
        zh = _mean(np.asarray(sums["zhat_sum"])[i], c_half[i][..., None])
        S_half.append(corpus_deviation(zb, zh, c_half[i], gram, min_occurrences)[1])
    qdims, hdims = ("layer", "head", "query"), ("layer", "head")
    data = {
        "S_bar": (hdims, S_bar, {"description": "eq:ddec corpus deviation: mean over query types (>= min_occurrences) "
                                               "of 1 - centred cos(zbar_s, E_s[zhat]) in residual-stream units"}),
        "D": (hdims, _mean(tot["D_sum"].sum(-1), n_head), {"description": "occurrence mean of D = 1 - cos(z, zhat)"}),
        "M_cov": (hdims, _mean(tot["M_cov_sum"].sum(-1), n_head), {"description": "eq:head-meters covariance meter"}),
        "M_ctx": (hdims, _mean(tot["M_ctx_sum"].sum(-1), n_head),
                  {"description": "eq:head-meters contextualization meter"}),
        "S_bar_half": (("half",) + hdims, np.stack(S_half), {"description": "S_bar of each document-interleaved half"}),
        "S": (qdims, S, {"description": "per-type deviation S_s (eq:ddec); NaN below min_occurrences"}),
        "D_type": (qdims, _mean(tot["D_sum"], c_lhn)), "M_cov_type": (qdims, _mean(tot["M_cov_sum"], c_lhn)),
        "M_ctx_type": (qdims, _mean(tot["M_ctx_sum"], c_lhn)),
        "count": (("half", "layer", "query"), count),
        "zbar": (qdims + ("head_dim",), zbar), "zhat_bar": (qdims + ("head_dim",), zhat_bar),
        "vbar_tracked": (qdims + ("head_dim",), _mean(np.asarray(sums["vbar_tracked_sum"]), c_lhn[..., None]),
                         {"description": "sum_{t<N} P_st E_s[vbar_t] over the tracked key types (head space; W's "
                                         "C >= min_count support): estimator (b) of Sec. 4.3"}),
        "degenerate": (hdims, np.asarray(sums["degenerate"])),
        "gram": (("layer", "head", "head_dim", "head_dim2"), gram),
    }
    top_shard = sums.get("top_shard", np.where(np.asarray(sums["top_window"]) >= 0, 0, -1))  # one shard: shard 0
    for k, x in (("top_D", sums["top_D"]), ("top_window", sums["top_window"]), ("top_position", sums["top_position"]),
                 ("top_shard", top_shard)):
        data[k] = (("layer", "head", "rank"), np.asarray(x))
    # as the statistics store's (stats.store): variable-length UTF-8, Zarr v3's `string`; numpy's fixed-width unicode
    # would be written as `fixed_length_utf32`, a data type with no Zarr v3 specification (other readers may refuse it)
    labels = np.asarray(list(getattr(tracked, "strings", [str(i) for i in range(N)]))[:N], dtype=object)
    ids = np.asarray(getattr(tracked, "type_ids", np.arange(N)))[:N]
    ds = xr.Dataset(data, coords={"layer": np.arange(L), "head": np.arange(H), "query": np.arange(N),
                                  "query_str": ("query", labels), "query_token_id": ("query", ids),
                                  "half": [0, 1], "layer_kind": ("layer", np.asarray(
                                      meta.get("layer_kinds") or ["attention"] * L, dtype=object))})
    attrs = {k: v for k, v in meta.items() if v is not None}
    # counted over one attention layer (each counts the same contexts): a hybrid's other layers count none
    kinds = list(meta.get("layer_kinds") or ["attention"] * L)
    first = next((l for l, k in enumerate(kinds) if k == "attention"), None)
    attrs.update({"min_occurrences": int(min_occurrences), "n_tokens_pass2": int(sums["n_tokens"]),
                  "n_contexts": int(count.sum(0)[first].sum()) if first is not None else 0,
                  "mfpipe_version": __version__,
                  "n_types_scored": int((count.sum(0)[first] >= int(min_occurrences)).sum()) if first is not None
                  else 0})
    ds.attrs.update(attrs)
    return ds
