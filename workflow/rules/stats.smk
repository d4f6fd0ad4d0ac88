# Corpus-pass statistics: one forward pass per shard (all layers at once) writes additive partial
# sums; a merge per (model, revision, dataset) writes the labelled, layer-chunked Zarr store.
# A dataset is a half of the primary corpus (`stats`, `eval`) or of a cross corpus (`<name>/stats`).


def shard_ids(wildcards):
    """Shard numbers of a dataset, known once the corpus checkpoint has run."""
    corpus, half = dataset_parts(wildcards.dataset)
    shards = checkpoints.corpus_shards.get(corpus=corpus, model=wildcards.model).output[0]
    return sorted(Path(p).name[len("shard-") : -len(".npz")] for p in Path(shards, half).glob("shard-*.npz"))


def stats_partials(wildcards):
    return [
        f"{R}/stats/{wildcards.model}/{wildcards.revision}/partials/{wildcards.dataset}/shard-{i}.npz"
        for i in shard_ids(wildcards)
    ]


def dataset_shard(wildcards):
    corpus, half = dataset_parts(wildcards.dataset)
    return f"{R}/corpus/{corpus}/{wildcards.model}/shards/{half}/shard-{wildcards.i}.npz"


def dataset_shards_dir(wildcards):
    return f"{R}/corpus/{dataset_parts(wildcards.dataset)[0]}/{wildcards.model}/shards"


rule stats_shard:
    input:
        shard=dataset_shard,
        tracked=f"{R}/corpus/{CORPUS}/{{model}}/tracked.json",
        model=model_input,
        code=code("stats/__init__.py", "stats/accumulate.py", *ADAPTERS_CODE, "models/loader.py", "corpus.py", "tracked.py"),
    output:
        f"{R}/stats/{{model}}/{{revision}}/partials/{{dataset}}/shard-{{i}}.npz",
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
        "logs/stats/{model}/{revision}/{dataset}/shard-{i}.log",
    script:
        "../scripts/stats_shard.py"


rule stats_merge:
    input:
        partials=stats_partials,
        shards=dataset_shards_dir,
        tracked=f"{R}/corpus/{CORPUS}/{{model}}/tracked.json",
        code=code("stats/__init__.py", "stats/accumulate.py", "stats/store.py"),
    output:
        directory(f"{R}/stats/{{model}}/{{revision}}/{{dataset}}.zarr"),
    params:
        model=lambda wc: wc.model,
        revision="{revision}",
        half=lambda wc: dataset_parts(wc.dataset)[1],
        hub_id=lambda wc: MODELS[wc.model].get("hub_id") or MODELS[wc.model].get("path") or wc.model,
    log:
        "logs/stats/{model}/{revision}/{dataset}/merge.log",
    script:
        "../scripts/stats_merge.py"
