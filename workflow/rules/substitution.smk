# The training sweep (paper Sec. 5): per revision of each model's `revisions`, the mean-field substitution on
# held-out text (its own job: a new revision adds jobs, the others stay built); per model, the sweep table and
# the training-waypoint figure (fig:mfgap).
#   snakemake --cores 2 results/figures/waypoint_mini-gpt2.png


rule substitution:
    input:
        stats=f"{R}/stats/{{model}}/{{revision}}/stats.zarr",
        shards=f"{R}/corpus/{CORPUS}/{{model}}/shards",
        tracked=f"{R}/corpus/{CORPUS}/{{model}}/tracked.json",
        model=model_input,
        kernel=substitution_kernel_input,
        code=code("substitution.py"),
    output:
        directory(f"{R}/substitution/{{model}}/{{revision}}/substitution.zarr"),
    params:
        eval_tokens=SUBSTITUTION["eval_tokens"],
        kernel=SUBSTITUTION["kernel"],
        min_count=SUBSTITUTION["min_count"],
        batch_size=SUBSTITUTION["batch_size"] or config["runtime"]["batch_size"],
        **model_params(),
    threads: cluster_threads("forward")
    resources:
        **cluster_resources("forward"),
    conda:
        ENV
    log:
        "logs/substitution/{model}/{revision}.log",
    script:
        "../scripts/substitution.py"


rule substitution_table:
    input:
        results=substitution_results,
        code=code("substitution_table.py"),
    output:
        csv=table_report(f"{R}/tables/substitution_{{model}}.csv", "substitution"),
        md=f"{R}/tables/substitution_{{model}}.md",
        heads=f"{R}/tables/substitution_heads_{{model}}.csv",
    params:
        model=lambda wc: wc.model,
        revisions=lambda wc: REVISIONS[wc.model],
        steps=lambda wc: revision_steps(wc.model),
    localrule: True
    conda:
        ENV
    log:
        "logs/tables/substitution_{model}.log",
    script:
        "../scripts/substitution_table.py"


rule figure_waypoint:
    input:
        table=f"{R}/tables/substitution_{{model}}.csv",
        training=training_summary,
        code=code("plot_waypoint.py"),
    output:
        pdf=report(f"{R}/figures/waypoint_{{model}}.pdf", caption="../report/figure_waypoint.rst",
                   category="Figures", subcategory="training"),
        png=report(f"{R}/figures/waypoint_{{model}}.png", caption="../report/figure_waypoint.rst",
                   category="Figures", subcategory="training"),
    params:
        window=lambda wc: MODELS[wc.model].get("induction_window"),
        band=SUBSTITUTION["induction_band"],
        title=lambda wc: f"Mean-field substitution across training: {wc.model}",
    localrule: True
    conda:
        ENV
    log:
        "logs/figures/waypoint_{model}.log",
    script:
        "../scripts/plot_waypoint.py"
