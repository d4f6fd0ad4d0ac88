# The exclusion arm (App. llama, "Exclusion experiment"): a second tracked set with every newline / whitespace and
# pure-punctuation type (and the user's strings) left out of the same top-N selection (config `tracked.exclude`), its
# own statistics (datasets excl/stats and excl/eval through stats_shard / stats_merge) and the mean-field rollout on it
# beside the main set's, per model and rollout revision. Nothing of the main set's jobs takes the exclude config.
# Library: mfpipe.corpus.exclude (the selection), mfpipe.experiments.rollout.exclusion (its targets and the table).

EXCLUDE = config["tracked"]["exclude"]


rule tracked_types_excl:
    input:
        shards=f"{R}/corpus/{{corpus}}/{{model}}/shards",
        tokenizer=tokenizer_input,
        code=job("corpus", "tracked_types_excl"),
    output:
        f"{R}/corpus/{{corpus}}/{{model}}/tracked-excl.json",
    params:
        n_tracked=config["tracked"]["n_tracked"],
        classes=EXCLUDE["classes"],
        strings=EXCLUDE["strings"],
        model=model_spec,
        results=results_dir,
    localrule: True
    conda:
        ENV
    benchmark:
        "logs/benchmarks/tracked_types_excl/corpus/{corpus}/{model}/tracked-excl.tsv",
    log:
        "logs/corpus/{corpus}/{model}/tracked-excl.log",
    script:
        JOB_SCRIPT


rule exclusion_rollout:
    input:
        stats=stats_store("stats"),
        eval=stats_store("eval"),
        excl_stats=stats_store("excl/stats"),
        excl_eval=stats_store("excl/eval"),
        tracked_excl=f"{R}/corpus/{CORPUS}/{{model}}/tracked-excl.json",
        model=model_input,
        code=job("experiments.rollout", "exclusion_rollout"),
    output:
        csv=table_report(f"{R}/tables/exclusion_{{model}}_{{revision}}.csv", "rollout divergence", "table_exclusion"),
        md=f"{R}/tables/exclusion_{{model}}_{{revision}}.md",
    params:
        init=config["rollout"]["init"],  # (ROLLOUT of rollout.smk: that file is read after this one)
        min_count=config["rollout"]["min_count"],
        divergence=config["rollout"]["divergence"],  # the diagnostics' settings (kernel: each arm's mean field)
        seed=config["rollout"]["seed"],
        rogue_factor=config["rollout"]["rogue_factor"],
        **model_params(),
    threads: model_threads
    resources:
        **cluster_resources("forward"),
    conda:
        ENV
    benchmark:
        "logs/benchmarks/exclusion_rollout/rollout/{model}/{revision}/exclusion.tsv",
    log:
        "logs/rollout/{model}/{revision}/exclusion.log",
    script:
        JOB_SCRIPT
