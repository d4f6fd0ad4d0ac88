"""Snakemake script: the mini suite's few-shot tasks (fixed random mappings of its tokenizer's vocabulary,
mfpipe.minisuite.tasks) as `{"tasks": [...]}`, each task in the user task-file format."""
import _mfpipe_checkout  # noqa: F401,I001 (first: this checkout's src/ on sys.path)
import json

from mfpipe.workflow.io import atomic_write_text
from mfpipe.workflow.runner import run_logged
from mfpipe.workflow.logs import setup_logging
from mfpipe.minisuite.tasks import make_tasks

sm = snakemake  # noqa: F821 (injected by Snakemake)
log = setup_logging(sm.log[0])


def main() -> None:
    from transformers import AutoTokenizer

    p = dict(sm.params.tasks or {})
    tok = AutoTokenizer.from_pretrained(str(sm.input.tokenizer))
    tasks = make_tasks(tok, n_tasks=int(p.get("n_tasks", 3)), n_pairs=int(p.get("n_pairs", 64)),
                       seed=int(p.get("seed", 0)))
    atomic_write_text(sm.output[0], json.dumps({"tasks": tasks}, indent=1) + "\n")
    log.info("wrote %s: %s, %d pairs each", sm.output[0], ", ".join(t["name"] for t in tasks), len(tasks[0]["pairs"]))


run_logged(main, log)
