"""Snakemake script: merge the per-shard partials of one (model, revision, half) into the labelled,
layer-chunked zarr statistics store (written atomically), with provenance attributes."""
import _mfpipe_checkout  # noqa: F401,I001 (first: this checkout's src/ on sys.path)
import json
from pathlib import Path

from mfpipe.corpus import read_shard
from mfpipe.jobs import run_logged
from mfpipe.logs import setup_logging
from mfpipe.stats import StatsError, finalize, load_partial, merge_sums, write_store
from mfpipe.stats.partials import tokens_fingerprint
from mfpipe.tracked import TrackedSet

sm = snakemake  # noqa: F821 (injected by Snakemake)
log = setup_logging(sm.log[0])


def main() -> None:
    tracked = TrackedSet.load(sm.input.tracked)
    fp_path = getattr(sm.input, "fingerprint", None) or str(Path(sm.input.shards) / "fingerprint.json")
    info = json.loads(Path(fp_path).read_text())
    model, revision, half = str(sm.params.model), str(sm.params.revision), str(sm.params.half)
    partials = sorted(str(p) for p in sm.input.partials)
    if not partials:
        raise StatsError(f"no partials for {model} @ {revision} ({half}); the {half} half has no shards")

    first_meta: dict = {}
    shapes: dict = {}  # the first partial's array shapes: every later one must have them

    def refuse(p: str, why: str) -> StatsError:
        """A partial that is not what its shard's job wrote is deleted, not merged: it is an intermediate, and
        deleting it is what makes the rerun rebuild it (Snakemake reruns the stats_shard job of a missing partial)."""
        Path(p).unlink(missing_ok=True)
        return StatsError(f"statistics partial {p} {why}; deleted it: rerun to rebuild it")

    def sums_iter():
        """Load one partial at a time (each can be > 1 GB) and check it belongs to this store: readable (the zip's
        CRC-32 catches truncation and flipped bytes), computed from this store's model, revision, tracked set and
        context length, from exactly the corpus shard of its name (the tokens' fingerprint), and of its shape."""
        for p in partials:
            try:
                sums, meta = load_partial(p)
            except StatsError as e:
                raise refuse(p, f"is unreadable ({e.__cause__ or e})") from None
            for key, want in (("tracked_fingerprint", tracked.fingerprint), ("model", model), ("revision", revision),
                              ("context_length", int(info["context_length"]))):
                if key in meta and meta[key] != want:
                    raise refuse(p, f"was computed for {key}={meta[key]!r}, this store needs {want!r}")
            shard = Path(sm.input.shards) / half / Path(p).name  # partial shard-NNNNN.npz <- corpus shard-NNNNN.npz
            tokens = read_shard(shard).tokens
            if meta.get("shard_fingerprint") != tokens_fingerprint(tokens):
                raise refuse(p, f"was not computed from corpus shard {shard} (its shard_fingerprint differs)")
            if int(sums["n_windows"]) != tokens.shape[0] or (shapes and any(
                    getattr(sums.get(k), "shape", None) != shape for k, shape in shapes.items())):
                raise refuse(p, "has the wrong shape for its shard or differs in shape from the other partials")
            if not first_meta:
                first_meta.update(meta)
                shapes.update({k: v.shape for k, v in sums.items()})
            log.info("merged %s (%d windows)", p, int(sums["n_windows"]))
            yield sums

    sums = merge_sums(sums_iter())
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
    for k in ("model_type", "dtype", "n_kv_heads", "parallel_residual"):
        if k in first_meta:
            meta[k] = first_meta[k]
    ds = finalize(sums, tracked, meta)
    write_store(ds, sm.output[0])
    log.info("wrote %s: N=%d, L=%d, H=%d, %d tokens in %d windows from %d shards",
             sm.output[0], tracked.n, ds.sizes["layer"], ds.sizes["head"], ds.attrs["n_tokens"], ds.attrs["n_windows"],
             len(partials))


run_logged(main, log)
