"""Snakemake script: mean-field deviation across the prompt classes of one (model, revision) (Sec. 6.1 Experiment 2,
Sec. 6.2, App. O): induction, few-shot, natural and random-control prompts measured with the statistics half's
kernel -> the per-prompt table, Tables icl / icl-terms (one class table) and Table icl-corr. Fig. icl is drawn from
the per-prompt table by rule figure_icl_classes.

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
import _mfpipe_checkout  # noqa: F401,I001 (first: this checkout's src/ on sys.path)
import time

from mfpipe.experiments.prompts import classes as I
from mfpipe.experiments.prompts import sets as P
from mfpipe.workflow.io import atomic_write_text
from mfpipe.workflow.context import open_forward_job
from mfpipe.workflow.runner import run_logged
from mfpipe.workflow.logs import setup_logging
from mfpipe.workflow.tables import write_table

sm = snakemake  # noqa: F821 (injected by Snakemake)
log = setup_logging(sm.log[0])


def main() -> None:
    p = sm.params
    job = open_forward_job(sm)
    name, revision, adapter, tracked = job.name, job.revision, job.adapter, job.tracked
    tokenizer = job.tokenizer()
    kernel = job.kernel(int(p.min_count))
    n = int(p.n_prompts)
    tokens, doc_ids = P.eval_windows(job.shards, max(50 * n, 1000))
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
    write_table(df, csv=sm.output.prompts)
    write_table(table, csv=sm.output.table)
    atomic_write_text(sm.output.table_md, I.class_markdown(table))
    write_table(sep, csv=sm.output.corr)
    atomic_write_text(sm.output.corr_md, I.separation_markdown(sep))
    for r in table.itertuples(index=False):
        log.info("%-10s n=%3d  D_MF %.3f  M_cov %.3f  M_ctx %.3f  ΔL %+.3f  ΔL_perm %+.3f  max Δẑ_perm %.1e  acc %.2f",
                 r[2], r.n, r.D_MF, r.M_cov, r.M_ctx, r.delta_L, r.delta_L_perm, r.dzhat_perm_max, r.accuracy)


run_logged(main, log)
