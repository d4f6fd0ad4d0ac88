# The offline mini suite: a byte-level BPE tokenizer and tiny GPT-2 / GPT-NeoX models trained on the
# embedded corpus's `train` split, with HF checkpoints at log-spaced steps and induction scores.


rule minisuite_tokenizer:
    input:
        code=job("minisuite", "minisuite_tokenizer"),
    output:
        directory(f"{R}/minisuite/tokenizer"),
    params:
        vocab_size=config["minisuite"]["tokenizer"]["vocab_size"] if "minisuite" in config else None,
        min_frequency=config["minisuite"]["tokenizer"]["min_frequency"] if "minisuite" in config else None,
        corpus=config.get("minisuite", {}).get("corpus"),
    localrule: True
    conda:
        ENV
    benchmark:
        "logs/benchmarks/minisuite_tokenizer/minisuite/tokenizer.tsv",
    log:
        "logs/minisuite/tokenizer.log",
    script:
        JOB_SCRIPT


rule minisuite_tasks:
    input:
        tokenizer=f"{R}/minisuite/tokenizer",
        code=job("minisuite", "minisuite_tasks"),
    output:
        f"{R}/minisuite/tasks.json",
    params:
        tasks=config.get("minisuite", {}).get("tasks", {}),
    localrule: True
    conda:
        ENV
    benchmark:
        "logs/benchmarks/minisuite_tasks/minisuite/tasks.tsv",
    log:
        "logs/minisuite/tasks.log",
    script:
        JOB_SCRIPT


rule minisuite_train:
    input:
        tokenizer=f"{R}/minisuite/tokenizer",
        tasks=lambda wc: minisuite_rules.tasks_input(PLAN, wc),
        code=job("minisuite", "minisuite_train"),
    output:
        checkpoints=directory(f"{R}/minisuite/{{mini}}/checkpoints"),
        induction=f"{R}/minisuite/{{mini}}/induction.csv",
        summary=f"{R}/minisuite/{{mini}}/training.json",
    params:
        cfg=lambda wc: MINI[wc.mini],
        corpus=config.get("minisuite", {}).get("corpus"),
    # one thread: training runs on pinned numerics with one thread (mfpipe/workflow/numerics.py), the same bits on
    # every machine, so two trainings run side by side on two cores
    threads: 1
    resources:
        **cluster_resources("forward"),
    conda:
        ENV
    benchmark:
        "logs/benchmarks/minisuite_train/minisuite/{mini}.tsv",
    log:
        "logs/minisuite/{mini}.log",
    script:
        JOB_SCRIPT


rule induction_table:
    input:
        induction=expand(f"{R}/minisuite/{{mini}}/induction.csv", mini=sorted(MINI.keys() & MODELS.keys())),
        code=job("minisuite", "induction_table"),
    output:
        table_report(f"{R}/tables/induction.md", "induction"),
    localrule: True
    conda:
        ENV
    benchmark:
        "logs/benchmarks/induction_table/tables/induction.tsv",
    log:
        "logs/tables/induction.log",
    script:
        JOB_SCRIPT
