"""Snakemake script: merge one (model, revision)'s pass-2 partials (one per shard, in the folders of the jobs that
wrote them) into the deviation store (per head S̄ of eq:ddec, M_cov / M_ctx of eq:head-meters, per query type the
same terms, top-deviation contexts, provenance)."""
import _mfpipe_checkout  # noqa: F401,I001 (first: this checkout's src/ on sys.path)
from mfpipe.deviation import shards as DP
from mfpipe.workflow.runner import run_logged
from mfpipe.workflow.logs import setup_logging
from mfpipe.stats.store import write_store
from mfpipe.corpus.tracked import TrackedSet

sm = snakemake  # noqa: F821 (injected by Snakemake)
log = setup_logging(sm.log[0])


def main() -> None:
    p = sm.params
    tracked = TrackedSet.load(sm.input.tracked)
    # one folder per pass-2 job, one partial per shard inside, merged in shard order (deviation.shards_per_job)
    parts, paths = DP.open_job_partials(list(sm.input.partials), dict(p.groups))
    sums, meta = DP.merge_partials(parts, names=paths, expect={"model": p.model, "revision": str(p.revision),
                                                               "tracked_fingerprint": tracked.fingerprint})
    ds = DP.deviation_dataset(sums, meta, tracked, min_occurrences=int(p.min_occurrences))
    write_store(ds, sm.output[0])
    log.info("%d partials, %d windows, %d contexts; %d query types with >= %d occurrences; %d degenerate contexts",
             len(paths), int(sums["n_windows"]), ds.attrs["n_contexts"], ds.attrs["n_types_scored"],
             int(p.min_occurrences), int(sums["degenerate"].sum()))


run_logged(main, log)
