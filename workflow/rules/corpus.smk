# Corpus stage: documents -> stats/eval halves -> BOS-led windows in fixed-size shards (a checkpoint:
# the number of shards is known only once the corpus is tokenized), then the tracked type set.


checkpoint corpus_shards:
    input:
        tokenizer=tokenizer_input,
        code=job("corpus", "corpus_shards"),
    output:
        directory(f"{R}/corpus/{{corpus}}/{{model}}/shards"),
    params:
        corpus=lambda wc: CORPORA[wc.corpus],
        model=model_spec,
        results=results_dir,
    threads: cluster_threads("cpu")
    resources:
        **cluster_resources("cpu"),
    conda:
        ENV
    benchmark:
        "logs/benchmarks/corpus_shards/corpus/{corpus}/{model}/shards.tsv",
    log:
        "logs/corpus/{corpus}/{model}/shards.log",
    script:
        JOB_SCRIPT


rule tracked_types:
    input:
        shards=f"{R}/corpus/{{corpus}}/{{model}}/shards",
        tokenizer=tokenizer_input,
        code=job("corpus", "tracked_types"),
    output:
        f"{R}/corpus/{{corpus}}/{{model}}/tracked.json",
    params:
        n_tracked=config["tracked"]["n_tracked"],
        model=model_spec,
        results=results_dir,
    localrule: True
    conda:
        ENV
    benchmark:
        "logs/benchmarks/tracked_types/corpus/{corpus}/{model}/tracked.tsv",
    log:
        "logs/corpus/{corpus}/{model}/tracked.log",
    script:
        JOB_SCRIPT


rule coverage_table:
    input:
        tracked=expand(f"{R}/corpus/{CORPUS}/{{model}}/tracked.json", model=list(MODELS)),
        code=job("corpus", "coverage_table"),
    output:
        csv=table_report(f"{R}/tables/coverage_positions.csv", "coverage"),
        md=f"{R}/tables/coverage_positions.md",
    params:
        models=list(MODELS),
    localrule: True
    conda:
        ENV
    benchmark:
        "logs/benchmarks/coverage_table/tables/coverage_positions.tsv",
    log:
        "logs/tables/coverage_positions.log",
    script:
        JOB_SCRIPT


# App. M: the tracked set of a top-N arm (substitution.top_n), the same selection with another N
use rule tracked_types as tracked_types_topn with:
    output:
        f"{R}/corpus/{{corpus}}/{{model}}/tracked-N{{n}}.json",
    params:
        n_tracked=lambda wc: int(wc.n),
        model=model_spec,
        results=results_dir,
    benchmark:
        "logs/benchmarks/tracked_types_topn/corpus/{corpus}/{model}/tracked-N{n}.tsv",
    log:
        "logs/corpus/{corpus}/{model}/tracked-N{n}.log",


# App. F fig:zipf: each model's rank-frequency table on the stats half, then the cutoff table and the figure
rule rank_frequency:
    input:
        shards=f"{R}/corpus/{{corpus}}/{{model}}/shards",
        code=job("corpus", "rank_frequency"),
    output:
        f"{R}/corpus/{{corpus}}/{{model}}/rank_frequency.csv",
    localrule: True
    conda:
        ENV
    benchmark:
        "logs/benchmarks/rank_frequency/corpus/{corpus}/{model}/rank_frequency.tsv",
    log:
        "logs/corpus/{corpus}/{model}/rank_frequency.log",
    script:
        JOB_SCRIPT


rule zipf:
    input:
        tables=expand(f"{R}/corpus/{CORPUS}/{{model}}/rank_frequency.csv", model=list(MODELS)),
        code=job("corpus", "zipf"),
    output:
        csv=table_report(f"{R}/tables/zipf_cutoff.csv", "coverage", "table_zipf_cutoff"),
        md=f"{R}/tables/zipf_cutoff.md",
        pdf=report(f"{R}/figures/zipf.pdf", caption="../report/figure_zipf.rst", category="Figures",
                   subcategory="corpus"),
        png=report(f"{R}/figures/zipf.png", caption="../report/figure_zipf.rst", category="Figures",
                   subcategory="corpus"),
    params:
        models=list(MODELS),
        n_tracked=config["tracked"]["n_tracked"],
    localrule: True
    conda:
        ENV
    benchmark:
        "logs/benchmarks/zipf/figures/zipf.tsv",
    log:
        "logs/figures/zipf.log",
    script:
        JOB_SCRIPT
