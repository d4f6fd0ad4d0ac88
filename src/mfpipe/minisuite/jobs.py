"""The mini suite's jobs, one function per rule of workflow/rules/minisuite.smk (run by
mfpipe.workflow.runner.run_job). Each imports what it runs inside its own body, so its code inputs are its own."""

from __future__ import annotations


def minisuite_tokenizer(job) -> None:
    """Train the mini suite's byte-level BPE tokenizer on the corpus's train split.

    output[0]         the tokenizer folder (written atomically)
    params.corpus     the suite's corpus (mfpipe.corpus.documents); vocab_size, min_frequency of the BPE
    """
    from mfpipe.corpus.documents import load_documents, split_documents
    from mfpipe.minisuite.tokenizer import train_tokenizer
    from mfpipe.workflow.io import atomic_dir

    p, log = job.params, job.log
    corpus = dict(p.corpus)
    docs = load_documents(corpus)
    train = split_documents(docs, int(corpus["reserve_train_every"]))["train"]
    texts = [d.text for d in train]
    log.info("tokenizer: %d of %d documents (train split), vocab_size %d, min_frequency %d",
             len(texts), len(docs), p.vocab_size, p.min_frequency)
    with atomic_dir(job.output[0]) as tmp:
        train_tokenizer(texts, int(p.vocab_size), int(p.min_frequency), tmp)
    log.info("wrote %s", job.output[0])


def minisuite_tasks(job) -> None:
    """The mini suite's few-shot tasks (fixed random mappings of its tokenizer's vocabulary, mfpipe.minisuite.tasks)
    as `{"tasks": [...]}`, each task in the user task-file format.

    input.tokenizer   the suite's tokenizer folder
    output[0]         tasks.json
    params.tasks      n_tasks (3), n_pairs (64), seed (0)
    """
    import json

    from transformers import AutoTokenizer

    from mfpipe.minisuite.tasks import make_tasks
    from mfpipe.workflow.io import atomic_write_text

    p = dict(job.params.tasks or {})
    tok = AutoTokenizer.from_pretrained(str(job.input.tokenizer))
    tasks = make_tasks(tok, n_tasks=int(p.get("n_tasks", 3)), n_pairs=int(p.get("n_pairs", 64)),
                       seed=int(p.get("seed", 0)))
    atomic_write_text(job.output[0], json.dumps({"tasks": tasks}, indent=1) + "\n")
    job.log.info("wrote %s: %s, %d pairs each", job.output[0], ", ".join(t["name"] for t in tasks),
                 len(tasks[0]["pairs"]))


def minisuite_train(job) -> None:
    """Train one mini-suite model on the corpus's train split (checkpoints at log-spaced steps, induction score of
    every head at every checkpoint; with `fewshot_fraction` > 0 also few-shot rows of the suite's tasks,
    `input.tasks`).

    input.tokenizer   the suite's tokenizer; input.tasks: tasks.json (only for a model with few-shot rows)
    output.checkpoints, output.induction, output.summary   the checkpoints folder, induction.csv and training.json,
                      side by side in the model's folder
    params.cfg        the model's recipe (config `minisuite.models`); params.corpus the suite's corpus
    """
    import json
    from pathlib import Path

    from mfpipe.corpus.documents import load_documents, split_documents
    from mfpipe.minisuite.train import train_mini_model

    log = job.log
    cfg, corpus = dict(job.params.cfg), dict(job.params.corpus)
    out_dir = Path(job.output.checkpoints).parent
    for name in ("induction", "summary"):
        if Path(getattr(job.output, name)).parent != out_dir:
            raise ValueError(f"output.{name} must live in {out_dir} beside output.checkpoints")
    docs = load_documents(corpus)
    texts = [d.text for d in split_documents(docs, int(corpus["reserve_train_every"]))["train"]]
    log.info("%s: %d training documents (train split of %d)", cfg["name"], len(texts), len(docs))
    paths = getattr(job.input, "tasks", None) or []
    paths = [paths] if isinstance(paths, str) else list(paths)
    tasks = json.loads(Path(paths[0]).read_text())["tasks"] if paths else None
    if tasks:
        log.info("%s: few-shot rows (fraction %s) of %d tasks from %s", cfg["name"], cfg.get("fewshot_fraction"),
                 len(tasks), paths[0])
    summary = train_mini_model(cfg, job.input.tokenizer, texts, out_dir, tasks=tasks)  # pinned, one thread
    log.info("%s: %.0f s, final max induction score %.3f, numerics %s", cfg["name"], summary["wall_time_s"],
             summary["final_max_induction"], summary["numerics"])


def induction_table(job) -> None:
    """Induction-score curve (max over heads) per mini-suite model and checkpoint.

    input.induction   every mini model's induction.csv
    output[0]         the table (Markdown)
    """
    from mfpipe.models.induction import induction_summary
    from mfpipe.workflow.tables import to_markdown, write_table

    df = induction_summary(job.input.induction)
    write_table(df, md=job.output[0])
    job.log.info("\n%s", to_markdown(df))
