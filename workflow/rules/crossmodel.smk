# Models side by side (App. waypoint-olmo, fig:crossmodel): with two or more models in the config, one comparison
# table (a row per model) and the cross-model waypoint figure (every sweeping model on one training-token axis).


def tokens_per_step(model):
    """Training tokens per step: the model's `tokens_per_step`, or a mini model's batch_size x context_length."""
    spec = MODELS[model]
    if spec.get("tokens_per_step"):
        return int(spec["tokens_per_step"])
    recipe = {m["name"]: m for m in (config.get("minisuite") or {}).get("models", [])}.get(model)
    if spec["source"] == "minisuite" and recipe:
        return int(recipe["batch_size"]) * int(recipe["context_length"])
    return None


def crossmodel_plotted():
    """The models on the figure's token axis: a sweep of steps and known tokens per step."""
    return [m for m in MODELS if sweeps(m) and tokens_per_step(m)]


def crossmodel_targets():
    if len(MODELS) < 2:
        return []
    t = [f"{R}/tables/crossmodel.csv", f"{R}/tables/crossmodel.md"]
    if len(crossmodel_plotted()) >= 1:
        t += [f"{R}/figures/crossmodel.pdf", f"{R}/figures/crossmodel.png"]
    return t


def last_rollout_tables(name):
    return [f"{R}/tables/{name}_{m}_{ROLLOUT_REVISIONS[m][-1]}.csv" for m in MODELS]


rule crossmodel_table:
    input:
        substitution=[f"{R}/tables/substitution_{m}.csv" for m in MODELS],
        rollout=last_rollout_tables("rollout"),
        ranking=last_rollout_tables("ranking_top"),
        fv=[f"{R}/tables/fv_{m}_{ROLLOUT_REVISIONS[m][-1]}.csv" for m in MODELS if fv_tasks(m)],
        code=code("crossmodel_table.py"),
    output:
        csv=table_report(f"{R}/tables/crossmodel.csv", "crossmodel"),
        md=f"{R}/tables/crossmodel.md",
    params:
        models=list(MODELS),
        fv_models=[m for m in MODELS if fv_tasks(m)],
        tokens_per_step={m: tokens_per_step(m) for m in MODELS},
    localrule: True
    conda:
        ENV
    benchmark:
        "logs/benchmarks/crossmodel_table/tables/crossmodel.tsv"
    log:
        "logs/tables/crossmodel.log",
    script:
        "../scripts/crossmodel_table.py"


rule figure_crossmodel:
    input:
        tables=[f"{R}/tables/substitution_{m}.csv" for m in crossmodel_plotted()],
        training=[f"{R}/minisuite/{m}/training.json" for m in crossmodel_plotted() if MODELS[m]["source"] == "minisuite"],
        code=code("plot_crossmodel.py"),
    output:
        pdf=report(f"{R}/figures/crossmodel.pdf", caption="../report/figure_crossmodel.rst", category="Figures",
                   subcategory="training"),
        png=report(f"{R}/figures/crossmodel.png", caption="../report/figure_crossmodel.rst", category="Figures",
                   subcategory="training"),
    params:
        models=crossmodel_plotted(),
        tokens_per_step={m: tokens_per_step(m) for m in crossmodel_plotted()},
        windows={m: MODELS[m].get("induction_window") for m in crossmodel_plotted()},
        band=SUBSTITUTION["induction_band"],
    localrule: True
    conda:
        ENV
    benchmark:
        "logs/benchmarks/figure_crossmodel/figures/crossmodel.tsv"
    log:
        "logs/figures/crossmodel.log",
    script:
        "../scripts/plot_crossmodel.py"
