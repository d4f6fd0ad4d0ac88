"""Snakemake script: pass 2 over a run of shards of the statistics half (Sec. 6, App. P): every context's mean-field
deviation and its covariance / contextualization split, with pass 1's W and μ from the statistics store (never
recomputed) -> one partial per shard (a Zarr folder) in the job's output folder, published atomically once every
shard's partial is written. The model loads once for the run (`deviation.shards_per_job`)."""
import _mfpipe_checkout  # noqa: F401,I001 (first: this checkout's src/ on sys.path)
import time
from pathlib import Path

from mfpipe.deviation import shards as DP
from mfpipe.corpus.windows import read_shard
from mfpipe.workflow.io import atomic_dir
from mfpipe.workflow.context import open_forward_job
from mfpipe.workflow.runner import run_logged
from mfpipe.workflow.logs import setup_logging

sm = snakemake  # noqa: F821 (injected by Snakemake)
log = setup_logging(sm.log[0])


def main() -> None:
    p = sm.params
    shards = [str(s) for s in sm.input.shards]
    job = open_forward_job(sm, shards_dir=Path(shards[0]).parent.parent)
    name, revision, adapter = job.name, job.revision, job.adapter
    log.info("%s @ %s: pass 2 over %d shard(s) from %s, kernel %s C >= %d, top %d contexts per head", name, revision,
             len(shards), shards[0], p.kernel, int(p.min_count), int(p.top_k))
    with atomic_dir(sm.output[0]) as out:
        for path in shards:
            shard = read_shard(path)
            t0 = time.perf_counter()
            sums, meta = DP.deviation_shard(job.model, adapter, shard.tokens, shard.doc_ids, job.tracked, job.stats,
                                            min_count=int(p.min_count), calibrated=job.calibrated,
                                            batch_size=int(p.batch_size), top_k=int(p.top_k),
                                            other_share_max=float(p.other_share_max),
                                            desc=f"deviation {name}@{revision} {Path(path).stem}")
            meta["shard"] = Path(path).name
            DP.save_partial(out / (Path(path).stem + ".zarr"), sums, meta)  # partial shard-NNNNN.zarr <- shard-NNNNN.npz
            dt = time.perf_counter() - t0
            log.info("%s: %d windows x T=%d, %d tokens in %.1f s (%.0f tok/s); %d contexts", path, shard.tokens.shape[0],
                     shard.tokens.shape[1], shard.tokens.size, dt, shard.tokens.size / max(dt, 1e-9),
                     int(sums["count"].sum() // max(adapter.n_layers, 1)))
    log.info("%d partial(s) in %s", len(shards), sm.output[0])


run_logged(main, log)
