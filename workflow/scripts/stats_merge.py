"""Snakemake script: merge the per-shard partials of one (model, revision, half) into the labelled,
layer-chunked zarr statistics store (written atomically), with provenance attributes. The kernel sums stay on
disk and are merged and written one layer of P at a time (mfpipe.stats.store.write_stats), so the merge's memory
does not grow with L H N K."""
import _mfpipe_checkout  # noqa: F401,I001 (first: this checkout's src/ on sys.path)
import json
import shutil
from pathlib import Path

from mfpipe.corpus.windows import read_shard
from mfpipe.workflow.runner import run_logged
from mfpipe.workflow.logs import setup_logging
from mfpipe.stats import StatsError, merge_sums
from mfpipe.stats.errors import PartialError
from mfpipe.stats.partials import check_partial, open_partial, tokens_fingerprint
from mfpipe.stats.store import write_stats
from mfpipe.corpus.tracked import TrackedSet

sm = snakemake  # noqa: F821 (injected by Snakemake)
log = setup_logging(sm.log[0])


def main() -> None:
    tracked = TrackedSet.load(sm.input.tracked)
    fp_path = getattr(sm.input, "fingerprint", None) or str(Path(sm.input.shards) / "fingerprint.json")
    info = json.loads(Path(fp_path).read_text())
    model, revision, half = str(sm.params.model), str(sm.params.revision), str(sm.params.half)
    commit = sm.params.commit
    first_meta: dict = {}
    shapes: dict = {}  # the first partial's array shapes: every later one must have them
    bits_seen: list[int] = []  # the partials' mantissa_bits (stats.partial_mantissa_bits), where rounded

    def refuse(p: str, why: str) -> StatsError:
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

    # one partial per corpus shard of the half, each in the folder of the statistics job whose run of shards holds
    # it: a job's folder is named by its first shard and runs to the next job's (stats.shards_per_job)
    want = sorted(p.stem for p in (Path(sm.input.shards) / half).glob("shard-*.npz"))
    if not want:
        raise StatsError(f"no partials for {model} @ {revision} ({half}); the {half} half has no shards")
    groups = sorted(map(str, sm.input.partials), key=lambda g: Path(g).name)
    starts = [Path(g).name.replace("group-", "shard-") for g in groups]
    partials = []
    for k, g in enumerate(groups):
        mine = [s for s in want if s >= starts[k] and (k + 1 == len(groups) or s < starts[k + 1])]
        if not mine or mine[0] != starts[k]:
            raise StatsError(f"statistics job folder {g} does not start at a corpus shard of {Path(sm.input.shards) / half}; "
                             "rerun (the corpus changed after the statistics ran)")
        for s in mine:
            part = str(Path(g) / f"{s}.zarr")
            if not Path(part).exists():
                raise refuse(part, "is missing")
            partials.append(part)
    if want[0] != starts[0]:
        raise StatsError(f"no statistics job folder holds corpus shard {want[0]} of {Path(sm.input.shards) / half}; rerun")

    def sums_iter():
        """Open one partial at a time (its kernel sum stays on disk) and check it belongs to this store: readable
        (every chunk present, each chunk's CRC-32C catches truncation and altered bytes), computed from this store's
        model, revision, tracked set and context length, from exactly the corpus shard of its name (the tokens'
        fingerprint), and of its shape."""
        expect = {"tracked_fingerprint": tracked.fingerprint, "n_tracked": tracked.n, "model": model,
                  "revision": revision, "context_length": int(info["context_length"])}
        if commit:  # a hub revision: the commit it resolved to when the run was planned (a branch moves)
            expect["revision_commit"] = commit
        for p in partials:
            try:
                sums, meta = open_partial(p)
            except StatsError as e:
                raise refuse(p, e.why if isinstance(e, PartialError) else f"is unreadable ({e.__cause__ or e})") from None
            for key, want in expect.items():
                if key in meta and meta[key] != want:
                    raise refuse(p, f"was computed for {key}={meta[key]!r}, this store needs {want!r}")
            shard = Path(sm.input.shards) / half / (Path(p).stem + ".npz")  # partial shard-NNNNN.zarr <- corpus shard-NNNNN.npz
            tokens = read_shard(shard).tokens
            if meta.get("shard_fingerprint") != tokens_fingerprint(tokens):
                raise refuse(p, f"was not computed from corpus shard {shard} (its shard_fingerprint differs)")
            try:  # shapes (the first partial's for every later one), window count, the model's shape as the first's
                check_partial(p, sums, dict(meta, n_windows=tokens.shape[0]), shapes=shapes or None, expect={
                    k: first_meta[k] for k in ("model_type", "n_layers", "n_heads", "d_model", "d_head", "dtype")
                    if k in first_meta})
            except StatsError as e:
                raise refuse(p, f"has the wrong shape or model for its shard or differs from the other partials ({e})") from None
            if not first_meta:
                first_meta.update(meta)
                shapes.update({k: tuple(v.shape) for k, v in sums.items()})
            if meta.get("mantissa_bits") is not None:
                bits_seen.append(int(meta["mantissa_bits"]))
            log.info("checked %s (%d windows)", p, int(sums["n_windows"]))
            yield sums

    sums = merge_sums(sums_iter(), names=partials)
    meta = {
        "model": model,
        "revision": revision,
        "half": half,
        "model_source": str(getattr(sm.params, "hub_id", "") or model),
        "corpus": info.get("corpus"),
        "corpus_fingerprint": info["fingerprint"],
        "half_fingerprint": info.get("halves", {}).get(half, {}).get("fingerprint"),
        "tokenizer": info.get("tokenizer"),
        "n_shards": len(partials),
    }
    # hub models: the commits the revision and the tokenizer's revision stood for (branches move; commits do not)
    meta.update({k: v for k, v in (("revision_commit", commit), ("tokenizer_revision", info.get("tokenizer_revision")),
                                   ("tokenizer_commit", info.get("tokenizer_commit"))) if v})
    for k in ("model_type", "dtype", "n_kv_heads", "parallel_residual"):
        if k in first_meta:
            meta[k] = first_meta[k]
    if bits_seen:  # the coarsest rounding of any partial bounds the merged sums (mfpipe.stats.partials)
        meta["partial_mantissa_bits"] = min(bits_seen)
    try:  # P one layer at a time: a chunk that fails its checksum now is still the partial's fault
        ds = write_stats(sums, tracked, meta, sm.output[0])
    except PartialError as e:
        raise refuse(e.path, e.why) from None
    log.info("wrote %s: N=%d, L=%d, H=%d, %d tokens in %d windows from %d shards",
             sm.output[0], tracked.n, ds.sizes["layer"], ds.sizes["head"], ds.attrs["n_tokens"], ds.attrs["n_windows"],
             len(partials))


run_logged(main, log)
