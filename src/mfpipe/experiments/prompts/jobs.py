"""The prompt experiments' jobs, one function per rule of workflow/rules/prompts.smk (run by
mfpipe.workflow.runner.run_job). Each imports what it runs inside its own body, so its code inputs are its own."""

from __future__ import annotations


def lenses(job) -> None:
    """The lenses of App. P for one (model, revision) (issue 11 item 7): per head (the top-n by S̄ plus any named),
    the top-deviation contexts pass 2 recorded, re-run for their surrounding text, top attended keys, next token,
    recomputed D and meters, and the raw logit-lens and J-lens decodes of the deviation vector (the J-lens store of
    rule jlens, mfpipe.jlens) ->
    results/lenses/<model>/<revision>/contexts.md|.html (context lens), decode.md (decode lens), contexts.csv."""
    import time

    from mfpipe.corpus.windows import list_shards
    from mfpipe.deviation.store import check_against_half, open_deviation, stats_fingerprint
    from mfpipe.experiments.prompts import lenses as LE
    from mfpipe.jlens.jvp import JLensSample
    from mfpipe.jlens.lens import open_jlens
    from mfpipe.workflow.context import open_forward_job
    from mfpipe.workflow.io import atomic_write_text

    p, inp, out, log = job.params, job.input, job.output, job.log
    fj = open_forward_job(job, load=False)  # the stores first, each checked, then the model
    name, revision, tracked, info = fj.name, fj.revision, fj.tracked, fj.corpus
    ds = open_deviation(inp.deviation, {"model": name, "revision": revision,
                                        "tracked_fingerprint": tracked.fingerprint,
                                        "stats_fingerprint": stats_fingerprint(fj.stats)})
    # the store's (top_shard, top_window) index the statistics half's sorted shard list
    shard_paths = list_shards(fj.shards / "stats")
    check_against_half(ds, inp.deviation, fj.shards, shard_paths, info)
    jl = dict(p.jlens)  # how it decodes through the J-lens (mfpipe.jlens.rules.decode_params)
    if jl["decode"] == "matrix":
        jlens = open_jlens(inp.jlens, {"model": name, "revision": revision, "half": "stats",
                                       "corpus_fingerprint": info["fingerprint"]})
    else:  # Jacobian-vector products on the store's sample of the statistics half
        jlens = JLensSample.from_shards(fj.shards, n_positions=jl["n_positions"], seed=jl["seed"],
                                        batch_size=jl["batch_size"], chunk=jl["chunk"], progress=True)
    log.info("J-lens decodes: %s", "the stored J" if jl["decode"] == "matrix" else
             f"Jacobian-vector products over {jl['n_positions']} positions (seed {jl['seed']})")
    adapter, tokenizer = fj.load_model().adapter, fj.tokenizer()
    kernel = fj.kernel(ds.attrs.get("min_count")).to(adapter.device)
    t0 = time.perf_counter()
    rows = LE.mine_contexts(ds, shard_paths, heads=list(p.heads or []), per_head=int(p.per_head),
                            n_lens_heads=int(p.n_lens_heads), tokenizer=tokenizer)
    log.info("%s @ %s: %d contexts of %d heads (%d dropped as garbled text), kernel %s (C >= %s)", name, revision,
             len(rows), rows.groupby(["layer", "head"]).ngroups,
             int(rows.drop_duplicates(["layer", "head"])["n_garbled"].sum()), kernel.attrs["kernel"],
             kernel.attrs["min_count"])
    df = LE.context_details(adapter, kernel, tokenizer, shard_paths, rows, batch_size=int(p.batch_size), jlens=jlens)
    bad = df[~df["D_ok"]]
    if len(bad):
        log.warning("%d of %d contexts: recomputed D differs from the stored top_D by more than %g (max %.2e); they "
                    "are marked ⚠ (model dtype %s)", len(bad), len(df), LE.D_ATOL,
                    float((bad["D_recomputed"] - bad["D"]).abs().max()), p.dtype)
    share = float(ds.attrs.get("other_share_max", LE.OTHER_SHARE_MAX))  # what pass 2 left out, as it mined
    atomic_write_text(out.contexts_md, LE.contexts_markdown(df, name, revision, share))
    atomic_write_text(out.contexts_html, LE.contexts_html(df, name, revision, share))
    atomic_write_text(out.decode_md, LE.decode_markdown(df, name, revision, share))
    atomic_write_text(out.csv, LE.contexts_csv(df))
    log.info("lenses written in %.1f s", time.perf_counter() - t0)


