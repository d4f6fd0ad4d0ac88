# Figures: one target per figure, results/figures/<name>_<model>_<revision>.{pdf,png}. Each rule reads only
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
        log:
            f"logs/figures/{_fig}_{{model}}_{{revision}}.log",
        script:
            "../scripts/plot_figure.py"
