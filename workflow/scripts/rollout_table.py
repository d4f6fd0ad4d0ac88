"""Snakemake script: Table 1 (cross-layer mean and SE over layers per kernel) from one rollout's scores."""
import _mfpipe_checkout  # noqa: F401,I001 (first: this checkout's src/ on sys.path)
import pandas as pd

from mfpipe.workflow import tables as T
from mfpipe.experiments.rollout import tables as RT
from mfpipe.workflow.runner import run_logged
from mfpipe.workflow.logs import setup_logging

sm = snakemake  # noqa: F821
log = setup_logging(sm.log[0])


def main() -> None:
    summary = RT.rollout_summary(pd.read_csv(sm.input.scores))
    T.write_csv(summary, sm.output.csv)
    md = RT.summary_markdown(summary, title=f"Rollout fidelity: {sm.wildcards.model} @ {sm.wildcards.revision}")
    T.write_text(md, sm.output.md)
    log.info("\n%s", md)


run_logged(main, log)