def icl_classes(job) -> None:
    """Mean-field deviation across the prompt classes of one (model, revision) (Sec. 6.1 Experiment 2, Sec. 6.2,
    App. O): induction, few-shot, natural and random-control prompts measured with the statistics half's kernel ->
    the per-prompt table, Tables icl / icl-terms (one class table) and Table icl-corr. Fig. icl is drawn from the
    per-prompt table by rule figure_icl_classes.

    input.stats      the revision's statistics-half store; input.shards: the corpus shards (natural prompts from the
                     eval half); input.tracked: tracked.json; input.model / input.tokenizer: dependencies only (the
                     mini suite's checkpoints and tokenizer); input.tasks: the user's few-shot task files (JSON,
                     mfpipe.tasks.load_task_file); input.task_data: the vendored datasets of params.tasks (mfpipe.tasks)
    output.prompts   per-prompt CSV (mfpipe.experiments.prompts.classes.PROMPT_COLUMNS)
    output.table, output.table_md    per class: n, D_MF, M_cov, M_ctx, ΔL, ΔL_perm, max Δẑ_perm, accuracy
    output.corr, output.corr_md      Hedges' g and Welch p of each class against the random control
    params           n_prompts, n_fewshot, n_random, seed, min_count, batch_size, tasks (built-in or vendored names),
                     task_files,
                     natural_length (null: T-1), and model_params() (model_spec, revision, dtype, device, results)
    """
    import time

    from mfpipe.corpus.windows import eval_windows
    from mfpipe.experiments.prompts import classes as I
    from mfpipe.experiments.prompts import sets as P
    from mfpipe.workflow.context import open_forward_job
    from mfpipe.workflow.io import atomic_write_text
    from mfpipe.workflow.tables import write_table

    p, out, log = job.params, job.output, job.log
    fj = open_forward_job(job)
    name, revision, adapter, tracked = fj.name, fj.revision, fj.adapter, fj.tracked
    tokenizer = fj.tokenizer()
    kernel = fj.kernel(int(p.min_count))
    n = int(p.n_prompts)
    tokens, doc_ids = eval_windows(fj.shards, n_windows=max(50 * n, 1000))[:2]
    T = int(tokens.shape[1])
    pool = I.queryable_types(kernel)
    prompts, pinfo = P.prompt_classes(pool, tokenizer, tracked, T, tokens, doc_ids, n=n, n_fewshot=int(p.n_fewshot),
                                      n_random=int(p.n_random), seed=int(p.seed), tasks=list(p.tasks),
                                      task_files=list(p.task_files), natural_length=p.natural_length)
    log.info("%s @ %s: %d prompts (T=%d, %d of %d tracked types with a kernel row, W on C >= %d): %s; few-shot "
             "tasks (pairs) %s", name, revision, len(prompts), T, len(pool), tracked.n, int(p.min_count),
             pinfo["counts"], pinfo["tasks"])
    for t, src in pinfo["sources"].items():
        log.info("few-shot task %s: %d usable pairs from %s", t, pinfo["tasks"][t], src)
    for cls, c in pinfo["counts"].items():
        want = int(p.n_fewshot) if cls == "few-shot" else n
        if c < want:
            log.warning("only %d of %d %s prompts could be built", c, want, cls)
    t0 = time.perf_counter()
    df, skipped = I.measure_prompts(adapter, kernel, prompts, batch_size=int(p.batch_size), seed=int(p.seed),
                                    progress=True, desc=f"icl {name}@{revision}")
    df.attrs["skipped"] = skipped
    log.info("measured %d prompts in %.1f s; skipped (no valid mean-field row at the query): %s", len(df),
             time.perf_counter() - t0, skipped or "none")
    table = I.class_table(df)
    sep = I.separation_table(df)
    for t in (table, sep):
        t.insert(0, "revision", revision)
        t.insert(0, "model", name)
    write_table(df, csv=out.prompts)
    write_table(table, csv=out.table)
    atomic_write_text(out.table_md, I.class_markdown(table))
    write_table(sep, csv=out.corr)
    atomic_write_text(out.corr_md, I.separation_markdown(sep))
    for r in table.itertuples(index=False):
        log.info("%-10s n=%3d  D_MF %.3f  M_cov %.3f  M_ctx %.3f  ΔL %+.3f  ΔL_perm %+.3f  max Δẑ_perm %.1e  acc %.2f",
                 r[2], r.n, r.D_MF, r.M_cov, r.M_ctx, r.delta_L, r.delta_L_perm, r.dzhat_perm_max, r.accuracy)


