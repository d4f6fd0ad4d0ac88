"""Snakemake script: Fig. fv from the pooled transfer table (mfpipe.experiments.fv.figures; no model loaded).

input.table       results/tables/fv_{model}_{revision}.csv
output.pdf/png    the figure
params.title      its title
"""
import _mfpipe_checkout  # noqa: F401,I001 (first: this checkout's src/ on sys.path)
import pandas as pd

from mfpipe.experiments.fv.figures import plot_transfer
from mfpipe.jobs import run_logged
from mfpipe.logs import setup_logging

sm = snakemake  # noqa: F821 (injected by Snakemake)
log = setup_logging(sm.log[0])


def main() -> None:
    plot_transfer(pd.read_csv(sm.input.table), sm.output.pdf, title=str(sm.params.title))
    log.info("wrote %s and %s", sm.output.pdf, sm.output.png)


run_logged(main, log)
