# Corpus-pass statistics: one forward pass per batch (all layers at once) writes additive partial sums, one
# partial per corpus shard; a job runs through `stats.shards_per_job` shards (default: all of a half's, so the
# model loads once); a merge per (model, revision, dataset) writes the labelled, layer-chunked Zarr store.
# A dataset is a half of the primary corpus (`stats`, `eval`) or of a cross corpus (`<name>/stats`).

# (input functions: mfpipe.stats.rules, on the run's plan)


rule stats_shard:
    input:
        shards=lambda wc: stats_rules.dataset_group_shards(PLAN, wc),
        tracked=dataset_tracked,
        model=model_input,
        code=job("stats", "stats_shard"),
    output:
        partials_output(f"{R}/stats/{{model}}/{{revision}}/partials/{{dataset}}/group-{{i}}",
                        config["stats"]["keep_partials"]),
    params:
        batch_size=config["runtime"]["batch_size"],
        mantissa_bits=config["stats"]["partial_mantissa_bits"],
        **model_params(),
    threads: model_threads
    resources:
        **cluster_resources("forward"),
    conda:
        ENV
    benchmark:
        "logs/benchmarks/stats_shard/stats/{model}/{revision}/{dataset}/group-{i}.tsv",
    log:
        "logs/stats/{model}/{revision}/{dataset}/group-{i}.log",
    script:
        JOB_SCRIPT


rule stats_merge:
    input:
        partials=lambda wc: stats_rules.stats_partials(PLAN, wc),
        shards=lambda wc: stats_rules.dataset_shards_dir(PLAN, wc),
        tracked=dataset_tracked,
        code=job("stats", "stats_merge"),
    output:
        directory(STORE("stats")),
    params:
        model=lambda wc: wc.model,
        revision="{revision}",
        half=lambda wc: dataset_parts(wc.dataset)[1],
        hub_id=lambda wc: MODELS[wc.model].get("hub_id") or MODELS[wc.model].get("path") or wc.model,
        commit=revision_commit,
    localrule: True
    conda:
        ENV
    benchmark:
        "logs/benchmarks/stats_merge/stats/{model}/{revision}/{dataset}/merge.tsv",
    log:
        "logs/stats/{model}/{revision}/{dataset}/merge.log",
    script:
        JOB_SCRIPT
