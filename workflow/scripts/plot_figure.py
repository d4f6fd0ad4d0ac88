"""Snakemake script: one figure (PDF + PNG) from its result table; `params.kind` names the figure function."""
import _mfpipe_checkout  # noqa: F401,I001 (first: this checkout's src/ on sys.path)
from mfpipe.experiments.rollout import figures as F
from mfpipe.workflow.runner import run_logged
from mfpipe.workflow.logs import setup_logging

sm = snakemake  # noqa: F821
log = setup_logging(sm.log[0])
FUNCS = {
    "rollout": F.rollout_figure,
    "teacher_forced": F.teacher_forced_figure,
    "error_decomposition": F.error_decomposition_figure,
    "clustering": F.clustering_figure,
    "cross_corpus": F.cross_corpus_figure,
}


def main() -> None:
    fn = FUNCS[sm.params.kind]
    fn(sm.input.table, sm.output.pdf, sm.output.png, title=sm.params.title)
    log.info("wrote %s and %s", sm.output.pdf, sm.output.png)


run_logged(main, log)
