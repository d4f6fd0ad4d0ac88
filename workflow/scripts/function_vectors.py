"""Snakemake script: the function-vector experiment of one (model, revision) (Sec. 6.4, eq:taskresid; App. fv;
mfpipe.experiments.fv): every task's MFA and AIE selections, the injection sweep, the held-out transfer with its
controls, and the lens analysis; Tables fv-matrix-body (summed injection) and fv-matrix (per-head injection), the
stability and category details. Fig. fv is drawn from output.table by rule figure_fv.

input.stats       the revision's statistics-half store (the corpus null at the cue type)
input.shards, input.tracked, input.model, input.tokenizer   as every forward job (mfpipe.meanfield.context)
input.jlens       the revision's J-lens store (mfpipe.jlens; the lens analysis decodes through it)
input.tasks       task files: the mini suite's tasks.json and the user's JSON files
output.transfer, heads, sweep, ranks   per-split results (CSV); output.info: per task (JSON)
output.table      pooled transfer table (CSV); table_md / per_head_md / details_md the Markdown tables
params.tasks      task names (mfpipe.tasks vendored names, "minisuite", or JSON paths); params.fv the experiment
                  settings (mfpipe.experiments.fv.experiment.DEFAULTS); batch_size; model_params()
"""
import _mfpipe_checkout  # noqa: F401,I001 (first: this checkout's src/ on sys.path)
import json

import numpy as np
import pandas as pd

from mfpipe.experiments.fv import experiment as E
from mfpipe.experiments.fv import heads as Hd
from mfpipe.experiments.fv import tables as Tb
from mfpipe.io import atomic_write_text
from mfpipe.jlens import open_jlens
from mfpipe.jobs import run_logged
from mfpipe.logs import setup_logging
from mfpipe.meanfield.context import open_forward_job
from mfpipe.tables import write_table
from mfpipe.tasks import FewShotTask, load_task

sm = snakemake  # noqa: F821 (injected by Snakemake)
log = setup_logging(sm.log[0])


def resolve_tasks(names, files) -> list[tuple]:
    """(task, settings it overrides): the mini suite's tasks are written as it trained on them, ``x:y`` (no space
    before the answer); the rest use the configured format."""
    tasks = []
    for name in names:
        if name == "minisuite":
            path = next(f for f in files if str(f).endswith("minisuite/tasks.json"))
            for t in json.loads(open(path).read())["tasks"]:
                tasks.append((FewShotTask(t["name"], [tuple(p) for p in t["pairs"]], source=t.get("source", path)),
                              {"answer_prefix": ""}))
        else:
            tasks.append((load_task(name), {}))
    return tasks


def main() -> None:
    from tqdm.auto import tqdm

    p = sm.params
    job = open_forward_job(sm)
    name, revision, adapter, tracked = job.name, job.revision, job.adapter, job.tracked
    tokenizer = job.tokenizer()
    jl = open_jlens(sm.input.jlens, expect={"model": name, "revision": revision})
    cfg = {**dict(p.fv), "batch_size": int(p.batch_size)}
    tasks = resolve_tasks(list(p.tasks), list(sm.input.tasks))
    T = int(job.stats.attrs.get("context_length") or 1 << 30)
    bos = int(tracked.bos_id)
    null = lambda cue: Hd.corpus_null(job.stats, tracked, cue, cfg.get("null", "mean_field"))  # noqa: E731
    # every task's pool, drawn once: its answer category is the "unrelated words" population of the others
    from mfpipe.experiments.fv.prompts import task_pool

    pools, cats = {}, {}
    for t, over in tasks:
        c = {**cfg, **over}
        try:
            pools[t.name] = task_pool(t, tokenizer, bos, n_pairs=int(c["n_pairs"]), seed=int(c["seed"]),
                                      sep=c["separator"], answer_prefix=c["answer_prefix"])
            cats[t.name] = pools[t.name].category
        except ValueError:  # run_task draws it again and stops the job with that error
            cats[t.name] = np.zeros(0, np.int64)
    parts, infos = {k: [] for k in ("transfer", "heads", "sweep", "ranks", "prompt_ranks")}, []
    with tqdm(desc=f"fv {name}@{revision}", unit="row", mininterval=5) as bar:
        for t, over in tasks:
            out = E.run_task(adapter, t, tokenizer, bos, null, {**cfg, **over}, jlens=jl, context_length=T, log=log,
                             other_categories=[c for k, c in cats.items() if k != t.name], progress=bar,
                             pool=pools.get(t.name))
            for k in parts:
                parts[k].append(out[k])
            infos.append(out["info"])
    res = {k: pd.concat(v, ignore_index=True) for k, v in parts.items()}
    tabs = Tb.fv_tables(res, infos)
    for k, path in (("transfer", sm.output.transfer), ("heads", sm.output.heads), ("sweep", sm.output.sweep)):
        write_table(res[k], csv=path)
    write_table(pd.concat([res["ranks"].assign(kind="vector"), res["prompt_ranks"].assign(kind="per-prompt")],
                          ignore_index=True), csv=sm.output.ranks)
    atomic_write_text(sm.output.info, json.dumps({"model": name, "revision": revision, "tasks": infos}, indent=1,
                                                 default=float) + "\n")
    table = tabs["transfer"].copy()
    table.insert(0, "revision", revision)
    table.insert(0, "model", name)
    write_table(table, csv=sm.output.table)
    atomic_write_text(sm.output.table_md, Tb.matrix_markdown(tabs["transfer"], tabs["stability"], "sum", name, revision))
    atomic_write_text(sm.output.per_head_md,
                      Tb.matrix_markdown(tabs["transfer"], tabs["stability"], "per_head", name, revision))
    atomic_write_text(sm.output.details_md, Tb.details_markdown(tabs, name, revision))
    t = tabs["transfer"]
    for r in t[t["protocol"].isin(["sum", "zero-shot", "few-shot"])].itertuples(index=False):
        log.info("%-16s %-9s %-13s %-4s acc %.3f [%.3f, %.3f] (n=%d) category %.2f seen %.2f", r.task, r.protocol,
                 r.selection, r.construction, r.accuracy, r.ci_lo, r.ci_hi, r.n, r.category_rate, r.seen_rate)


run_logged(main, log)
