# Function vectors from mean-field deviation (paper Sec. 6.4, eq:taskresid; App. fv; library
# mfpipe.experiments.fv). Per rollout revision of a model with `function_vectors.tasks`: one forward-pass job runs
# every task (MFA and AIE selection, the sweep, the held-out evaluation, the lenses) and writes the tables; the
# figure is drawn from the transfer table by its own rule.
FV = config["function_vectors"]


def fv_tasks(model):
    """The function-vector tasks of `model`: `minisuite` (the tasks the mini suite trained on) only for mini-suite
    models, the rest (vendored names, task files) for every model."""
    if FV["models"] is not None and model not in FV["models"]:
        return []
    mini = MODELS[model]["source"] == "minisuite"
    return [t for t in FV["tasks"] if t != "minisuite" or mini]


def fv_task_inputs(wildcards):
    """The task files a job reads: the mini suite's tasks, the user's files and the vendored datasets it names
    (mfpipe.tasks): editing one reruns the job."""
    out = []
    for t in fv_tasks(wildcards.model):
        vendored = SRC / "mfpipe" / "tasks" / "data" / f"{t}.json"
        if t == "minisuite":
            out.append(f"{R}/minisuite/tasks.json")
        elif t.endswith(".json"):
            out.append(t)
        elif vendored.is_file():
            out.append(str(vendored))
    return out


def fv_targets():
    t = []
    for m in MODELS:
        if not fv_tasks(m):
            continue
        for rev in ROLLOUT_REVISIONS[m]:
            t += [f"{R}/tables/fv_{m}_{rev}.{e}" for e in ("csv", "md")]
            t += [f"{R}/tables/fv_per_head_{m}_{rev}.md", f"{R}/tables/fv_details_{m}_{rev}.md"]
            t += [f"{R}/figures/fv_{m}_{rev}.{e}" for e in ("pdf", "png")]
    return t


rule function_vectors:
    input:
        stats=f"{R}/stats/{{model}}/{{revision}}/stats.zarr",
        shards=f"{R}/corpus/{CORPUS}/{{model}}/shards",
        tracked=f"{R}/corpus/{CORPUS}/{{model}}/tracked.json",
        jlens=f"{R}/jlens/{{model}}/{{revision}}/jlens.zarr",
        model=model_input,
        tokenizer=tokenizer_input,
        tasks=fv_task_inputs,
        code=job("experiments.fv", "function_vectors"),
    output:
        transfer=f"{R}/fv/{{model}}/{{revision}}/transfer.csv",
        heads=f"{R}/fv/{{model}}/{{revision}}/heads.csv",
        sweep=f"{R}/fv/{{model}}/{{revision}}/sweep.csv",
        ranks=f"{R}/fv/{{model}}/{{revision}}/ranks.csv",
        info=f"{R}/fv/{{model}}/{{revision}}/info.json",
        table=table_report(f"{R}/tables/fv_{{model}}_{{revision}}.csv", "function vectors"),
        table_md=f"{R}/tables/fv_{{model}}_{{revision}}.md",
        per_head_md=f"{R}/tables/fv_per_head_{{model}}_{{revision}}.md",
        details_md=f"{R}/tables/fv_details_{{model}}_{{revision}}.md",
    params:
        tasks=lambda wc: fv_tasks(wc.model),
        fv={k: v for k, v in FV.items() if k not in ("tasks", "models", "batch_size")},
        batch_size=FV["batch_size"] or config["runtime"]["batch_size"],
        **model_params(),
    threads: model_threads
    resources:
        **cluster_resources("forward"),
    conda:
        ENV
    benchmark:
        "logs/benchmarks/function_vectors/fv/{model}/{revision}.tsv",
    log:
        "logs/fv/{model}/{revision}.log",
    script:
        JOB_SCRIPT


# Fig. fv, drawn from the transfer table (deleting it reruns only this job):
#   snakemake --cores 1 results/figures/fv_mini-gpt2_final.png
rule figure_fv:
    input:
        table=f"{R}/tables/fv_{{model}}_{{revision}}.csv",
        code=job("experiments.fv", "figure_fv"),
    output:
        pdf=report(f"{R}/figures/fv_{{model}}_{{revision}}.pdf", caption="../report/figure_fv.rst",
                   category="Figures", subcategory="function vectors"),
        png=report(f"{R}/figures/fv_{{model}}_{{revision}}.png", caption="../report/figure_fv.rst",
                   category="Figures", subcategory="function vectors"),
    params:
        title="{model} @ {revision}",
    localrule: True
    conda:
        ENV
    benchmark:
        "logs/benchmarks/figure_fv/figures/fv_{model}_{revision}.tsv",
    log:
        "logs/figures/fv_{model}_{revision}.log",
    script:
        JOB_SCRIPT
