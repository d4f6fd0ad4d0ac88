# Function vectors from mean-field deviation (paper Sec. 6.4, eq:taskresid; App. fv; library
# mfpipe.experiments.fv). Per rollout revision of a model with `fv.tasks`: one forward-pass job runs
# every task (MFA and AIE selection, the sweep, the held-out evaluation, the lenses) and writes the tables; the
# figure is drawn from the transfer table by its own rule.
FV = config["fv"]


rule function_vectors:
    input:
        # the J-lens store where the job decodes through the full J (jlens.decode, mfpipe.jlens.rules; by default,
        # every head of every clean prompt is many more vectors than d): else the products run on the shards below
        unpack(lambda wc: jlens_rules.decode_inputs(PLAN, wc, fv_rules.decoded_vectors(PLAN, wc.model))),
        stats=STORE("stats", dataset="stats"),
        shards=f"{R}/corpus/{CORPUS}/{{model}}/shards",
        tracked=f"{R}/corpus/{CORPUS}/{{model}}/tracked.json",
        model=model_input,
        tokenizer=tokenizer_input,
        tasks=lambda wc: fv_rules.task_inputs(PLAN, wc),
        code=job("experiments.fv", "function_vectors"),
    output:
        transfer=f"{R}/fv/{{model}}/{{revision}}/transfer.csv",
        heads=f"{R}/fv/{{model}}/{{revision}}/heads.csv",
        sweep=f"{R}/fv/{{model}}/{{revision}}/sweep.csv",
        ranks=f"{R}/fv/{{model}}/{{revision}}/ranks.csv",
        clean=f"{R}/fv/{{model}}/{{revision}}/clean.csv",
        recovery=f"{R}/fv/{{model}}/{{revision}}/recovery.csv",
        info=f"{R}/fv/{{model}}/{{revision}}/info.json",
        table=table_report(f"{R}/tables/fv_{{model}}_{{revision}}.csv", "function vectors"),
        table_md=f"{R}/tables/fv_{{model}}_{{revision}}.md",
        per_head_md=f"{R}/tables/fv_per_head_{{model}}_{{revision}}.md",
        details_md=f"{R}/tables/fv_details_{{model}}_{{revision}}.md",
        clean_table=table_report(f"{R}/tables/fv_clean_{{model}}_{{revision}}.csv", "function vectors"),
        clean_md=f"{R}/tables/fv_clean_{{model}}_{{revision}}.md",
    params:
        tasks=lambda wc: fv_rules.fv_tasks(PLAN, wc.model),
        fv=lambda wc: fv_rules.fv_settings(PLAN, wc.model),
        jlens=lambda wc: jlens_rules.decode_params(PLAN, wc.model, fv_rules.decoded_vectors(PLAN, wc.model)),
        batch_size=FV["batch_size"] or config["runtime"]["batch_size"],
        **model_params(),
    threads: model_threads
    resources:
        **cluster_resources("forward"),
    conda:
        ENV
    benchmark:
        "logs/benchmarks/function_vectors/fv/{model}/{revision}.tsv",
    log:
        "logs/fv/{model}/{revision}.log",
    script:
        JOB_SCRIPT


# Fig. fv, drawn from the transfer table (deleting it reruns only this job):
#   snakemake --cores 1 results/figures/fv_mini-gpt2_final.png
rule figure_fv:
    input:
        table=f"{R}/tables/fv_{{model}}_{{revision}}.csv",
        code=job("experiments.fv", "figure_fv"),
    output:
        pdf=report(f"{R}/figures/fv_{{model}}_{{revision}}.pdf", caption="../report/figure_fv.rst",
                   category="Figures", subcategory="function vectors"),
        png=report(f"{R}/figures/fv_{{model}}_{{revision}}.png", caption="../report/figure_fv.rst",
                   category="Figures", subcategory="function vectors"),
    params:
        title="{model} @ {revision}",
    localrule: True
    conda:
        ENV
    benchmark:
        "logs/benchmarks/figure_fv/figures/fv_{model}_{revision}.tsv",
    log:
        "logs/figures/fv_{model}_{revision}.log",
    script:
        JOB_SCRIPT


# Fig. fv-clean (MFA·r against the number of clean prompts), drawn from the clean-prompt sweep's table:
#   snakemake --cores 1 results/figures/fv_clean_mini-gpt2_final.png
rule figure_fv_clean:
    input:
        table=f"{R}/tables/fv_clean_{{model}}_{{revision}}.csv",
        code=job("experiments.fv", "figure_fv_clean"),
    output:
        pdf=report(f"{R}/figures/fv_clean_{{model}}_{{revision}}.pdf", caption="../report/figure_fv_clean.rst",
                   category="Figures", subcategory="function vectors"),
        png=report(f"{R}/figures/fv_clean_{{model}}_{{revision}}.png", caption="../report/figure_fv_clean.rst",
                   category="Figures", subcategory="function vectors"),
    params:
        title="{model} @ {revision}",
    localrule: True
    conda:
        ENV
    benchmark:
        "logs/benchmarks/figure_fv_clean/figures/fv_clean_{model}_{revision}.tsv",
    log:
        "logs/figures/fv_clean_{model}_{revision}.log",
    script:
        JOB_SCRIPT
