"""Snakemake script: train one mini-suite model on the corpus's train split (checkpoints at
log-spaced steps, induction score of every head at every checkpoint; with `fewshot_fraction` > 0 also few-shot
rows of the suite's tasks, `input.tasks`)."""
import _mfpipe_checkout  # noqa: F401,I001 (first: this checkout's src/ on sys.path)
import json
from pathlib import Path

from mfpipe.corpus.documents import load_documents, split_documents
from mfpipe.workflow.runner import run_logged
from mfpipe.workflow.logs import setup_logging
from mfpipe.minisuite.train import train_mini_model

sm = snakemake  # noqa: F821 (injected by Snakemake)
log = setup_logging(sm.log[0])


def main() -> None:
    cfg, corpus = dict(sm.params.cfg), dict(sm.params.corpus)
    out_dir = Path(sm.output.checkpoints).parent
    for name in ("induction", "summary"):
        if Path(getattr(sm.output, name)).parent != out_dir:
            raise ValueError(f"output.{name} must live in {out_dir} beside output.checkpoints")
    docs = load_documents(corpus)
    texts = [d.text for d in split_documents(docs, int(corpus["reserve_train_every"]))["train"]]
    log.info("%s: %d training documents (train split of %d), %d threads", cfg["name"], len(texts), len(docs), sm.threads)
    paths = getattr(sm.input, "tasks", None) or []
    paths = [paths] if isinstance(paths, str) else list(paths)
    tasks = json.loads(Path(paths[0]).read_text())["tasks"] if paths else None
    if tasks:
        log.info("%s: few-shot rows (fraction %s) of %d tasks from %s", cfg["name"], cfg.get("fewshot_fraction"),
                 len(tasks), paths[0])
    summary = train_mini_model(cfg, sm.input.tokenizer, texts, out_dir, threads=sm.threads, tasks=tasks)
    log.info("%s: %.0f s, final max induction score %.3f", cfg["name"], summary["wall_time_s"], summary["final_max_induction"])


run_logged(main, log)
