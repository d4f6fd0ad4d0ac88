# The interactive explorer (issue 61; library mfpipe.explorer): per model a self-contained site from the run's tables
# and stores (the head grid coloured by a score with the training axis, a card per head and revision, the run's
# pages), plotly.js shipped once beside them, and an index over the models. It opens from disk: no server, no network.
#   snakemake --cores 2 results/explorer/mini-gpt2/index.html

from mfpipe.explorer import rules as explorer_rules  # noqa: E402

EXPLORER = config["explorer"]
# the default target's part (the Snakefile's `rule all`; the run's cost table waits for it too)
EXPLORER_TARGETS = explorer_rules.targets(PLAN) if EXPLORER["enabled"] else []


rule explorer_assets:
    input:
        static=explorer_rules.static_files(relative_to=Path.cwd()),
        code=job("explorer", "explorer_assets"),
    output:
        folder=directory(f"{R}/explorer/assets"),
    params:
        plotly=explorer_rules.plotly_version(),
    localrule: True
    conda:
        ENV
    benchmark:
        "logs/benchmarks/explorer_assets/explorer/assets.tsv",
    log:
        "logs/explorer/assets.log",
    script:
        JOB_SCRIPT


rule explorer:
    input:
        assets=rules.explorer_assets.output.folder,
        files=lambda wc: explorer_rules.flat_inputs(explorer_rules.explorer_files(PLAN, wc.model, every_target())),
        code=job("explorer", "explorer"),
    output:
        index=f"{R}/explorer/{{model}}/index.html",
        data=directory(f"{R}/explorer/{{model}}/data"),
    params:
        model=lambda wc: wc.model,
        files=lambda wc: explorer_rules.explorer_files(PLAN, wc.model, every_target()),
        revisions=lambda wc: REVISIONS[wc.model],
        steps=lambda wc: PLAN.revision_steps(wc.model),
        rollout_revisions=lambda wc: ROLLOUT_REVISIONS[wc.model],
        induction_window=lambda wc: MODELS[wc.model].get("induction_window"),
        top_types=EXPLORER["top_types"],
    conda:
        ENV
    benchmark:
        "logs/benchmarks/explorer/explorer/{model}.tsv",
    log:
        "logs/explorer/{model}.log",
    script:
        JOB_SCRIPT


rule explorer_index:
    input:
        pages=expand(f"{R}/explorer/{{model}}/index.html", model=MODELS),
        code=job("explorer", "explorer_index"),
    output:
        index=f"{R}/explorer/index.html",
    localrule: True
    conda:
        ENV
    benchmark:
        "logs/benchmarks/explorer_index/explorer/index.tsv",
    log:
        "logs/explorer/index.log",
    script:
        JOB_SCRIPT
