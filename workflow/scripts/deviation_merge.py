"""Snakemake script: merge one (model, revision)'s pass-2 partials into the deviation store (per head S̄ of eq:ddec,
M_cov / M_ctx of eq:head-meters, per query type the same terms, top-deviation contexts, provenance)."""
import _mfpipe_checkout  # noqa: F401,I001 (first: this checkout's src/ on sys.path)
from mfpipe.experiments.ranking import deviation_pass as DP
from mfpipe.jobs import run_logged
from mfpipe.logs import setup_logging
from mfpipe.stats.store import write_store
from mfpipe.corpus.tracked import TrackedSet

sm = snakemake  # noqa: F821 (injected by Snakemake)
log = setup_logging(sm.log[0])


def main() -> None:
    p = sm.params
    tracked = TrackedSet.load(sm.input.tracked)
    paths = list(sm.input.partials)
    parts = [DP.open_partial(path) for path in paths]
    sums, meta = DP.merge_partials(parts, names=paths, expect={"model": p.model, "revision": str(p.revision),
                                                               "tracked_fingerprint": tracked.fingerprint})
    ds = DP.deviation_dataset(sums, meta, tracked, min_occurrences=int(p.min_occurrences))
    write_store(ds, sm.output[0])
    log.info("%d partials, %d windows, %d contexts; %d query types with >= %d occurrences; %d degenerate contexts",
             len(paths), int(sums["n_windows"]), ds.attrs["n_contexts"], ds.attrs["n_types_scored"],
             int(p.min_occurrences), int(sums["degenerate"].sum()))


run_logged(main, log)
