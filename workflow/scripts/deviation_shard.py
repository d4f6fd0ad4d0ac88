"""Snakemake script: pass 2 over one shard of the statistics half (Sec. 6, App. P): every context's mean-field
deviation and its covariance / contextualization split, with pass 1's W and μ from the statistics store (never
recomputed) -> one partial (a Zarr folder, written atomically)."""
import _mfpipe_checkout  # noqa: F401,I001 (first: this checkout's src/ on sys.path)
import time
from pathlib import Path

from mfpipe.experiments.ranking import deviation_pass as DP
from mfpipe.corpus.windows import read_shard
from mfpipe.meanfield.context import open_forward_job
from mfpipe.jobs import run_logged
from mfpipe.logs import setup_logging

sm = snakemake  # noqa: F821 (injected by Snakemake)
log = setup_logging(sm.log[0])


def main() -> None:
    p = sm.params
    job = open_forward_job(sm, shards_dir=Path(sm.input.shard).parent.parent)
    name, revision, adapter = job.name, job.revision, job.adapter
    shard = read_shard(sm.input.shard)
    log.info("%s @ %s: pass 2 over %s (%d windows x T=%d), kernel %s C >= %d, top %d contexts per head",
             name, revision, sm.input.shard, shard.tokens.shape[0], shard.tokens.shape[1], p.kernel, int(p.min_count),
             int(p.top_k))
    t0 = time.perf_counter()
    sums, meta = DP.deviation_shard(job.model, adapter, shard.tokens, shard.doc_ids, job.tracked, job.stats,
                                    min_count=int(p.min_count), calibrated=job.calibrated, batch_size=int(p.batch_size), top_k=int(p.top_k),
                                    other_share_max=float(p.other_share_max), desc=f"deviation {name}@{revision}")
    meta["shard"] = Path(sm.input.shard).name
    DP.save_partial(sm.output[0], sums, meta)
    dt = time.perf_counter() - t0
    log.info("%d tokens in %.1f s (%.0f tok/s); %d contexts", shard.tokens.size, dt, shard.tokens.size / max(dt, 1e-9),
             int(sums["count"].sum() // max(adapter.n_layers, 1)))


run_logged(main, log)
