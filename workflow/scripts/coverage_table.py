"""Snakemake script: App. F position-coverage table over the configured models."""
import _mfpipe_checkout  # noqa: F401,I001 (first: this checkout's src/ on sys.path)
from mfpipe.workflow.runner import run_logged
from mfpipe.workflow.logs import setup_logging
from mfpipe.corpus.tracked import coverage_table
from mfpipe.workflow.tables import to_markdown, write_table

sm = snakemake  # noqa: F821
log = setup_logging(sm.log[0])


def main() -> None:
    df = coverage_table(sm.input.tracked, sm.params.models)
    write_table(df, csv=sm.output.csv, md=sm.output.md)
    log.info("\n%s", to_markdown(df))


run_logged(main, log)
