"""Snakemake script: induction-score curve (max over heads) per mini-suite model and checkpoint."""
import _mfpipe_checkout  # noqa: F401,I001 (first: this checkout's src/ on sys.path)
from mfpipe.workflow.runner import run_logged
from mfpipe.workflow.logs import setup_logging
from mfpipe.models.induction import induction_summary
from mfpipe.workflow.tables import to_markdown, write_table

sm = snakemake  # noqa: F821
log = setup_logging(sm.log[0])


def main() -> None:
    df = induction_summary(sm.input.induction)
    write_table(df, md=sm.output[0])
    log.info("\n%s", to_markdown(df))


run_logged(main, log)
