# Prompt classes, the instance meter and the lenses (paper Sec. 6.1-6.2, App. O, P; library
# mfpipe.experiments.prompts). Per rollout revision: the lenses over pass 2's top contexts, the prompt classes of
# Exp. 2 and the instance meter of Exp. 1 (forward-pass jobs writing tables), and their figures (figure rules).

PROMPTS = config["prompts"]


rule lenses:
    input:
        # the J-lens store where the job decodes through the full J (jlens.decode, mfpipe.jlens.rules): else the
        # products run on the statistics half's shards and the model, declared below
        unpack(lambda wc: jlens_rules.decode_inputs(PLAN, wc, prompts_rules.lens_vectors(PLAN))),
        deviation=STORE("deviation"),
        stats=STORE("stats", dataset="stats"),
        shards=f"{R}/corpus/{CORPUS}/{{model}}/shards",
        tracked=f"{R}/corpus/{CORPUS}/{{model}}/tracked.json",
        model=model_input,
        tokenizer=tokenizer_input,
        code=job("experiments.prompts", "lenses"),
    output:
        contexts_md=f"{R}/lenses/{{model}}/{{revision}}/contexts.md",
        contexts_html=f"{R}/lenses/{{model}}/{{revision}}/contexts.html",
        decode_md=f"{R}/lenses/{{model}}/{{revision}}/decode.md",
        csv=f"{R}/lenses/{{model}}/{{revision}}/contexts.csv",
    params:
        n_lens_heads=PROMPTS["lenses"]["n_lens_heads"],
        per_head=PROMPTS["lenses"]["per_head"],
        heads=PROMPTS["lenses"]["heads"],
        jlens=lambda wc: jlens_rules.decode_params(PLAN, wc.model, prompts_rules.lens_vectors(PLAN)),
        batch_size=PROMPTS["batch_size"] or config["runtime"]["batch_size"],
        **model_params(),
    threads: model_threads
    resources:
        **cluster_resources("forward"),
    conda:
        ENV
    benchmark:
        "logs/benchmarks/lenses/lenses/{model}/{revision}.tsv",
    log:
        "logs/lenses/{model}/{revision}.log",
    script:
        JOB_SCRIPT


rule icl_classes:
    input:
        stats=STORE("stats", dataset="stats"),
        shards=f"{R}/corpus/{CORPUS}/{{model}}/shards",
        tracked=f"{R}/corpus/{CORPUS}/{{model}}/tracked.json",
        model=model_input,
        tokenizer=tokenizer_input,
        tasks=PROMPTS["icl"]["task_files"],
        # the vendored datasets named in prompts.icl.tasks (mfpipe.tasks): editing one reruns the job
        task_data=prompts_rules.icl_task_data(PLAN),
        code=job("experiments.prompts", "icl_classes"),
    output:
        prompts=f"{R}/tables/icl_prompts_{{model}}_{{revision}}.csv",
        table=table_report(f"{R}/tables/icl_classes_{{model}}_{{revision}}.csv", "in-context learning"),
        table_md=f"{R}/tables/icl_classes_{{model}}_{{revision}}.md",
        corr=table_report(f"{R}/tables/icl_corr_{{model}}_{{revision}}.csv", "in-context learning"),
        corr_md=f"{R}/tables/icl_corr_{{model}}_{{revision}}.md",
    params:
        n_prompts=PROMPTS["icl"]["n_prompts"],
        n_fewshot=PROMPTS["icl"]["n_fewshot"],
        n_random=PROMPTS["icl"]["n_random"],
        seed=PROMPTS["icl"]["seed"],
        tasks=PROMPTS["icl"]["tasks"],
        task_files=PROMPTS["icl"]["task_files"],
        natural_length=PROMPTS["icl"]["natural_length"],
        min_count=config["substitution"]["min_count"],
        batch_size=PROMPTS["batch_size"] or config["runtime"]["batch_size"],
        **model_params(),
    threads: model_threads
    resources:
        **cluster_resources("forward"),
    conda:
        ENV
    benchmark:
        "logs/benchmarks/icl_classes/icl/{model}/{revision}/classes.tsv",
    log:
        "logs/icl/{model}/{revision}/classes.log",
    script:
        JOB_SCRIPT


