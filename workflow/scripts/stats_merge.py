"""Snakemake script: merge the per-shard partials of one (model, revision, half) into the labelled,
layer-chunked zarr statistics store (written atomically), with provenance attributes."""
import _mfpipe_checkout  # noqa: F401,I001 (first: this checkout's src/ on sys.path)
import json
from pathlib import Path

from mfpipe.jobs import run_logged
from mfpipe.logs import setup_logging
from mfpipe.stats import StatsError, finalize, load_partial, merge_sums, write_store
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

    def sums_iter():
        """Load one partial at a time (each can be > 1 GB) and check it belongs to this store."""
        for p in partials:
            sums, meta = load_partial(p)
            for key, want in (("tracked_fingerprint", tracked.fingerprint), ("model", model), ("revision", revision),
                              ("context_length", int(info["context_length"]))):
                if key in meta and meta[key] != want:
                    raise StatsError(f"partial {p} was computed for {key}={meta[key]!r}, this store needs {want!r}; "
                                     "delete it and rerun")
            if not first_meta:
                first_meta.update(meta)
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
