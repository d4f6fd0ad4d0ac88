"""Pass 2's jobs, one function per rule of workflow/rules/deviation.smk (run by mfpipe.workflow.runner.run_job).
Each imports what it runs inside its own body, so its code inputs are its own."""

from __future__ import annotations


def deviation_shard(job) -> None:
    """Pass 2 over a run of shards of the statistics half (Sec. 6, App. P): every context's mean-field deviation and
    its covariance / contextualization split, with pass 1's W and μ from the statistics store (never recomputed) ->
    one partial per shard (a Zarr folder) in the job's output folder, published atomically once every shard's
    partial is written. The model loads once for the run (`deviation.shards_per_job`)."""
    import time
    from pathlib import Path

    from mfpipe.corpus.windows import read_shard
    from mfpipe.deviation import shards as DP
    from mfpipe.workflow.context import open_forward_job
    from mfpipe.workflow.io import atomic_dir

    p, log = job.params, job.log
    shards = [str(s) for s in job.input.shards]
    fj = open_forward_job(job, shards_dir=Path(shards[0]).parent.parent)
    name, revision, adapter = fj.name, fj.revision, fj.adapter
    log.info("%s @ %s: pass 2 over %d shard(s) from %s, kernel %s C >= %d, top %d contexts per head", name, revision,
             len(shards), shards[0], p.kernel, int(p.min_count), int(p.top_k))
    with atomic_dir(job.output[0]) as out:
        for path in shards:
            shard = read_shard(path)
            t0 = time.perf_counter()
            sums, meta = DP.deviation_shard(fj.model, adapter, shard.tokens, shard.doc_ids, fj.tracked, fj.stats,
                                            min_count=int(p.min_count), calibrated=fj.calibrated,
                                            batch_size=int(p.batch_size), top_k=int(p.top_k),
                                            other_share_max=float(p.other_share_max),
                                            desc=f"deviation {name}@{revision} {Path(path).stem}")
            meta["shard"] = Path(path).name
            DP.save_partial(out / (Path(path).stem + ".zarr"), sums, meta)  # partial shard-NNNNN.zarr <- shard-NNNNN.npz
            dt = time.perf_counter() - t0
            log.info("%s: %d windows x T=%d, %d tokens in %.1f s (%.0f tok/s); %d contexts", path, shard.tokens.shape[0],
                     shard.tokens.shape[1], shard.tokens.size, dt, shard.tokens.size / max(dt, 1e-9),
                     int(sums["count"].sum() // max(adapter.n_layers, 1)))
    log.info("%d partial(s) in %s", len(shards), job.output[0])


def deviation_merge(job) -> None:
    """Merge one (model, revision)'s pass-2 partials (one per shard, in the folders of the jobs that wrote them) into
    the deviation store (per head S̄ of eq:ddec, M_cov / M_ctx of eq:head-meters, per query type the same terms,
    top-deviation contexts, provenance)."""
    from mfpipe.corpus.tracked import TrackedSet
    from mfpipe.deviation import shards as DP
    from mfpipe.stats.store import write_store

    p = job.params
    tracked = TrackedSet.load(job.input.tracked)
    # one folder per pass-2 job, one partial per shard inside, merged in shard order (deviation.shards_per_job)
    parts, paths = DP.open_job_partials(list(job.input.partials), dict(p.groups))
    sums, meta = DP.merge_partials(parts, names=paths, expect={"model": p.model, "revision": str(p.revision),
                                                               "tracked_fingerprint": tracked.fingerprint})
    ds = DP.deviation_dataset(sums, meta, tracked, min_occurrences=int(p.min_occurrences))
    write_store(ds, job.output[0])
    job.log.info("%d partials, %d windows, %d contexts; %d query types with >= %d occurrences; %d degenerate contexts",
                 len(paths), int(sums["n_windows"]), ds.attrs["n_contexts"], ds.attrs["n_types_scored"],
                 int(p.min_occurrences), int(sums["degenerate"].sum()))
