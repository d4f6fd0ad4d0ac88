# The training sweep (paper Sec. 5): per revision of each model's `revisions`, the mean-field substitution on
# held-out text and the kernel summary (each its own job: a new revision adds jobs, the others stay built); per
# model, the sweep table, the training-waypoint figure (fig:mfgap) and the kernel dynamics (fig:cka,
# fig:spread); per rollout revision, the bias of the context-conditional kernel and its calibration (App. B).
# Library: mfpipe.experiments.substitution (its jobs in jobs.py, its targets and input functions in rules.py).
#   snakemake --cores 2 results/figures/waypoint_mini-gpt2.png

SUBSTITUTION = config["substitution"]
KERNELS = config["substitution"]["kernels"]


rule substitution:
    input:
        stats=STORE("stats", dataset="stats"),
        shards=f"{R}/corpus/{CORPUS}/{{model}}/shards",
        tracked=f"{R}/corpus/{CORPUS}/{{model}}/tracked.json",
        model=model_input,
        kernel=PLAN.kernel_input(SUBSTITUTION["kernel"]),
        code=job("experiments.substitution", "substitution"),
    output:
        directory(STORE("substitution")),
    params:
        eval_tokens=SUBSTITUTION["eval_tokens"],
        kernel=SUBSTITUTION["kernel"],
        min_count=SUBSTITUTION["min_count"],
        batch_size=SUBSTITUTION["batch_size"] or config["runtime"]["batch_size"],
        **model_params(),
    threads: model_threads
    resources:
        **cluster_resources("forward"),
    conda:
        ENV
    benchmark:
        "logs/benchmarks/substitution/substitution/{model}/{revision}.tsv",
    log:
        "logs/substitution/{model}/{revision}.log",
    script:
        JOB_SCRIPT


rule substitution_table:
    input:
        results=lambda wc: substitution_rules.substitution_results(PLAN, wc),
        code=job("experiments.substitution", "substitution_table"),
    output:
        csv=table_report(f"{R}/tables/substitution_{{model}}.csv", "substitution"),
        md=f"{R}/tables/substitution_{{model}}.md",
        heads=f"{R}/tables/substitution_heads_{{model}}.csv",
    params:
        model=lambda wc: wc.model,
        revisions=lambda wc: REVISIONS[wc.model],
        steps=lambda wc: PLAN.revision_steps(wc.model),
    localrule: True
    conda:
        ENV
    benchmark:
        "logs/benchmarks/substitution_table/tables/substitution_{model}.tsv",
    log:
        "logs/tables/substitution_{model}.log",
    script:
        JOB_SCRIPT


rule figure_waypoint:
    input:
        table=f"{R}/tables/substitution_{{model}}.csv",
        training=lambda wc: minisuite_rules.training_summary(PLAN, wc),
        code=job("experiments.substitution", "figure_waypoint"),
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
    benchmark:
        "logs/benchmarks/figure_waypoint/figures/waypoint_{model}.tsv",
    log:
        "logs/figures/waypoint_{model}.log",
    script:
        JOB_SCRIPT


rule kernel_revision:
    input:
        stats=STORE("stats", dataset="stats"),
        code=job("experiments.substitution", "kernel_revision"),
    output:
        directory(STORE("kernel")),
    params:
        model=lambda wc: wc.model,
        revision="{revision}",
        min_count=KERNELS["min_count"],
        rank=KERNELS["rank"],
    threads: 1
    resources:
        **cluster_resources("cpu"),
    conda:
        ENV
    benchmark:
        "logs/benchmarks/kernel_revision/kernels/{model}/{revision}/kernel.tsv",
    log:
        "logs/kernels/{model}/{revision}/kernel.log",
    script:
        JOB_SCRIPT


rule kernel_dynamics:
    input:
        kernels=lambda wc: substitution_rules.kernel_results(PLAN, wc),
        training=lambda wc: minisuite_rules.training_summary(PLAN, wc),
        code=job("experiments.substitution", "kernel_dynamics"),
    output:
        cka=table_report(f"{R}/tables/kernel_cka_{{model}}.csv", "kernel dynamics"),
        adjacent=table_report(f"{R}/tables/kernel_cka_adjacent_{{model}}.csv", "kernel dynamics"),
        spread=table_report(f"{R}/tables/kernel_spread_{{model}}.csv", "kernel dynamics"),
        cka_pdf=report(f"{R}/figures/kernel_cka_{{model}}.pdf", caption="../report/figure_kernel_cka.rst",
                       category="Figures", subcategory="training"),
        cka_png=report(f"{R}/figures/kernel_cka_{{model}}.png", caption="../report/figure_kernel_cka.rst",
                       category="Figures", subcategory="training"),
        spread_pdf=report(f"{R}/figures/kernel_spread_{{model}}.pdf", caption="../report/figure_kernel_spread.rst",
                          category="Figures", subcategory="training"),
        spread_png=report(f"{R}/figures/kernel_spread_{{model}}.png", caption="../report/figure_kernel_spread.rst",
                          category="Figures", subcategory="training"),
    params:
        model=lambda wc: wc.model,
        revisions=lambda wc: REVISIONS[wc.model],
        steps=lambda wc: PLAN.revision_steps(wc.model),
        window=lambda wc: MODELS[wc.model].get("induction_window"),
        band=SUBSTITUTION["induction_band"],
    localrule: True
    conda:
        ENV
    benchmark:
        "logs/benchmarks/kernel_dynamics/kernels/{model}/dynamics.tsv",
    log:
        "logs/kernels/{model}/dynamics.log",
    script:
        JOB_SCRIPT


