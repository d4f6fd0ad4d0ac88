# Head ranking (paper Sec. 6.1 Exp. 3, Sec. 6.3, App. O; library mfpipe.experiments.ranking), from pass 2's deviation
# stores (workflow/rules/deviation.smk). Per revision of each model's `revisions`: the behavioural head scores; per
# model the Exp. 3 correlation across training; per rollout revision the ranking.
#   snakemake --cores 2 results/figures/ccmf_scatter_mini-gpt2_final.png

RANKING = config["ranking"]


rule head_scores:
    input:
        model=model_input,
        tokenizer=tokenizer_input,
        code=job("experiments.ranking", "head_scores"),
    output:
        csv=f"{R}/heads/{{model}}/{{revision}}/head_scores.csv",
    params:
        n_sequences=RANKING["head_scores"]["n_sequences"],
        seed=RANKING["head_scores"]["seed"],
        context_length=config["corpus"]["context_length"],
        batch_size=config["runtime"]["batch_size"],
        **model_params(),
    threads: model_threads
    resources:
        **cluster_resources("forward"),
    conda:
        ENV
    benchmark:
        "logs/benchmarks/head_scores/heads/{model}/{revision}.tsv",
    log:
        "logs/heads/{model}/{revision}.log",
    script:
        JOB_SCRIPT


rule exp3_correlation:
    input:
        deviation=lambda wc: ranking_rules.deviation_results(PLAN, wc),
        heads=lambda wc: ranking_rules.head_score_results(PLAN, wc),
        training=lambda wc: minisuite_rules.training_summary(PLAN, wc),
        code=job("experiments.ranking", "exp3_correlation"),
    output:
        csv=table_report(f"{R}/tables/exp3_correlation_{{model}}.csv", "head ranking"),
        pdf=report(f"{R}/figures/exp3_correlation_{{model}}.pdf", caption="../report/figure_exp3.rst",
                   category="Figures", subcategory="head ranking"),
        png=report(f"{R}/figures/exp3_correlation_{{model}}.png", caption="../report/figure_exp3.rst",
                   category="Figures", subcategory="head ranking"),
    params:
        model=lambda wc: wc.model,
        revisions=lambda wc: REVISIONS[wc.model],
        steps=lambda wc: PLAN.revision_steps(wc.model),
        window=lambda wc: MODELS[wc.model].get("induction_window"),
        band=config["substitution"]["induction_band"],
        title=lambda wc: f"Mean-field deviation vs induction score: {wc.model}",
    localrule: True
    conda:
        ENV
    benchmark:
        "logs/benchmarks/exp3_correlation/figures/exp3_correlation_{model}.tsv",
    log:
        "logs/figures/exp3_correlation_{model}.log",
    script:
        JOB_SCRIPT


rule ranking:
    input:
        deviation=STORE("deviation"),
        heads=f"{R}/heads/{{model}}/{{revision}}/head_scores.csv",
        # natural against repeated text (App. readings), where the model runs the positional slice
        rises=lambda wc: positional_rules.repeated_input(PLAN, wc),
        code=job("experiments.ranking", "ranking"),
    output:
        heads=f"{R}/tables/ranking_heads_{{model}}_{{revision}}.csv",
        top_csv=table_report(f"{R}/tables/ranking_top_{{model}}_{{revision}}.csv", "head ranking"),
        top_md=f"{R}/tables/ranking_top_{{model}}_{{revision}}.md",
        bottom_csv=table_report(f"{R}/tables/ranking_bottom_{{model}}_{{revision}}.csv", "head ranking"),
        bottom_md=f"{R}/tables/ranking_bottom_{{model}}_{{revision}}.md",
        stability_csv=table_report(f"{R}/tables/ranking_stability_{{model}}_{{revision}}.csv", "head ranking"),
        stability_md=f"{R}/tables/ranking_stability_{{model}}_{{revision}}.md",
        pdf=report(f"{R}/figures/ccmf_scatter_{{model}}_{{revision}}.pdf", caption="../report/figure_ccmf_scatter.rst",
                   category="Figures", subcategory="head ranking"),
        png=report(f"{R}/figures/ccmf_scatter_{{model}}_{{revision}}.png", caption="../report/figure_ccmf_scatter.rst",
                   category="Figures", subcategory="head ranking"),
    params:
        model=lambda wc: wc.model,
        revision="{revision}",
        top=RANKING["top"],
        bottom=RANKING["bottom"],
    localrule: True
    conda:
        ENV
    benchmark:
        "logs/benchmarks/ranking/tables/ranking_{model}_{revision}.tsv",
    log:
        "logs/tables/ranking_{model}_{revision}.log",
    script:
        JOB_SCRIPT


# Sec. 6.3 "circuits straddle the ranking": each behavioural role's top heads and their place in the S-bar ranking
rule ranking_roles:
    input:
        heads=f"{R}/tables/ranking_heads_{{model}}_{{revision}}.csv",
        stats=STORE("stats", dataset="stats"),
        code=job("experiments.ranking", "ranking_roles"),
    output:
        csv=table_report(f"{R}/tables/ranking_roles_{{model}}_{{revision}}.csv", "head ranking",
                         "table_ranking_roles"),
        md=f"{R}/tables/ranking_roles_{{model}}_{{revision}}.md",
    params:
        model=lambda wc: wc.model,
        revision="{revision}",
        top=RANKING["role_top"],
    localrule: True
    conda:
        ENV
    benchmark:
        "logs/benchmarks/ranking_roles/tables/ranking_roles_{model}_{revision}.tsv",
    log:
        "logs/tables/ranking_roles_{model}_{revision}.log",
    script:
        JOB_SCRIPT


# tab:gemma: Exp. 3's S-bar / induction correlation at the rollout revision, for every model (no sweep needed)
rule exp3_single:
    input:
        heads=f"{R}/tables/ranking_heads_{{model}}_{{revision}}.csv",
        code=job("experiments.ranking", "exp3_single"),
    output:
        csv=table_report(f"{R}/tables/exp3_single_{{model}}_{{revision}}.csv", "head ranking",
                         "table_exp3_single"),
        md=f"{R}/tables/exp3_single_{{model}}_{{revision}}.md",
    localrule: True
    conda:
        ENV
    benchmark:
        "logs/benchmarks/exp3_single/tables/exp3_single_{model}_{revision}.tsv",
    log:
        "logs/tables/exp3_single_{model}_{revision}.log",
    script:
        JOB_SCRIPT
