# Rollout stage (paper Sec. 4, App. D-K): the open-loop mean-field rollout (Alg. 1) with every kernel scored
# against the held-out centroids (Table 1), the error accounting of Sec. 4.3 and App. D/H/K, the attention-mass
# coverage of App. F and the cross-corpus matrix of App. G. Statistics come from the `stats` half, the truth
# from the `eval` half (results/stats/<model>/<revision>/{stats,eval}.zarr).

ROLLOUT_DEFAULTS = {
    "kernels": ["mean_field", "context_free", "cooc", "meanq", "uniform", "rowshuffle", "P0only", "Pavg"],
    "seed": 0,
    "pin_rogue": False,
    "rogue_factor": 15.0,
    "init": "embed",
    "min_count": 1,
    "diagnostics_half": "eval",
}
ROLLOUT = {**ROLLOUT_DEFAULTS, **(config.get("rollout") or {})}

ROLLOUT_CODE = ("analysis.py", "jobs.py", "rollout.py", "kernels.py", "metrics.py", "io.py", *ADAPTERS_CODE,
                "models/loader.py", "stats/__init__.py", "stats/api.py", "stats/store.py")


def stats_store(dataset):
    return f"{R}/stats/{{model}}/{{revision}}/{dataset}.zarr"


def model_params():
    return dict(
        model_spec=model_spec,
        revision="{revision}",
        dtype=lambda wc: MODELS[wc.model].get("dtype", config["runtime"]["dtype"]),
        device=config["runtime"]["device"],
        results=R,
    )


def rollout_targets():
    """Every output of the rollout stage for the configured models and revisions."""
    t = [f"{R}/tables/coverage_attention.csv", f"{R}/tables/coverage_attention.md"]
    for m in MODELS:
        for rev in REVISIONS[m]:
            t.append(f"{R}/rollout/{m}/{rev}/scores.csv")
            for name in ("rollout", "teacher_forced", "error_decomposition", "mlp_gap", "clustering", "anisotropy",
                         "cross_corpus"):
                t += [f"{R}/tables/{name}_{m}_{rev}.csv", f"{R}/tables/{name}_{m}_{rev}.md"]
            for fig in FIGURES:
                t += [f"{R}/figures/{fig}_{m}_{rev}.pdf", f"{R}/figures/{fig}_{m}_{rev}.png"]
    return t


rule rollout_scores:
    input:
        stats=stats_store("stats"),
        eval=stats_store("eval"),
        model=model_input,
        code=code(*ROLLOUT_CODE),
    output:
        f"{R}/rollout/{{model}}/{{revision}}/scores.csv",
    params:
        kernels=ROLLOUT["kernels"],
        seed=ROLLOUT["seed"],
        pin_rogue=ROLLOUT["pin_rogue"],
        rogue_factor=ROLLOUT["rogue_factor"],
        init=ROLLOUT["init"],
        min_count=ROLLOUT["min_count"],
        **model_params(),
    threads: workflow.cores
    log:
        "logs/rollout/{model}/{revision}/scores.log",
    script:
        "../scripts/rollout_scores.py"


rule rollout_table:
    input:
        scores=f"{R}/rollout/{{model}}/{{revision}}/scores.csv",
        code=code("analysis.py", "metrics.py", "io.py"),
    output:
        csv=f"{R}/tables/rollout_{{model}}_{{revision}}.csv",
        md=f"{R}/tables/rollout_{{model}}_{{revision}}.md",
    log:
        "logs/rollout/{model}/{revision}/table.log",
    script:
        "../scripts/rollout_table.py"


def _acc(name):
    return f"{R}/tables/{name}_{{model}}_{{revision}}"


rule error_accounting:
    input:
        stats=stats_store("stats"),
        eval=stats_store("eval"),
        model=model_input,
        code=code(*ROLLOUT_CODE, "diagnostics.py"),
    output:
        teacher_forced=_acc("teacher_forced") + ".csv",
        teacher_forced_md=_acc("teacher_forced") + ".md",
        error_decomposition=_acc("error_decomposition") + ".csv",
        error_decomposition_md=_acc("error_decomposition") + ".md",
        mlp_gap=_acc("mlp_gap") + ".csv",
        mlp_gap_md=_acc("mlp_gap") + ".md",
        clustering=_acc("clustering") + ".csv",
        clustering_md=_acc("clustering") + ".md",
        anisotropy=_acc("anisotropy") + ".csv",
        anisotropy_md=_acc("anisotropy") + ".md",
    params:
        min_count=ROLLOUT["min_count"],
        diagnostics_half=ROLLOUT["diagnostics_half"],
        **model_params(),
    threads: workflow.cores
    log:
        "logs/rollout/{model}/{revision}/error_accounting.log",
    script:
        "../scripts/error_accounting.py"


rule attention_coverage:
    input:
        stats=[f"{R}/stats/{m}/{rev}/stats.zarr" for m in MODELS for rev in REVISIONS[m]],
        code=code("analysis.py", "stats/__init__.py", "stats/api.py", "stats/store.py", "tables.py", "io.py"),
    output:
        csv=f"{R}/tables/coverage_attention.csv",
        md=f"{R}/tables/coverage_attention.md",
    log:
        "logs/tables/coverage_attention.log",
    script:
        "../scripts/attention_coverage.py"


rule cross_corpus:
    input:
        stats=[stats_store(ds) for c in CORPORA for ds in datasets(c) if ds.endswith("stats")],
        eval=[stats_store(ds) for c in CORPORA for ds in datasets(c) if ds.endswith("eval")],
        model=model_input,
        code=code(*ROLLOUT_CODE),
    output:
        scores=f"{R}/rollout/{{model}}/{{revision}}/cross_corpus_scores.csv",
        csv=f"{R}/tables/cross_corpus_{{model}}_{{revision}}.csv",
        md=f"{R}/tables/cross_corpus_{{model}}_{{revision}}.md",
    params:
        corpora=list(CORPORA),
        primary=CORPUS,
        init=ROLLOUT["init"],
        min_count=ROLLOUT["min_count"],
        **model_params(),
    threads: workflow.cores
    log:
        "logs/rollout/{model}/{revision}/cross_corpus.log",
    script:
        "../scripts/cross_corpus.py"
