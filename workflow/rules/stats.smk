# Corpus-pass statistics: one forward pass per shard (all layers at once) writes additive partial
# sums; a merge per (model, revision, half) writes the labelled, layer-chunked Zarr store.


def shard_ids(wildcards):
    """Shard numbers of a half, known once the corpus checkpoint has run."""
    shards = checkpoints.corpus_shards.get(corpus=CORPUS, model=wildcards.model).output[0]
    return sorted(Path(p).name[len("shard-") : -len(".npz")] for p in Path(shards, wildcards.half).glob("shard-*.npz"))


def stats_partials(wildcards):
    return [
        f"{R}/stats/{wildcards.model}/{wildcards.revision}/partials/{wildcards.half}/shard-{i}.npz"
        for i in shard_ids(wildcards)
    ]


rule stats_shard:
    input:
        shard=f"{R}/corpus/{CORPUS}/{{model}}/shards/{{half}}/shard-{{i}}.npz",
        tracked=f"{R}/corpus/{CORPUS}/{{model}}/tracked.json",
        model=model_input,
        code=code("stats/__init__.py", "stats/accumulate.py", "models/adapters.py", "models/loader.py", "corpus.py", "tracked.py"),
    output:
        f"{R}/stats/{{model}}/{{revision}}/partials/{{half}}/shard-{{i}}.npz",
    params:
        model_spec=model_spec,
        revision="{revision}",
        dtype=lambda wc: MODELS[wc.model].get("dtype", config["runtime"]["dtype"]),
        device=config["runtime"]["device"],
        batch_size=config["runtime"]["batch_size"],
        results=R,
    threads: workflow.cores
    resources:
        gpu=lambda wc: 0 if config["runtime"]["device"] == "cpu" else 1,
    log:
        "logs/stats/{model}/{revision}/{half}/shard-{i}.log",
    script:
        "../scripts/stats_shard.py"


rule stats_merge:
    input:
        partials=stats_partials,
        shards=f"{R}/corpus/{CORPUS}/{{model}}/shards",
        tracked=f"{R}/corpus/{CORPUS}/{{model}}/tracked.json",
        code=code("stats/__init__.py", "stats/accumulate.py", "stats/store.py"),
    output:
        directory(f"{R}/stats/{{model}}/{{revision}}/{{half}}.zarr"),
    params:
        model=lambda wc: wc.model,
        revision="{revision}",
        half="{half}",
        hub_id=lambda wc: MODELS[wc.model].get("hub_id") or MODELS[wc.model].get("path") or wc.model,
    log:
        "logs/stats/{model}/{revision}/{half}/merge.log",
    script:
        "../scripts/stats_merge.py"