rule calibrate_kernel:
    input:
        stats=STORE("stats", dataset="stats"),
        shards=lambda wc: substitution_rules.stats_half_shards(PLAN, wc),
        tracked=f"{R}/corpus/{CORPUS}/{{model}}/tracked.json",
        code=job("experiments.substitution", "calibrate_kernel"),
    output:
        kernel=directory(STORE("calibrated")),
        bias=table_report(f"{R}/tables/kernel_bias_{{model}}_{{revision}}.csv", "kernel bias"),
        bias_md=f"{R}/tables/kernel_bias_{{model}}_{{revision}}.md",
        residuals=table_report(f"{R}/tables/calibration_{{model}}_{{revision}}.csv", "kernel bias"),
        residuals_md=f"{R}/tables/calibration_{{model}}_{{revision}}.md",
    params:
        model=lambda wc: wc.model,
        revision="{revision}",
        min_count=SUBSTITUTION["min_count"],
        iterations=KERNELS["calibration_iterations"],
        alpha=KERNELS["calibration_alpha"],
        batch_size=config["runtime"]["batch_size"],
        device=config["runtime"]["device"],
        dtype="float32",
    threads: model_threads
    resources:
        **cluster_resources("forward"),
    conda:
        ENV
    benchmark:
        "logs/benchmarks/calibrate_kernel/kernels/{model}/{revision}/calibration.tsv",
    log:
        "logs/kernels/{model}/{revision}/calibration.log",
    script:
        JOB_SCRIPT


# App. M: the substitution with the top-n tracked types of each arm of `substitution.top_n` (statistics of the
# `N<n>/stats` dataset: the primary statistics half with that tracked set), always with W
use rule substitution as substitution_topn with:
    input:
        stats=STORE("stats", dataset="N{n}/stats"),
        shards=f"{R}/corpus/{CORPUS}/{{model}}/shards",
        tracked=f"{R}/corpus/{CORPUS}/{{model}}/tracked-N{{n}}.json",
        model=model_input,
        code=job("experiments.substitution", "substitution_topn"),
    output:
        directory(STORE("substitution_topn")),
    params:
        eval_tokens=SUBSTITUTION["eval_tokens"],
        kernel="W",
        min_count=SUBSTITUTION["min_count"],
        batch_size=SUBSTITUTION["batch_size"] or config["runtime"]["batch_size"],
        **model_params(),
    benchmark:
        "logs/benchmarks/substitution_topn/substitution/{model}/{revision}/N{n}.tsv",
    log:
        "logs/substitution/{model}/{revision}/N{n}.log",


rule substitution_topn_table:
    input:
        results=lambda wc: [p for _, _, p in substitution_rules.topn_results(PLAN, wc)],
        code=job("experiments.substitution", "substitution_topn_table"),
    output:
        csv=table_report(f"{R}/tables/substitution_topn_{{model}}.csv", "substitution"),
        md=f"{R}/tables/substitution_topn_{{model}}.md",
    params:
        model=lambda wc: wc.model,
        arms=lambda wc: substitution_rules.topn_arms(PLAN, wc),
    localrule: True
    conda:
        ENV
    benchmark:
        "logs/benchmarks/substitution_topn_table/tables/substitution_topn_{model}.tsv",
    log:
        "logs/tables/substitution_topn_{model}.log",
    script:
        JOB_SCRIPT


