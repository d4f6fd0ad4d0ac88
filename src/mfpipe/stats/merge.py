"""A statistics half merged: the per-shard partials of one (model, revision, half) (:mod:`mfpipe.stats.partials`),
each checked against its corpus shard and the store it goes into, merged into the labelled, layer-chunked Zarr
store (:func:`mfpipe.stats.store.write_stats`) with provenance attributes. The kernel sums stay on disk and are merged
and written one layer of P at a time, so the merge's memory does not grow with L H N K. The ``stats_merge`` job
(:mod:`mfpipe.stats.jobs`) runs :func:`merge_half`.

A partial that is not what its shard's job wrote is deleted, not merged (:func:`refuse_partial`): it is an
intermediate, and deleting it is what makes the rerun rebuild it."""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from mfpipe.corpus.windows import read_shard
from mfpipe.stats.errors import PartialError, StatsError
from mfpipe.stats.partials import check_partial, merge_sums, open_partial, tokens_fingerprint
from mfpipe.stats.store import write_stats

__all__ = ["refuse_partial", "half_partials", "checked_sums", "merged_meta", "merge_half"]

# what the first partial fixes for every later one: the model's type, shape and dtype
MODEL_KEYS = ("model_type", "n_layers", "n_heads", "d_model", "d_head", "dtype", "layer_kinds")


def refuse_partial(p: str, why: str) -> StatsError:
    """A partial that is not what its shard's job wrote is deleted, not merged: it is an intermediate, and
    deleting it is what makes the rerun rebuild it (Snakemake reruns the stats_shard job of a missing output:
    the folder of the job's run of shards, which goes with it)."""
    path = Path(p)
    if path.parent.name.startswith("group-"):
        path = path.parent
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
    gone = "it" if str(path) == str(p) else f"it with its job's folder {path}"
    return StatsError(f"statistics partial {p} {why}; deleted {gone}: rerun to rebuild it")


def half_partials(group_dirs: Iterable[str], shards: str | Path, half: str, model: str, revision: str) -> list[str]:
    """The partials of the half, one per corpus shard of ``shards/half``, each in the folder of the statistics job
    whose run of shards holds it: a job's folder (of ``group_dirs``) is named by its first shard and runs to the
    next job's (stats.shards_per_job). A missing partial is refused (:func:`refuse_partial`)."""
    want = sorted(p.stem for p in (Path(shards) / half).glob("shard-*.npz"))
    if not want:
        raise StatsError(f"no partials for {model} @ {revision} ({half}); the {half} half has no shards")
    groups = sorted(map(str, group_dirs), key=lambda g: Path(g).name)
    starts = [Path(g).name.replace("group-", "shard-") for g in groups]
    partials = []
    for k, g in enumerate(groups):
        mine = [s for s in want if s >= starts[k] and (k + 1 == len(groups) or s < starts[k + 1])]
        if not mine or mine[0] != starts[k]:
            raise StatsError(f"statistics job folder {g} does not start at a corpus shard of {Path(shards) / half}; "
                             "rerun (the corpus changed after the statistics ran)")
        for s in mine:
            part = str(Path(g) / f"{s}.zarr")
            if not Path(part).exists():
                raise refuse_partial(part, "is missing")
            partials.append(part)
    if want[0] != starts[0]:
        raise StatsError(f"no statistics job folder holds corpus shard {want[0]} of {Path(shards) / half}; rerun")
    return partials


