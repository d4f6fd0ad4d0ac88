# Rollout stage (paper Sec. 4, App. D-K): the open-loop mean-field rollout (Alg. 1) with every kernel scored
# against the held-out centroids (Table 1), the error accounting of Sec. 4.3 and App. D/H/K, the attention-mass
# coverage of App. F and the cross-corpus matrix of App. G. Statistics come from the `stats` half, the truth
# from the `eval` half (results/stats/<model>/<revision>/{stats,eval}.zarr).

ROLLOUT = config["rollout"]  # defaults filled from the schema (common.smk)


rule rollout_scores:
    input:
        stats=stats_store("stats"),
        eval=stats_store("eval"),
        model=model_input,
        code=code("rollout_scores.py"),
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
    threads: model_threads
    resources:
        **cluster_resources("forward"),
    conda:
        ENV
    benchmark:
        "logs/benchmarks/rollout_scores/rollout/{model}/{revision}/scores.tsv",
    log:
        "logs/rollout/{model}/{revision}/scores.log",
    script:
        "../scripts/rollout_scores.py"


rule rollout_table:
    input:
        scores=f"{R}/rollout/{{model}}/{{revision}}/scores.csv",
        code=code("rollout_table.py"),
    output:
        csv=table_report(f"{R}/tables/rollout_{{model}}_{{revision}}.csv", "rollout"),
        md=f"{R}/tables/rollout_{{model}}_{{revision}}.md",
    localrule: True
    conda:
        ENV
    benchmark:
        "logs/benchmarks/rollout_table/rollout/{model}/{revision}/table.tsv",
    log:
        "logs/rollout/{model}/{revision}/table.log",
    script:
        "../scripts/rollout_table.py"


rule error_accounting:
    input:
        stats=stats_store("stats"),
        eval=stats_store("eval"),
        deviation=f"{R}/deviation/{{model}}/{{revision}}/deviation.zarr",  # pass 2: the paper's estimator (b)
        model=model_input,
        code=code("error_accounting.py"),
    output:
        teacher_forced=table_report(table_stem("teacher_forced") + ".csv", "teacher_forced"),
        teacher_forced_md=table_stem("teacher_forced") + ".md",
        error_decomposition=table_report(table_stem("error_decomposition") + ".csv", "error_decomposition"),
        error_decomposition_md=table_stem("error_decomposition") + ".md",
        mlp_gap=table_report(table_stem("mlp_gap") + ".csv", "mlp_gap"),
        mlp_gap_md=table_stem("mlp_gap") + ".md",
        clustering=table_report(table_stem("clustering") + ".csv", "clustering"),
        clustering_md=table_stem("clustering") + ".md",
        anisotropy=table_report(table_stem("anisotropy") + ".csv", "anisotropy"),
        anisotropy_md=table_stem("anisotropy") + ".md",
    params:
        min_count=ROLLOUT["min_count"],
        diagnostics_half=ROLLOUT["diagnostics_half"],
        **model_params(),
    threads: model_threads
    resources:
        **cluster_resources("forward"),
    conda:
        ENV
    benchmark:
        "logs/benchmarks/error_accounting/rollout/{model}/{revision}/error_accounting.tsv",
    log:
        "logs/rollout/{model}/{revision}/error_accounting.log",
    script:
        "../scripts/error_accounting.py"


rule attention_coverage:
    input:
        stats=[f"{R}/stats/{m}/{rev}/stats.zarr" for m in MODELS for rev in ROLLOUT_REVISIONS[m]],
        code=code("attention_coverage.py"),
    output:
        csv=table_report(f"{R}/tables/coverage_attention.csv", "coverage"),
        md=f"{R}/tables/coverage_attention.md",
    localrule: True
    conda:
        ENV
    benchmark:
        "logs/benchmarks/attention_coverage/tables/coverage_attention.tsv",
    log:
        "logs/tables/coverage_attention.log",
    script:
        "../scripts/attention_coverage.py"


rule cross_corpus:
    input:
        stats=[stats_store(ds) for c in CORPORA for ds in datasets(c) if ds.endswith("stats")],
        eval=[stats_store(ds) for c in CORPORA for ds in datasets(c) if ds.endswith("eval")],
        model=model_input,
        code=code("cross_corpus.py"),
    output:
        scores=f"{R}/rollout/{{model}}/{{revision}}/cross_corpus_scores.csv",
        csv=table_report(f"{R}/tables/cross_corpus_{{model}}_{{revision}}.csv", "cross_corpus"),
        md=f"{R}/tables/cross_corpus_{{model}}_{{revision}}.md",
    params:
        corpora=list(CORPORA),
        primary=CORPUS,
        init=ROLLOUT["init"],
        min_count=ROLLOUT["min_count"],
        **model_params(),
    threads: model_threads
    resources:
        **cluster_resources("forward"),
    conda:
        ENV
    benchmark:
        "logs/benchmarks/cross_corpus/rollout/{model}/{revision}/cross_corpus.tsv",
    log:
        "logs/rollout/{model}/{revision}/cross_corpus.log",
    script:
        "../scripts/cross_corpus.py"


# The rollout figures: one target per figure, results/figures/<name>_<model>_<revision>.{pdf,png}. Each rule reads only
# its result table (CSV), so deleting a figure reruns only its plotting job:
#   snakemake --cores 1 results/figures/rollout_mini-gpt2_step2400.png

FIGURES = {
    # figure name: (table it is drawn from, title)
    "rollout": (f"{R}/rollout/{{model}}/{{revision}}/scores.csv",
                "Mean-field rollout vs alternative kernels: {model} @ {revision}"),
    "teacher_forced": (f"{R}/tables/teacher_forced_{{model}}_{{revision}}.csv",
                       "Teacher-forced attention output: {model} @ {revision}"),
    "error_decomposition": (f"{R}/tables/error_decomposition_{{model}}_{{revision}}.csv",
                            "Per-layer error accounting: {model} @ {revision}"),
    "clustering": (f"{R}/tables/clustering_{{model}}_{{revision}}.csv",
                   "Within-type clustering: {model} @ {revision}"),
    "cross_corpus": (f"{R}/tables/cross_corpus_{{model}}_{{revision}}.csv",
                     "Cross-corpus rollout (centered cosine): {model} @ {revision}"),
}


for _fig, (_table, _title) in FIGURES.items():

    rule:
        name:
            f"figure_{_fig}"
        input:
            table=_table,
            code=code("plot_figure.py"),
        output:
            pdf=report(f"{R}/figures/{_fig}_{{model}}_{{revision}}.pdf", caption=f"../report/figure_{_fig}.rst",
                       category="Figures", subcategory="{model} @ {revision}"),
            png=report(f"{R}/figures/{_fig}_{{model}}_{{revision}}.png", caption=f"../report/figure_{_fig}.rst",
                       category="Figures", subcategory="{model} @ {revision}"),
        params:
            kind=_fig,
            title=_title,
        localrule: True
        conda:
            ENV
        benchmark:
            f"logs/benchmarks/figure_{_fig}/figures/{_fig}_{{model}}_{{revision}}.tsv",
        log:
            f"logs/figures/{_fig}_{{model}}_{{revision}}.log",
        script:
            "../scripts/plot_figure.py"
