"""The function-vector experiment's jobs, one function per rule of workflow/rules/fv.smk (run by
mfpipe.workflow.runner.run_job). Each imports what it runs inside its own body, so its code inputs are its own."""

from __future__ import annotations


def function_vectors(job) -> None:
    """The function-vector experiment of one (model, revision) (Sec. 6.4, eq:taskresid; App. fv): every task's MFA
    and AIE selections, the injection sweep, the held-out transfer with its controls, and the lens analysis; Tables
    fv-matrix-body (summed injection) and fv-matrix (per-head injection), the stability and category details. Fig.
    fv is drawn from output.table by rule figure_fv.

    input.stats       the revision's statistics-half store (the corpus null at the cue type)
    input.shards, input.tracked, input.model, input.tokenizer   as every forward job (mfpipe.workflow.context)
    input.jlens       the revision's J-lens store (mfpipe.jlens; the lens analysis decodes through it), where
                      params.jlens (mfpipe.jlens.rules.decode_params) says "matrix"; with "jvp" the analysis decodes
                      through Jacobian-vector products on the same sample of input.shards' statistics half
    input.tasks       task files: the mini suite's tasks.json and the user's JSON files
    output.transfer, heads, sweep, clean, ranks   per-split results of every prompt-sampling seed (CSV, column
                      ``seed``); output.info: per seed and task (JSON); output.recovery: the head lists' recovery
    output.table      pooled transfer table of the first seed, with each accuracy's mean and range over the seeds
                      and the null (CSV); table_md / per_head_md / details_md the Markdown tables; clean_table /
                      clean_md the clean-prompt sweep (Fig. fv-clean is drawn from it by rule figure_fv_clean)
    params.tasks      task names (mfpipe.tasks vendored names, "minisuite", or JSON paths); params.fv the experiment
                      settings of this model (mfpipe.experiments.fv.experiment.DEFAULTS; its null and head lists
                      resolved by mfpipe.experiments.fv.rules.fv_settings); batch_size; model_params()
    """
    import json

    import pandas as pd

    from mfpipe.experiments.fv import details as Dt
    from mfpipe.experiments.fv import experiment as E
    from mfpipe.experiments.fv import tables as Tb
    from mfpipe.jlens.checks import checks_table
    from mfpipe.jlens.jvp import JLensSample
    from mfpipe.jlens.lens import open_jlens
    from mfpipe.workflow.context import open_forward_job
    from mfpipe.workflow.io import atomic_write_text
    from mfpipe.workflow.tables import write_table

    p, out, log = job.params, job.output, job.log
    fj = open_forward_job(job)
    name, revision = fj.name, fj.revision
    jd = dict(p.jlens)  # how the lens analysis decodes through the J-lens (mfpipe.jlens.rules.decode_params)
    if jd["decode"] == "matrix":
        jl = open_jlens(job.input.jlens, expect={"model": name, "revision": revision, "half": "stats",
                                                 "corpus_fingerprint": fj.corpus["fingerprint"]})  # as the lenses
    else:  # Jacobian-vector products on the store's sample of the statistics half
        jl = JLensSample.from_shards(fj.shards, n_positions=jd["n_positions"], seed=jd["seed"],
                                     batch_size=jd["batch_size"], chunk=jd["chunk"])
    cfg = {**dict(p.fv), "batch_size": int(p.batch_size)}
    tasks = E.resolve_tasks(list(p.tasks), list(job.input.tasks))
    res, infos = E.run_seeds(fj.adapter, tasks, fj.tokenizer(), fj.tracked, fj.stats, cfg, jlens=jl, log=log,
                             desc=f"fv {name}@{revision}")
    tabs = Tb.fv_tables(res, infos)
    # the J-lens the decodes read, and how far its estimate can be trusted (its own table adds the decode agreement)
    tabs["jlens_checks"] = checks_table(jl) if jd["decode"] == "matrix" and "check_split_half" in jl else pd.DataFrame()
    for k in ("transfer", "heads", "sweep", "clean"):
        write_table(res[k], csv=getattr(out, k))
    write_table(tabs["recovery"], csv=out.recovery)
    write_table(pd.concat([res["ranks"].assign(kind="vector"), res["prompt_ranks"].assign(kind="per-prompt")],
                          ignore_index=True), csv=out.ranks)
    atomic_write_text(out.info, json.dumps({"model": name, "revision": revision, "null": cfg.get("null"),
                                            "tasks": infos}, indent=1, default=float) + "\n")
    table = tabs["transfer"].copy()
    table.insert(0, "null", cfg.get("null", "mean_field"))
    table.insert(0, "revision", revision)
    table.insert(0, "model", name)
    write_table(table, csv=out.table)
    for path, protocol in ((out.table_md, "sum"), (out.per_head_md, "per_head")):
        atomic_write_text(path, Tb.matrix_markdown(tabs["transfer"], tabs["stability"], protocol, name, revision,
                                                   tabs["conclusions"], null=tabs["null"]))
    atomic_write_text(out.details_md, Dt.details_markdown(tabs, name, revision))
    clean = tabs["clean"].copy()
    clean.insert(0, "revision", revision)
    clean.insert(0, "model", name)
    write_table(clean, csv=out.clean_table)
    atomic_write_text(out.clean_md, Dt.clean_markdown(tabs["clean"], name, revision))
    _log_summary(log, tabs)