def checked_sums(partials: list[str], shards: str | Path, half: str, expect: dict, seen: dict,
                 log: logging.Logger) -> Iterator[dict]:
    """Open one partial at a time (its kernel sum stays on disk) and check it belongs to this store: readable
    (every chunk present, each chunk's CRC-32C catches truncation and altered bytes), computed from this store's
    model, revision, tracked set and context length (``expect``: the values of those meta keys), from exactly the
    corpus shard of its name (the tokens' fingerprint), and of its shape. ``seen`` collects, as the partials go
    by, the first partial's meta (``first_meta``) and array shapes (``shapes``: every later one must have them)
    and the partials' mantissa_bits (``bits``, where rounded: stats.partial_mantissa_bits)."""
    first_meta, shapes, bits_seen = seen["first_meta"], seen["shapes"], seen["bits"]
    for p in partials:
        try:
            sums, meta = open_partial(p)
        except StatsError as e:
            raise refuse_partial(p, e.why if isinstance(e, PartialError)
                                 else f"is unreadable ({e.__cause__ or e})") from None
        for key, want in expect.items():
            if key in meta and meta[key] != want:
                raise refuse_partial(p, f"was computed for {key}={meta[key]!r}, this store needs {want!r}")
        shard = Path(shards) / half / (Path(p).stem + ".npz")  # partial shard-NNNNN.zarr <- corpus shard-NNNNN.npz
        tokens = read_shard(shard).tokens
        if meta.get("shard_fingerprint") != tokens_fingerprint(tokens):
            raise refuse_partial(p, f"was not computed from corpus shard {shard} (its shard_fingerprint differs)")
        try:  # shapes (the first partial's for every later one), window count, the model's shape as the first's
            check_partial(p, sums, dict(meta, n_windows=tokens.shape[0]), shapes=shapes or None, expect={
                k: first_meta[k] for k in MODEL_KEYS if k in first_meta})
        except StatsError as e:
            raise refuse_partial(p, "has the wrong shape or model for its shard or differs from the other partials "
                                    f"({e})") from None
        if not first_meta:
            first_meta.update(meta)
            shapes.update({k: tuple(v.shape) for k, v in sums.items()})
        if meta.get("mantissa_bits") is not None:
            bits_seen.append(int(meta["mantissa_bits"]))
        log.info("checked %s (%d windows)", p, int(sums["n_windows"]))
        yield sums


def merged_meta(info: dict, model: str, revision: str, half: str, model_source: str, commit: Any, n_shards: int,
                seen: dict) -> dict:
    """The store's provenance attributes: the model, revision and half, the corpus (``info``: its
    fingerprint.json) and, from the partials (``seen`` of :func:`checked_sums`), the model's type and dtype, the
    numerics the first partial ran under and the coarsest rounding of any partial."""
    meta = {
        "model": model,
        "revision": revision,
        "half": half,
        "model_source": model_source,
        "corpus": info.get("corpus"),
        "corpus_fingerprint": info["fingerprint"],
        "half_fingerprint": info.get("halves", {}).get(half, {}).get("fingerprint"),
        "tokenizer": info.get("tokenizer"),
        "n_shards": n_shards,
    }
    # hub models: the commits the revision and the tokenizer's revision stood for (branches move; commits do not)
    meta.update({k: v for k, v in (("revision_commit", commit), ("tokenizer_revision", info.get("tokenizer_revision")),
                                   ("tokenizer_commit", info.get("tokenizer_commit"))) if v})
    for k in ("model_type", "dtype", "n_kv_heads", "parallel_residual", "numerics", "layer_kinds", "layer_head_dims"):
        if k in seen["first_meta"]:
            meta[k] = seen["first_meta"][k]
    if seen["bits"]:  # the coarsest rounding of any partial bounds the merged sums (mfpipe.stats.partials)
        meta["partial_mantissa_bits"] = min(seen["bits"])
    return meta


def merge_half(group_dirs: Iterable[str], shards: str | Path, tracked, info: dict, path: str | Path, *, model: str,
               revision: str, half: str, model_source: str, commit: Any = None,
               log: logging.Logger | None = None):
    """Merge the partials of one (model, revision, half) into the statistics store at ``path`` (written
    atomically): ``group_dirs`` the statistics jobs' folders, ``shards`` the corpus's shards folder (``info``: its
    fingerprint.json), ``tracked`` the store's tracked set, ``commit`` the commit a hub revision resolved to (None
    otherwise). Returns ``(store, partials)``."""
    log = log or logging.getLogger("mfpipe")
    partials = half_partials(group_dirs, shards, half, model, revision)
    expect = {"tracked_fingerprint": tracked.fingerprint, "n_tracked": tracked.n, "model": model,
              "revision": revision, "context_length": int(info["context_length"])}
    if commit:  # a hub revision: the commit it resolved to when the run was planned (a branch moves)
        expect["revision_commit"] = commit
    seen: dict = {"first_meta": {}, "shapes": {}, "bits": []}
    sums = merge_sums(checked_sums(partials, shards, half, expect, seen, log), names=partials)
    meta = merged_meta(info, model, revision, half, model_source, commit, len(partials), seen)
    try:  # P one layer at a time: a chunk that fails its checksum now is still the partial's fault
        ds = write_stats(sums, tracked, meta, path)
    except PartialError as e:
        raise refuse_partial(e.path, e.why) from None
    return ds, partials