rule figure_topn:
    input:
        table=f"{R}/tables/substitution_topn_{{model}}.csv",
        training=lambda wc: minisuite_rules.training_summary(PLAN, wc),
        code=job("experiments.substitution", "figure_topn"),
    output:
        pdf=report(f"{R}/figures/topn_{{model}}.pdf", caption="../report/figure_topn.rst",
                   category="Figures", subcategory="training"),
        png=report(f"{R}/figures/topn_{{model}}.png", caption="../report/figure_topn.rst",
                   category="Figures", subcategory="training"),
    params:
        window=lambda wc: MODELS[wc.model].get("induction_window"),
        band=SUBSTITUTION["induction_band"],
        title=lambda wc: f"Top-N sensitivity of the substitution: {wc.model}",
        kind="topn",
    localrule: True
    conda:
        ENV
    benchmark:
        "logs/benchmarks/figure_topn/figures/topn_{model}.tsv",
    log:
        "logs/figures/topn_{model}.log",
    script:
        JOB_SCRIPT


# App. M fig:vocab-mfgap: the waypoint at every top-N arm, panel for panel with fig:mfgap
rule figure_vocab_mfgap:
    input:
        table=f"{R}/tables/substitution_topn_{{model}}.csv",
        training=lambda wc: minisuite_rules.training_summary(PLAN, wc),
        code=job("experiments.substitution", "figure_vocab_mfgap"),
    output:
        pdf=report(f"{R}/figures/vocab_mfgap_{{model}}.pdf", caption="../report/figure_vocab_mfgap.rst",
                   category="Figures", subcategory="training"),
        png=report(f"{R}/figures/vocab_mfgap_{{model}}.png", caption="../report/figure_vocab_mfgap.rst",
                   category="Figures", subcategory="training"),
    params:
        window=lambda wc: MODELS[wc.model].get("induction_window"),
        band=SUBSTITUTION["induction_band"],
        title=lambda wc: f"Waypoint at every top-N arm: {wc.model}",
    localrule: True
    conda:
        ENV
    benchmark:
        "logs/benchmarks/figure_vocab_mfgap/figures/vocab_mfgap_{model}.tsv",
    log:
        "logs/figures/vocab_mfgap_{model}.log",
    script:
        JOB_SCRIPT


# App. B (sec:U2M): the body results that use the context-conditional kernel recomputed with the other kernel, per
# rollout revision, everything else held fixed: pass 2 and the substitution rerun with U (the calibrated kernel of
# rule calibrate_kernel; with W where `substitution.kernel` is `calibrated`), Exp. 1 and Exp. 2 with U (they run with
# W), each the same job as the run's own writing under results/recompute/<model>/<revision>/<kernel>/ (the run's own
# outputs stay as they are); one table joins the two arms (mfpipe.experiments.substitution.recompute).
#   snakemake --cores 2 results/tables/calibrated_mini-gpt2_final.csv
RECOMPUTE_KERNEL, RECOMPUTE_PROMPTS_KERNEL = substitution_rules.recompute_kernels(PLAN)
RECOMPUTE = substitution_rules.recompute_folder(PLAN, "{model}", "{revision}", RECOMPUTE_KERNEL)
RECOMPUTE_PROMPTS = substitution_rules.recompute_folder(PLAN, "{model}", "{revision}", RECOMPUTE_PROMPTS_KERNEL)


use rule deviation_shard as deviation_shard_recompute with:
    input:
        stats=STORE("stats", dataset="stats"),
        shards=lambda wc: deviation_rules.deviation_group_shards(PLAN, wc),
        tracked=f"{R}/corpus/{CORPUS}/{{model}}/tracked.json",
        model=model_input,
        kernel=PLAN.kernel_input(RECOMPUTE_KERNEL),
        code=job("deviation", "deviation_shard"),
    output:
        partials_output(f"{RECOMPUTE}/partials/group-{{i}}", DEVIATION["keep_partials"]),
    params:
        kernel=RECOMPUTE_KERNEL,
        job_function="deviation_shard",
    benchmark:
        f"logs/benchmarks/deviation_shard_recompute/recompute/{{model}}/{{revision}}/{RECOMPUTE_KERNEL}/group-{{i}}.tsv"
    log:
        f"logs/recompute/{{model}}/{{revision}}/{RECOMPUTE_KERNEL}/deviation/group-{{i}}.log",


use rule deviation_merge as deviation_merge_recompute with:
    input:
        partials=lambda wc: deviation_rules.deviation_partials(
            PLAN, wc, folder=substitution_rules.recompute_folder(PLAN, wc.model, wc.revision, RECOMPUTE_KERNEL)),
        tracked=f"{R}/corpus/{CORPUS}/{{model}}/tracked.json",
        code=job("deviation", "deviation_merge"),
    output:
        directory(STORE("deviation_recompute", kernel=RECOMPUTE_KERNEL)),
    params:
        job_function="deviation_merge",
    benchmark:
        f"logs/benchmarks/deviation_merge_recompute/recompute/{{model}}/{{revision}}/{RECOMPUTE_KERNEL}/merge.tsv"
    log:
        f"logs/recompute/{{model}}/{{revision}}/{RECOMPUTE_KERNEL}/deviation/merge.log",


