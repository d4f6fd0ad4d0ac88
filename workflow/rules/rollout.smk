# Rollout stage (paper Sec. 4, App. D-K): the open-loop mean-field rollout (Alg. 1) with every kernel scored
# against the held-out centroids (Table 1), the error accounting of Sec. 4.3 and App. D/H/K, the attention-mass
# coverage of App. F and the cross-corpus matrix of App. G. Statistics come from the `stats` half, the truth
# from the `eval` half (results/stats/<model>/<revision>/{stats,eval}.zarr). Library: mfpipe.experiments.rollout (its
# jobs in jobs.py, its targets and figures in rules.py).

ROLLOUT = config["rollout"]  # defaults filled from the schema (common.smk)
DIVERGENCE_REPORTED = ("steps", "curvature", "units", "tokens", "pairs_summary")


rule rollout_scores:
    input:
        stats=STORE("stats", dataset="stats"),
        eval=STORE("stats", dataset="eval"),
        model=model_input,
        code=job("experiments.rollout", "rollout_scores"),
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
        JOB_SCRIPT


rule rollout_table:
    input:
        scores=f"{R}/rollout/{{model}}/{{revision}}/scores.csv",
        code=job("experiments.rollout", "rollout_table"),
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
        JOB_SCRIPT


rule error_accounting:
    input:
        stats=STORE("stats", dataset="stats"),
        eval=STORE("stats", dataset="eval"),
        deviation=STORE("deviation"),  # pass 2: the paper's estimator (b)
        model=model_input,
        code=job("experiments.rollout", "error_accounting"),
    output:
        teacher_forced=table_report(rollout_rules.table_stem(PLAN, "teacher_forced") + ".csv", "teacher_forced"),
        teacher_forced_md=rollout_rules.table_stem(PLAN, "teacher_forced") + ".md",
        error_decomposition=table_report(rollout_rules.table_stem(PLAN, "error_decomposition") + ".csv",
                                         "error_decomposition"),
        error_decomposition_md=rollout_rules.table_stem(PLAN, "error_decomposition") + ".md",
        mlp_gap=table_report(rollout_rules.table_stem(PLAN, "mlp_gap") + ".csv", "mlp_gap"),
        mlp_gap_md=rollout_rules.table_stem(PLAN, "mlp_gap") + ".md",
        clustering=table_report(rollout_rules.table_stem(PLAN, "clustering") + ".csv", "clustering"),
        clustering_md=rollout_rules.table_stem(PLAN, "clustering") + ".md",
        anisotropy=table_report(rollout_rules.table_stem(PLAN, "anisotropy") + ".csv", "anisotropy"),
        anisotropy_md=rollout_rules.table_stem(PLAN, "anisotropy") + ".md",
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
        JOB_SCRIPT


rule attention_coverage:
    input:
        stats=[STORE("stats", model=m, revision=rev, dataset="stats") for m in MODELS for rev in ROLLOUT_REVISIONS[m]],
        code=job("experiments.rollout", "attention_coverage"),
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
        JOB_SCRIPT


rule cross_corpus:
    input:
        stats=[STORE("stats", dataset=ds) for c in CORPORA for ds in datasets(c) if ds.endswith("stats")],
        eval=[STORE("stats", dataset=ds) for c in CORPORA for ds in datasets(c) if ds.endswith("eval")],
        model=model_input,
        code=job("experiments.rollout", "cross_corpus"),
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
        JOB_SCRIPT


# App. llama: the rollout's divergence diagnostics (per-step amplification, curvature, MLP units, per-token
# amplification, centred magnitude, capitalisation pairs); App. I: the layer-localized substitution, the rogue
# dimensions and every kernel pinned vs unpinned. Statistics half -> kernel and start; evaluation half -> truth.
rule rollout_divergence:
    input:
        stats=STORE("stats", dataset="stats"),
        eval=STORE("stats", dataset="eval"),
        model=model_input,
        code=job("experiments.rollout", "rollout_divergence"),
    output:
        # the per-step, curvature, units, per-token and pairs tables in the report with their captions
        **{k: table_report(v, "rollout divergence", f"table_divergence_{k}") if k in DIVERGENCE_REPORTED else v
           for k, v in rollout_rules.divergence_outputs(PLAN).items()},
        md=f"{R}/tables/divergence_{{model}}_{{revision}}.md",
    params:
        divergence=ROLLOUT["divergence"],
        seed=ROLLOUT["seed"],
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
        "logs/benchmarks/rollout_divergence/rollout/{model}/{revision}/divergence.tsv",
    log:
        "logs/rollout/{model}/{revision}/divergence.log",
    script:
        JOB_SCRIPT


