# Pass 2, the mean-field deviation of every head (paper Sec. 6, App. O, P; library mfpipe.deviation, core: the head
# ranking, the lenses and the error accounting read its store). Per revision of each model's `revisions`: a job per
# run of `deviation.shards_per_job` shards of the statistics half (default all of them, one partial per shard, reading
# pass 1's W and mu; the first `deviation.tokens` tokens, null: all), merged into deviation.zarr.
#   snakemake --cores 2 results/deviation/mini-gpt2/final/deviation.zarr


rule deviation_shard:
    input:
        stats=STORE("stats", dataset="stats"),
        shards=lambda wc: deviation_rules.deviation_group_shards(PLAN, wc),
        tracked=f"{R}/corpus/{CORPUS}/{{model}}/tracked.json",
        model=model_input,
        kernel=PLAN.kernel_input(config["substitution"]["kernel"]),
        code=job("deviation", "deviation_shard"),
    output:
        partials_output(f"{R}/deviation/{{model}}/{{revision}}/partials/group-{{i}}", DEVIATION["keep_partials"]),
    wildcard_constraints:
        i=r"\d+",
    params:
        kernel=config["substitution"]["kernel"],
        min_count=config["substitution"]["min_count"],
        top_k=DEVIATION["top_k"],
        other_share_max=DEVIATION["other_share_max"],
        batch_size=DEVIATION["batch_size"] or config["runtime"]["batch_size"],
        **model_params(),
    threads: model_threads
    resources:
        **cluster_resources("forward"),
    conda:
        ENV
    benchmark:
        "logs/benchmarks/deviation_shard/deviation/{model}/{revision}/group-{i}.tsv",
    log:
        "logs/deviation/{model}/{revision}/group-{i}.log",
    script:
        JOB_SCRIPT


rule deviation_merge:
    input:
        partials=lambda wc: deviation_rules.deviation_partials(PLAN, wc),
        tracked=f"{R}/corpus/{CORPUS}/{{model}}/tracked.json",
        code=job("deviation", "deviation_merge"),
    output:
        directory(STORE("deviation")),
    params:
        groups=lambda wc: deviation_rules.deviation_groups(PLAN, wc),
        model=lambda wc: wc.model,
        revision="{revision}",
        min_occurrences=DEVIATION["min_occurrences"],
    localrule: True
    conda:
        ENV
    benchmark:
        "logs/benchmarks/deviation_merge/deviation/{model}/{revision}/merge.tsv",
    log:
        "logs/deviation/{model}/{revision}/merge.log",
    script:
        JOB_SCRIPT