rule icl_meter:
    input:
        stats=STORE("stats", dataset="stats"),
        shards=f"{R}/corpus/{CORPUS}/{{model}}/shards",
        tracked=f"{R}/corpus/{CORPUS}/{{model}}/tracked.json",
        model=model_input,
        code=job("experiments.prompts", "icl_meter"),
    output:
        curves=f"{R}/tables/icl_meter_curves_{{model}}_{{revision}}.csv",
        heads=f"{R}/tables/icl_meter_heads_{{model}}_{{revision}}.csv",
        bins=f"{R}/tables/icl_meter_bins_{{model}}_{{revision}}.csv",
        summary=table_report(f"{R}/tables/icl_meter_{{model}}_{{revision}}.csv", "in-context learning"),
        summary_md=f"{R}/tables/icl_meter_{{model}}_{{revision}}.md",
    params:
        n_sequences=PROMPTS["icl_meter"]["n_sequences"],
        chunk_length=PROMPTS["icl_meter"]["chunk_length"],
        n_bins=PROMPTS["icl_meter"]["n_bins"],
        seed=PROMPTS["icl_meter"]["seed"],
        min_count=config["substitution"]["min_count"],
        batch_size=PROMPTS["batch_size"] or config["runtime"]["batch_size"],
        **model_params(),
    threads: model_threads
    resources:
        **cluster_resources("forward"),
    conda:
        ENV
    benchmark:
        "logs/benchmarks/icl_meter/icl/{model}/{revision}/meter.tsv",
    log:
        "logs/icl/{model}/{revision}/meter.log",
    script:
        JOB_SCRIPT


# The prompt experiments' figures, drawn from the tables their forward jobs wrote (deleting a figure reruns only
# its plotting job, never a forward pass):
#   snakemake --cores 1 results/figures/icl_classes_mini-gpt2_final.png
rule figure_icl_classes:
    input:
        prompts=f"{R}/tables/icl_prompts_{{model}}_{{revision}}.csv",
        code=job("experiments.prompts", "figure_icl_classes"),
    output:
        pdf=report(f"{R}/figures/icl_classes_{{model}}_{{revision}}.pdf", caption="../report/figure_icl_classes.rst",
                   category="Figures", subcategory="in-context learning"),
        png=report(f"{R}/figures/icl_classes_{{model}}_{{revision}}.png", caption="../report/figure_icl_classes.rst",
                   category="Figures", subcategory="in-context learning"),
    params:
        kind="icl_classes",
        title="{model} @ {revision}",
    localrule: True
    conda:
        ENV
    benchmark:
        "logs/benchmarks/figure_icl_classes/figures/icl_classes_{model}_{revision}.tsv",
    log:
        "logs/figures/icl_classes_{model}_{revision}.log",
    script:
        JOB_SCRIPT


rule figure_icl_meter:
    input:
        curves=f"{R}/tables/icl_meter_curves_{{model}}_{{revision}}.csv",
        bins=f"{R}/tables/icl_meter_bins_{{model}}_{{revision}}.csv",
        summary=f"{R}/tables/icl_meter_{{model}}_{{revision}}.csv",
        code=job("experiments.prompts", "figure_icl_meter"),
    output:
        pdf=report(f"{R}/figures/icl_meter_{{model}}_{{revision}}.pdf", caption="../report/figure_icl_meter.rst",
                   category="Figures", subcategory="in-context learning"),
        png=report(f"{R}/figures/icl_meter_{{model}}_{{revision}}.png", caption="../report/figure_icl_meter.rst",
                   category="Figures", subcategory="in-context learning"),
    params:
        kind="icl_meter",
        title="{model} @ {revision}: [c; c]",
    localrule: True
    conda:
        ENV
    benchmark:
        "logs/benchmarks/figure_icl_meter/figures/icl_meter_{model}_{revision}.tsv",
    log:
        "logs/figures/icl_meter_{model}_{revision}.log",
    script:
        JOB_SCRIPT