def icl_meter(job) -> None:
    """The instance meter of one (model, revision) (Sec. 6.1 Experiment 1): eval-half chunks c presented as
    [BOS; c; c], per query position the mean next-token loss and mean D_MF, the head whose deviation rises most across
    the copy boundary, and the in-context loss reduction binned by the deviation rise -> the tables Fig. icl-meter is
    drawn from (rule figure_icl_meter).

    input.stats      the revision's statistics-half store; input.shards: the corpus shards (chunks from the eval
                     half); input.tracked: tracked.json; input.model: dependency only (mini-suite checkpoints)
    output.curves    per position: copy, loss (valid positions), loss_all, D_MF, n_valid, top_head_D (CSV)
    output.heads     per head: mean D over copy 1 and copy 2, rise (CSV)
    output.bins      loss reduction binned by deviation rise, equal-count bins, mean ± s.e.m. (CSV)
    output.summary, output.summary_md  one row: top head and its rise, copy means, Spearman of the pairs
    params           n_sequences, chunk_length (the paper: 128; cut to (T-1)//2 where [BOS; c; c] does not fit the T-token
                     windows; null: (T-1)//2), n_bins, seed, min_count, batch_size, model_params()
    """
    import time

    from mfpipe.corpus.windows import eval_windows
    from mfpipe.experiments.prompts import meter as IM
    from mfpipe.experiments.prompts import sets as P
    from mfpipe.workflow.context import open_forward_job
    from mfpipe.workflow.tables import write_table

    p, out, log = job.params, job.output, job.log
    n = int(p.n_sequences)
    fj = open_forward_job(job)
    name, revision = fj.name, fj.revision
    tokens, doc_ids = eval_windows(fj.shards, n_windows=4 * n)[:2]
    want = None if p.chunk_length in (None, "", "null") else int(p.chunk_length)
    k, cut = P.meter_chunk_length(want, tokens.shape[1])
    if cut:
        log.info("chunk_length %d cut to %d: [BOS; c; c] needs 2k+1 <= T = %d tokens", want, k, tokens.shape[1])
    seqs, spanning = P.meter_sequences(tokens, doc_ids, n, k, bos_id=fj.tracked.bos_id, seed=int(p.seed))
    if len(seqs) < n:
        log.warning("the eval half has only %d windows: %d of %d sequences", len(tokens), len(seqs), n)
    log.info("%s @ %s: %d sequences [BOS; c; c], k=%d (%d chunks span a document boundary), W on C >= %d",
             name, revision, len(seqs), (seqs.shape[1] - 1) // 2, spanning, int(p.min_count))
    t0 = time.perf_counter()
    res = IM.instance_meter(fj.adapter, fj.kernel(int(p.min_count)), seqs, batch_size=int(p.batch_size),
                            progress=True, desc=f"icl meter {name}@{revision}")
    tabs = IM.meter_tables(res, n_bins=int(p.n_bins))
    summary = tabs["summary"]
    summary.insert(0, "revision", revision)
    summary.insert(0, "model", name)
    write_table(tabs["curves"], csv=out.curves)
    write_table(tabs["heads"], csv=out.heads)
    write_table(tabs["bins"], csv=out.bins)
    write_table(summary, csv=out.summary, md=out.summary_md)
    s = summary.iloc[0]
    log.info("in %.1f s: loss copy 1 %.3f -> copy 2 %.3f, D_MF %.3f -> %.3f; top-rising head L%dH%d (+%.3f); "
             "Spearman(rise, loss reduction) %.3f over %d pairs", time.perf_counter() - t0, s["loss_copy1"],
             s["loss_copy2"], s["D_MF_copy1"], s["D_MF_copy2"], s["top_layer"], s["top_head"], s["top_head_rise"],
             s["spearman_rho"], s["n_pairs"])


def figure_icl_classes(job) -> None:
    """Fig. icl of the prompt experiments (PDF + PNG) from the per-prompt CSV its forward-pass job wrote
    (input.prompts); no model is loaded."""
    from mfpipe.experiments.prompts import figures as F

    F.icl_figure(job.input.prompts, job.output.pdf, job.output.png, title=job.params.title)
    job.log.info("wrote %s and %s", job.output.pdf, job.output.png)


def figure_icl_meter(job) -> None:
    """Fig. icl-meter of the prompt experiments (PDF + PNG) from the curves, bins and summary CSVs its forward-pass
    job wrote; no model is loaded."""
    import pandas as pd

    from mfpipe.experiments.prompts import figures as F

    inp, out = job.input, job.output
    summary = pd.read_csv(inp.summary)
    F.meter_figure(inp.curves, inp.bins, summary, out.pdf, out.png,
                   title=f"{job.params.title}, k={int(summary['k'].iloc[0])}")
    job.log.info("wrote %s and %s", out.pdf, out.png)
