"""Snakemake script: pass 2 over one shard of the statistics half (Sec. 6, App. P): every context's mean-field
deviation and its covariance / contextualization split, with pass 1's W and μ from the statistics store (never
recomputed) -> one partial (a Zarr folder, written atomically)."""
import _mfpipe_checkout  # noqa: F401,I001 (first: this checkout's src/ on sys.path)
import time
from pathlib import Path

from mfpipe.analysis import deviation_pass as DP
from mfpipe.analysis.stores import check_model, open_stats_half
from mfpipe.corpus import read_shard
from mfpipe.jobs import load_job_model, run_logged
from mfpipe.logs import setup_logging
from mfpipe.tracked import TrackedSet

sm = snakemake  # noqa: F821 (injected by Snakemake)
log = setup_logging(sm.log[0])


def main() -> None:
    p = sm.params
    name, revision = p.model_spec["name"], str(p.revision)
    tracked = TrackedSet.load(sm.input.tracked)
    st, info = open_stats_half(sm.input.stats, Path(sm.input.shard).parent.parent, tracked, name, revision)
    calibrated = None
    if str(p.kernel) == "calibrated":
        from mfpipe.calibrated_store import load_calibrated

        calibrated = load_calibrated(sm.input.kernel, expect={"model": name, "revision": revision,
                                                              "tracked_fingerprint": tracked.fingerprint})
    shard = read_shard(sm.input.shard)
    model, adapter = load_job_model(p, sm.threads)
    check_model(adapter, st)
    log.info("%s @ %s: pass 2 over %s (%d windows x T=%d), kernel %s C >= %d, top %d contexts per head",
             name, revision, sm.input.shard, shard.tokens.shape[0], shard.tokens.shape[1], p.kernel, int(p.min_count),
             int(p.top_k))
    t0 = time.perf_counter()
    sums, meta = DP.deviation_shard(model, adapter, shard.tokens, shard.doc_ids, tracked, st, min_count=int(p.min_count),
                                    calibrated=calibrated, batch_size=int(p.batch_size), top_k=int(p.top_k),
                                    other_share_max=float(p.other_share_max), desc=f"deviation {name}@{revision}")
    meta["shard"] = Path(sm.input.shard).name
    DP.save_partial(sm.output[0], sums, meta)
    dt = time.perf_counter() - t0
    log.info("%d tokens in %.1f s (%.0f tok/s); %d contexts", shard.tokens.size, dt, shard.tokens.size / max(dt, 1e-9),
             int(sums["count"].sum() // max(adapter.n_layers, 1)))


run_logged(main, log)
