"""The J-lens's job, the one rule of workflow/rules/jlens.smk (run by mfpipe.workflow.runner.run_job). It imports
what it runs inside its own body, so its code inputs are its own."""

from __future__ import annotations


def jlens(job) -> None:
    """The J-lens of App. P for one (model, revision) (mfpipe.jlens.lens): J_l = E[d h^L_t / d h^l_t], the average
    same-position Jacobian of the final residual with respect to the residual entering block l ("block") and to
    block l's attention output ("attn"), over seeded positions of the statistics half's windows ->
    results/jlens/<model>/<revision>/jlens.zarr (provenance: model, revision, corpus), and its checks table
    (mfpipe.jlens.checks, mfpipe.jlens.agreement) -> results/tables/jlens_checks_<model>_<revision>.{csv,md}: per
    (point, layer) the split-half and nested-prefix relative differences of J on `check_rows` output dimensions and
    the raw / J-lens decode agreement on `n_decode` other positions, a summary line per layer in the log."""
    import time
    from pathlib import Path

    import numpy as np

    from mfpipe.corpus.windows import list_shards, read_shard
    from mfpipe.jlens import agreement as JA
    from mfpipe.jlens import checks as JC
    from mfpipe.jlens import lens as JL
    from mfpipe.stats.halves import corpus_info
    from mfpipe.workflow.heap import release_free_memory
    from mfpipe.workflow.io import atomic_write_text
    from mfpipe.workflow.tables import write_table

    p, log = job.params, job.log
    name, revision = p.model_spec["name"], str(p.revision)
    shards = Path(job.input.shards)
    info = corpus_info(shards)
    paths = list_shards(shards / "stats")
    if not paths:
        raise FileNotFoundError(f"{shards / 'stats'} holds no shard: rerun the corpus stage (corpus_shards)")
    windows = np.concatenate([read_shard(x).tokens for x in paths])
    # streamed where its weights would not fit: its backward calls read each block again (saved_from_checkpoint)
    _, adapter = job.model()
    log.info("%s @ %s: J-lens over %d positions of %d windows (T=%d) of the statistics half, seed %d, %d windows per "
             "batch", name, revision, int(p.n_positions), windows.shape[0], windows.shape[1], int(p.seed),
             int(p.batch_size))
    t0 = time.perf_counter()
    ds = JL.estimate_jlens(adapter, windows, n_positions=int(p.n_positions), seed=int(p.seed),
                           batch_size=int(p.batch_size), grad_chunk=int(p.grad_chunk), desc=f"jlens {name}@{revision}",
                           check_rows=int(p.check_rows), sum_dtype=str(p.sum_dtype))
    L = adapter.n_layers
    off = float(np.abs(ds["J"].sel(point="block", layer=L).values - np.eye(adapter.d_model)).max())
    log.info("estimated in %.1f s; max |J_L - I| = %.2e (the final point's Jacobian is the identity)",
             time.perf_counter() - t0, off)
    # the decode's traced forwards on top of the heap the backward passes grew (the job keeps freed memory: heap):
    # handed back first (GPT-2 small's paper-shape job: 2.8 GiB, not 3.4; 1.8 once each position's graph was freed)
    release_free_memory()
    t0 = time.perf_counter()
    agree = JA.decode_agreement(adapter, ds, windows, n_decode=int(p.n_decode), batch_size=int(p.batch_size),
                                seed=int(p.seed) + 1)
    table = JC.checks_table(ds, agree)
    log.info("checks on %d of %d output dimensions; raw / J-lens decodes of %d other positions compared in %.1f s",
             len(ds.attrs["check_rows"]), adapter.d_model, int(p.n_decode), time.perf_counter() - t0)
    for line in JC.summary_lines(table):
        log.info("%s", line)
    prov = {"model": name, "revision": revision, "revision_commit": getattr(p, "commit", None), "half": "stats",
            "corpus": info.get("corpus"), "corpus_fingerprint": info["fingerprint"]}
    JL.write_jlens(job.output[0], ds, prov)
    write_table(table, csv=job.output.table)
    atomic_write_text(job.output.md, JC.checks_markdown(table, f"J-lens checks: {name} @ {revision}"))
