# The offline mini suite: a byte-level BPE tokenizer and tiny GPT-2 / GPT-NeoX models trained on the
# embedded corpus's `train` split, with HF checkpoints at log-spaced steps and induction scores.


rule minisuite_tokenizer:
    input:
        code=code("minisuite/__init__.py", "minisuite/tokenizer.py", "corpus.py"),
    output:
        directory(f"{R}/minisuite/tokenizer"),
    params:
        vocab_size=config["minisuite"]["tokenizer"]["vocab_size"] if "minisuite" in config else None,
        min_frequency=config["minisuite"]["tokenizer"].get("min_frequency", 2) if "minisuite" in config else None,
        corpus=config.get("minisuite", {}).get("corpus"),
    log:
        "logs/minisuite/tokenizer.log",
    script:
        "../scripts/train_tokenizer.py"


rule minisuite_train:
    input:
        tokenizer=f"{R}/minisuite/tokenizer",
        code=code("minisuite/__init__.py", "minisuite/train.py", "induction.py", *ADAPTERS_CODE, "corpus.py", "io.py"),
    output:
        checkpoints=directory(f"{R}/minisuite/{{mini}}/checkpoints"),
        induction=f"{R}/minisuite/{{mini}}/induction.csv",
        summary=f"{R}/minisuite/{{mini}}/training.json",
    params:
        cfg=lambda wc: MINI[wc.mini],
        corpus=config.get("minisuite", {}).get("corpus"),
    threads: workflow.cores
    log:
        "logs/minisuite/{mini}.log",
    script:
        "../scripts/train_mini_model.py"


rule induction_table:
    input:
        induction=expand(f"{R}/minisuite/{{mini}}/induction.csv", mini=sorted(MINI.keys() & MODELS.keys())),
        code=code("tables.py"),
    output:
        f"{R}/tables/induction.md",
    log:
        "logs/tables/induction.log",
    script:
        "../scripts/induction_table.py"
