"""The statistics stage's jobs, one function per rule of workflow/rules/stats.smk (run by
mfpipe.workflow.runner.run_job). Each imports what it runs inside its own body, so its code inputs are its own."""

from __future__ import annotations


def stats_shard(job) -> None:
    """The additive statistics sums of a run of corpus shards (one traced forward per batch, all layers at once),
    one partial per shard (a compressed Zarr folder, mfpipe.stats.partials) in the job's output folder, published
    atomically once every shard's partial is written. The model loads once for the run.

    input.shards      the corpus shards of the job's run (group-<i>: the run starting at shard i)
    input.tracked     the dataset's tracked set; input.model the mini-suite checkpoint, for a mini model
    output[0]         the folder of the run's partials, shard-NNNNN.zarr per corpus shard-NNNNN.npz
    params.batch_size, params.mantissa_bits (stats.partial_mantissa_bits; None: exact); model_params()
    config            stats.kernel_sums (not a param: it changes no sum): "disk" maps the kernel sums from a file
                      beside the output (mfpipe.stats.engine.mapped_zeros) instead of holding them in memory, on
                      the CPU (a GPU keeps them in device memory)
    """
    from pathlib import Path

    from mfpipe.corpus.tracked import TrackedSet
    from mfpipe.stats.shards import shard_partials
    from mfpipe.workflow.io import atomic_dir

    p, log = job.params, job.log
    spec = dict(p.model_spec)
    revision = str(p.revision)
    dtype = str(p.dtype)
    tracked = TrackedSet.load(job.input.tracked)
    shards = [str(s) for s in job.input.shards]
    model, adapter = job.model()
    log.info("%s @ %s (%r, %s on %s): %d shard(s) from %s, N=%d tracked, batch %d", spec["name"], revision, adapter,
             dtype, adapter.device, len(shards), shards[0], tracked.n, int(p.batch_size))
    bits = p.mantissa_bits
    on_disk = (job.config.get("stats") or {}).get("kernel_sums") == "disk"
    if on_disk and adapter.device.type != "cpu":  # (runtime.device: auto) a GPU keeps them in device memory
        log.info("stats.kernel_sums: disk applies on the CPU: on %s the kernel sums stay in device memory",
                 adapter.device)
        on_disk = False
    with atomic_dir(job.output[0]) as out:
        kernel_dir = str(Path(out).parent) if on_disk else None
        if on_disk:
            log.info("the kernel sums map a file in %s (stats.kernel_sums: disk)", kernel_dir)
        shard_partials(model, adapter, shards, tracked, out, model_name=spec["name"], revision=revision, dtype=dtype,
                       commit=p.commit, batch_size=int(p.batch_size),
                       mantissa_bits=None if bits is None else int(bits), log=log, kernel_dir=kernel_dir)
    log.info("%d partial(s) in %s", len(shards), job.output[0])


def stats_merge(job) -> None:
    """Merge the per-shard partials of one (model, revision, half) into the labelled, layer-chunked zarr statistics
    store (written atomically), with provenance attributes (mfpipe.stats.merge.merge_half). The kernel sums stay on
    disk and are merged and written one layer of P at a time (mfpipe.stats.store.write_stats), so the merge's memory
    does not grow with L H N K.

    input.partials    the statistics jobs' folders of the dataset; input.shards the corpus's shards folder (its
                      fingerprint.json, or input.fingerprint where given); input.tracked the dataset's tracked set
    output[0]         the store, results/stats/<model>/<revision>/<dataset>.zarr
    params.model, revision, half, hub_id (the model's source), commit (a hub revision's resolved commit, or None)
    """
    import json
    from pathlib import Path

    from mfpipe.corpus.tracked import TrackedSet
    from mfpipe.stats.merge import merge_half

    p = job.params
    tracked = TrackedSet.load(job.input.tracked)
    fp_path = getattr(job.input, "fingerprint", None) or str(Path(job.input.shards) / "fingerprint.json")
    info = json.loads(Path(fp_path).read_text())
    model, revision, half = str(p.model), str(p.revision), str(p.half)
    ds, partials = merge_half(job.input.partials, job.input.shards, tracked, info, job.output[0], model=model,
                              revision=revision, half=half, model_source=str(getattr(p, "hub_id", "") or model),
                              commit=p.commit, log=job.log)
    job.log.info("wrote %s: N=%d, L=%d, H=%d, %d tokens in %d windows from %d shards",
                 job.output[0], tracked.n, ds.sizes["layer"], ds.sizes["head"], ds.attrs["n_tokens"],
                 ds.attrs["n_windows"], len(partials))
