# Positional transport (paper App. positional) and the lens survey's repeated-text and type-class readings (App.
# protocol, App. readings); library mfpipe.experiments.positional. Per rollout revision of each model that runs it
# (`positional.models`): one forward job collects the eval half's query occurrences and writes every head's posVar,
# the cluster's readings, the repeated-text rises (merged into the ranking tables) and the type-class test; a second
# runs the dereferencing ablation on the subspace the first found; the figure is drawn from the tables.
#   snakemake --cores 2 results/tables/positional_mini-gpt2_step1500.md


rule positional:
    input:
        stats=STORE("stats", dataset="stats"),
        shards=f"{R}/corpus/{CORPUS}/{{model}}/shards",
        tracked=f"{R}/corpus/{CORPUS}/{{model}}/tracked.json",
        deviation=STORE("deviation"),
        model=model_input,
        tokenizer=tokenizer_input,
        code=job("experiments.positional", "positional"),
    output:
        heads=table_report(f"{R}/tables/positional_{{model}}_{{revision}}.csv", "positional transport",
                           "table_positional"),
        heads_md=f"{R}/tables/positional_{{model}}_{{revision}}.md",
        cluster=f"{R}/positional/{{model}}/{{revision}}/cluster.csv",
        overlaps=f"{R}/positional/{{model}}/{{revision}}/overlaps.csv",
        curves=f"{R}/positional/{{model}}/{{revision}}/curves.csv",
        subspace=f"{R}/positional/{{model}}/{{revision}}/subspace.npz",
        repeated=table_report(f"{R}/tables/positional_repeated_{{model}}_{{revision}}.csv", "positional transport",
                              "table_positional_repeated"),
        repeated_md=f"{R}/tables/positional_repeated_{{model}}_{{revision}}.md",
        classes=table_report(f"{R}/tables/positional_classes_{{model}}_{{revision}}.csv", "positional transport",
                             "table_positional_classes"),
        classes_md=f"{R}/tables/positional_classes_{{model}}_{{revision}}.md",
        info=f"{R}/positional/{{model}}/{{revision}}/info.json",
    params:
        positional=lambda wc: positional_rules.settings(PLAN),
        batch_size=config["positional"]["batch_size"] or config["runtime"]["batch_size"],
        **model_params(),
    threads: model_threads
    resources:
        **cluster_resources("forward"),
    conda:
        ENV
    benchmark:
        "logs/benchmarks/positional/positional/{model}/{revision}.tsv",
    log:
        "logs/positional/{model}/{revision}.log",
    script:
        JOB_SCRIPT


rule positional_ablation:
    input:
        stats=STORE("stats", dataset="stats"),
        shards=f"{R}/corpus/{CORPUS}/{{model}}/shards",
        tracked=f"{R}/corpus/{CORPUS}/{{model}}/tracked.json",
        subspace=f"{R}/positional/{{model}}/{{revision}}/subspace.npz",
        model=model_input,
        tokenizer=tokenizer_input,
        code=job("experiments.positional", "positional_ablation"),
    output:
        arms=table_report(f"{R}/tables/positional_ablation_{{model}}_{{revision}}.csv", "positional transport",
                          "table_positional_ablation"),
        md=f"{R}/tables/positional_ablation_{{model}}_{{revision}}.md",
        categories=f"{R}/positional/{{model}}/{{revision}}/ablation_categories.csv",
        consumers=f"{R}/positional/{{model}}/{{revision}}/ablation_consumers.csv",
        info=f"{R}/positional/{{model}}/{{revision}}/ablation.json",
    params:
        positional=lambda wc: positional_rules.settings(PLAN),
        batch_size=config["positional"]["batch_size"] or config["runtime"]["batch_size"],
        **model_params(),
    threads: model_threads
    resources:
        **cluster_resources("forward"),
    conda:
        ENV
    benchmark:
        "logs/benchmarks/positional_ablation/positional/{model}/{revision}.tsv",
    log:
        "logs/positional/{model}/{revision}_ablation.log",
    script:
        JOB_SCRIPT


# Fig. positional from the positional table and its curves (deleting it reruns only this job):
#   snakemake --cores 1 results/figures/positional_mini-gpt2_step1500.png
rule figure_positional:
    input:
        heads=f"{R}/tables/positional_{{model}}_{{revision}}.csv",
        curves=f"{R}/positional/{{model}}/{{revision}}/curves.csv",
        code=job("experiments.positional", "figure_positional"),
    output:
        pdf=report(f"{R}/figures/positional_{{model}}_{{revision}}.pdf", caption="../report/figure_positional.rst",
                   category="Figures", subcategory="positional transport"),
        png=report(f"{R}/figures/positional_{{model}}_{{revision}}.png", caption="../report/figure_positional.rst",
                   category="Figures", subcategory="positional transport"),
    params:
        title="{model} @ {revision}",
    localrule: True
    conda:
        ENV
    benchmark:
        "logs/benchmarks/figure_positional/figures/positional_{model}_{revision}.tsv",
    log:
        "logs/figures/positional_{model}_{revision}.log",
    script:
        JOB_SCRIPT