rule rollout_localized:
    input:
        stats=STORE("stats", dataset="stats"),
        eval=STORE("stats", dataset="eval"),
        model=model_input,
        code=job("experiments.rollout", "rollout_localized"),
    output:
        localized=table_report(f"{R}/tables/layer_localized_{{model}}_{{revision}}.csv", "rollout kernels",
                               "table_layer_localized"),
        localized_md=f"{R}/tables/layer_localized_{{model}}_{{revision}}.md",
        rogue=table_report(f"{R}/tables/rogue_dims_{{model}}_{{revision}}.csv", "rollout kernels", "table_rogue_dims"),
        rogue_md=f"{R}/tables/rogue_dims_{{model}}_{{revision}}.md",
        pinning=table_report(f"{R}/tables/pinning_{{model}}_{{revision}}.csv", "rollout kernels", "table_pinning"),
        pinning_md=f"{R}/tables/pinning_{{model}}_{{revision}}.md",
    params:
        localized=ROLLOUT["localized"],
        kernels=ROLLOUT["kernels"],
        seed=ROLLOUT["seed"],
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
        "logs/benchmarks/rollout_localized/rollout/{model}/{revision}/localized.tsv",
    log:
        "logs/rollout/{model}/{revision}/localized.log",
    script:
        JOB_SCRIPT


rule figure_divergence:
    input:
        steps=f"{R}/tables/divergence_{{model}}_{{revision}}.csv",
        curvature=f"{R}/tables/divergence_curvature_{{model}}_{{revision}}.csv",
        tokens=f"{R}/tables/divergence_tokens_{{model}}_{{revision}}.csv",
        magnitude=f"{R}/tables/divergence_magnitude_{{model}}_{{revision}}.csv",
        code=job("experiments.rollout", "figure_divergence"),
    output:
        pdf=report(f"{R}/figures/divergence_{{model}}_{{revision}}.pdf", caption="../report/figure_divergence.rst",
                   category="Figures", subcategory="{model} @ {revision}"),
        png=report(f"{R}/figures/divergence_{{model}}_{{revision}}.png", caption="../report/figure_divergence.rst",
                   category="Figures", subcategory="{model} @ {revision}"),
    params:
        title="Rollout divergence: {model} @ {revision}",
    localrule: True
    conda:
        ENV
    benchmark:
        "logs/benchmarks/figure_divergence/figures/divergence_{model}_{revision}.tsv",
    log:
        "logs/figures/divergence_{model}_{revision}.log",
    script:
        JOB_SCRIPT


# The rollout figures: one target per figure, results/figures/<name>_<model>_<revision>.{pdf,png}. Each rule reads only
# its result table (CSV), so deleting a figure reruns only its plotting job:
#   snakemake --cores 1 results/figures/rollout_mini-gpt2_step2400.png

for _fig, (_table, _title) in rollout_rules.figures(PLAN).items():

    rule:
        name:
            f"figure_{_fig}"
        input:
            table=_table,
            code=job("experiments.rollout", "plot_figure"),
        output:
            pdf=report(f"{R}/figures/{_fig}_{{model}}_{{revision}}.pdf", caption=f"../report/figure_{_fig}.rst",
                       category="Figures", subcategory="{model} @ {revision}"),
            png=report(f"{R}/figures/{_fig}_{{model}}_{{revision}}.png", caption=f"../report/figure_{_fig}.rst",
                       category="Figures", subcategory="{model} @ {revision}"),
        params:
            kind=_fig,
            title=_title,
            job_function="plot_figure",
        localrule: True
        conda:
            ENV
        benchmark:
            f"logs/benchmarks/figure_{_fig}/figures/{_fig}_{{model}}_{{revision}}.tsv",
        log:
            f"logs/figures/{_fig}_{{model}}_{{revision}}.log",
        script:
            JOB_SCRIPT