def _log_summary(log, tabs: dict) -> None:
    t = tabs["transfer"]
    for r in t[t["protocol"].isin(["sum", "zero-shot", "few-shot"])].itertuples(index=False):
        log.info("%-16s %-9s %-13s %-4s acc %.3f [%.3f, %.3f] (n=%d; seeds %.3f, %.3f-%.3f) category %.2f seen %.2f",
                 r.task, r.protocol, r.selection, r.construction, r.accuracy, r.ci_lo, r.ci_hi, r.n, r.seed_mean,
                 r.seed_min, r.seed_max, r.category_rate, r.seen_rate)
    for r in tabs["conclusions"].itertuples(index=False):
        log.info("%s %s: best by seed %s; raw-magnitude below MFA·r %s; MFA·r above random %s", r.task, r.protocol,
                 r.best_by_seed, r.raw_magnitude_below_MFA_r, r.MFA_r_above_random)
    for r in tabs["clean"].itertuples(index=False):
        log.info("%s %s: MFA·r from %d clean prompts %.3f [%.3f, %.3f] (AIE·raw %.3f)", r.task, r.protocol,
                 r.n_clean, r.accuracy, r.ci_lo, r.ci_hi, r.AIE_raw)
    pt = tabs["protocol"]
    log.info("per-head vs summed over %d cells: %+.3f (Wilcoxon p %s)", pt["n_cells"], pt["mean_difference"],
             pt["wilcoxon_p"])


def figure_fv(job) -> None:
    """Fig. fv from the pooled transfer table (input.table, results/tables/fv_{model}_{revision}.csv; no model
    loaded) -> output.pdf / output.png, titled params.title."""
    import pandas as pd

    from mfpipe.experiments.fv.figures import plot_transfer

    plot_transfer(pd.read_csv(job.input.table), job.output.pdf, title=str(job.params.title))
    job.log.info("wrote %s and %s", job.output.pdf, job.output.png)


def figure_fv_clean(job) -> None:
    """Fig. fv-clean (MFA·r against the number of clean prompts, AIE's reference lines) from the clean-prompt sweep's
    table (input.table, results/tables/fv_clean_{model}_{revision}.csv; no model) -> output.pdf / output.png."""
    import pandas as pd

    from mfpipe.experiments.fv.figures import plot_clean_sweep

    plot_clean_sweep(pd.read_csv(job.input.table), job.output.pdf, title=str(job.params.title))
    job.log.info("wrote %s and %s", job.output.pdf, job.output.png)
