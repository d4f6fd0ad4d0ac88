# Models side by side (App. waypoint-olmo, fig:crossmodel): with two or more models in the config, one comparison
# table (a row per model) and the cross-model waypoint figure (every sweeping model on one training-token axis).


rule crossmodel_table:
    input:
        substitution=[f"{R}/tables/substitution_{m}.csv" for m in MODELS],
        rollout=crossmodel_rules.last_rollout_tables(PLAN, "rollout"),
        ranking=crossmodel_rules.last_rollout_tables(PLAN, "ranking_top"),
        fv=[f"{R}/tables/fv_{m}_{ROLLOUT_REVISIONS[m][-1]}.csv" for m in MODELS if fv_rules.fv_tasks(PLAN, m)],
        code=job("experiments.crossmodel", "crossmodel_table"),
    output:
        csv=table_report(f"{R}/tables/crossmodel.csv", "crossmodel"),
        md=f"{R}/tables/crossmodel.md",
    params:
        models=list(MODELS),
        fv_models=[m for m in MODELS if fv_rules.fv_tasks(PLAN, m)],
        tokens_per_step={m: crossmodel_rules.tokens_per_step(PLAN, m) for m in MODELS},
    localrule: True
    conda:
        ENV
    benchmark:
        "logs/benchmarks/crossmodel_table/tables/crossmodel.tsv"
    log:
        "logs/tables/crossmodel.log",
    script:
        JOB_SCRIPT


rule figure_crossmodel:
    input:
        tables=[f"{R}/tables/substitution_{m}.csv" for m in crossmodel_rules.plotted(PLAN)],
        training=[f"{R}/minisuite/{m}/training.json" for m in crossmodel_rules.plotted(PLAN) if MODELS[m]["source"] == "minisuite"],
        code=job("experiments.crossmodel", "figure_crossmodel"),
    output:
        pdf=report(f"{R}/figures/crossmodel.pdf", caption="../report/figure_crossmodel.rst", category="Figures",
                   subcategory="training"),
        png=report(f"{R}/figures/crossmodel.png", caption="../report/figure_crossmodel.rst", category="Figures",
                   subcategory="training"),
    params:
        models=crossmodel_rules.plotted(PLAN),
        tokens_per_step={m: crossmodel_rules.tokens_per_step(PLAN, m) for m in crossmodel_rules.plotted(PLAN)},
        windows={m: MODELS[m].get("induction_window") for m in crossmodel_rules.plotted(PLAN)},
        band=config["substitution"]["induction_band"],
    localrule: True
    conda:
        ENV
    benchmark:
        "logs/benchmarks/figure_crossmodel/figures/crossmodel.tsv"
    log:
        "logs/figures/crossmodel.log",
    script:
        JOB_SCRIPT