use rule substitution as substitution_recompute with:
    input:
        stats=STORE("stats", dataset="stats"),
        shards=f"{R}/corpus/{CORPUS}/{{model}}/shards",
        tracked=f"{R}/corpus/{CORPUS}/{{model}}/tracked.json",
        model=model_input,
        kernel=PLAN.kernel_input(RECOMPUTE_KERNEL),
        code=job("experiments.substitution", "substitution"),
    output:
        directory(STORE("substitution_recompute", kernel=RECOMPUTE_KERNEL)),
    params:
        kernel=RECOMPUTE_KERNEL,
        job_function="substitution",
    benchmark:
        f"logs/benchmarks/substitution_recompute/recompute/{{model}}/{{revision}}/{RECOMPUTE_KERNEL}/substitution.tsv"
    log:
        f"logs/recompute/{{model}}/{{revision}}/{RECOMPUTE_KERNEL}/substitution.log",


use rule icl_meter as icl_meter_recompute with:
    input:
        stats=STORE("stats", dataset="stats"),
        shards=f"{R}/corpus/{CORPUS}/{{model}}/shards",
        tracked=f"{R}/corpus/{CORPUS}/{{model}}/tracked.json",
        model=model_input,
        kernel=PLAN.kernel_input(RECOMPUTE_PROMPTS_KERNEL),
        code=job("experiments.prompts", "icl_meter"),
    output:
        curves=f"{RECOMPUTE_PROMPTS}/icl_meter_curves.csv",
        heads=f"{RECOMPUTE_PROMPTS}/icl_meter_heads.csv",
        bins=f"{RECOMPUTE_PROMPTS}/icl_meter_bins.csv",
        summary=f"{RECOMPUTE_PROMPTS}/icl_meter.csv",
        summary_md=f"{RECOMPUTE_PROMPTS}/icl_meter.md",
    params:
        kernel=RECOMPUTE_PROMPTS_KERNEL,
        job_function="icl_meter",
    benchmark:
        f"logs/benchmarks/icl_meter_recompute/recompute/{{model}}/{{revision}}/{RECOMPUTE_PROMPTS_KERNEL}/meter.tsv"
    log:
        f"logs/recompute/{{model}}/{{revision}}/{RECOMPUTE_PROMPTS_KERNEL}/meter.log",


use rule icl_classes as icl_classes_recompute with:
    input:
        stats=STORE("stats", dataset="stats"),
        shards=f"{R}/corpus/{CORPUS}/{{model}}/shards",
        tracked=f"{R}/corpus/{CORPUS}/{{model}}/tracked.json",
        model=model_input,
        tokenizer=tokenizer_input,
        tasks=config["prompts"]["icl"]["task_files"],
        task_data=prompts_rules.icl_task_data(PLAN),
        kernel=PLAN.kernel_input(RECOMPUTE_PROMPTS_KERNEL),
        code=job("experiments.prompts", "icl_classes"),
    output:
        prompts=f"{RECOMPUTE_PROMPTS}/icl_prompts.csv",
        table=f"{RECOMPUTE_PROMPTS}/icl_classes.csv",
        table_md=f"{RECOMPUTE_PROMPTS}/icl_classes.md",
        corr=f"{RECOMPUTE_PROMPTS}/icl_corr.csv",
        corr_md=f"{RECOMPUTE_PROMPTS}/icl_corr.md",
    params:
        kernel=RECOMPUTE_PROMPTS_KERNEL,
        job_function="icl_classes",
    benchmark:
        f"logs/benchmarks/icl_classes_recompute/recompute/{{model}}/{{revision}}/{RECOMPUTE_PROMPTS_KERNEL}/classes.tsv"
    log:
        f"logs/recompute/{{model}}/{{revision}}/{RECOMPUTE_PROMPTS_KERNEL}/classes.log",


rule calibrated_recompute:
    input:
        unpack(lambda wc: substitution_rules.recompute_inputs(PLAN, wc)),
        code=job("experiments.substitution", "calibrated_recompute"),
    output:
        csv=table_report(f"{R}/tables/calibrated_{{model}}_{{revision}}.csv", "kernel bias",
                         caption="table_calibrated"),
        md=f"{R}/tables/calibrated_{{model}}_{{revision}}.md",
    params:
        model=lambda wc: wc.model,
        revision="{revision}",
        top=config["ranking"]["top"],
    localrule: True
    conda:
        ENV
    benchmark:
        "logs/benchmarks/calibrated_recompute/tables/calibrated_{model}_{revision}.tsv",
    log:
        "logs/tables/calibrated_{model}_{revision}.log",
    script:
        JOB_SCRIPT
