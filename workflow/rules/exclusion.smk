# The exclusion arm (App. llama, "Exclusion experiment"): a second tracked set with every newline / whitespace and
# pure-punctuation type (and the user's strings) left out of the same top-N selection (config section `exclusion`),
# its own statistics (datasets excl/stats and excl/eval through stats_shard / stats_merge) and the mean-field rollout
# on it beside the main set's, per model and rollout revision. This file is the one that reads the section: nothing of
# the main set's jobs takes it. Library: two modules named for the arm, mfpipe.corpus.exclusion (the selection, the
# corpus stage's, so that editing the rollout's code reruns no statistics of the arm) and
# mfpipe.experiments.rollout.exclusion (its targets and the table); tests: tests/test_exclusion.py.

EXCLUDE = config["exclusion"]


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
        stats=STORE("stats", dataset="stats"),
        eval=STORE("stats", dataset="eval"),
        excl_stats=STORE("stats", dataset="excl/stats"),
        excl_eval=STORE("stats", dataset="excl/eval"),
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
