"""Snakemake script: a figure of the prompt experiments (PDF + PNG) from the tables its forward-pass job wrote:
`params.kind` icl_classes (Fig. icl, from the per-prompt CSV) or icl_meter (Fig. icl-meter, from the curves, bins
and summary CSVs). No model is loaded."""
import _mfpipe_checkout  # noqa: F401,I001 (first: this checkout's src/ on sys.path)
import pandas as pd

from mfpipe.experiments.prompts import figures as F
from mfpipe.workflow.runner import run_logged
from mfpipe.workflow.logs import setup_logging

sm = snakemake  # noqa: F821
log = setup_logging(sm.log[0])


def main() -> None:
    kind, title = sm.params.kind, sm.params.title
    if kind == "icl_classes":
        F.icl_figure(sm.input.prompts, sm.output.pdf, sm.output.png, title=title)
    elif kind == "icl_meter":
        summary = pd.read_csv(sm.input.summary)
        F.meter_figure(sm.input.curves, sm.input.bins, summary, sm.output.pdf, sm.output.png,
                       title=f"{title}, k={int(summary['k'].iloc[0])}")
    else:
        raise ValueError(f"unknown prompt figure {kind!r}: expected icl_classes or icl_meter")
    log.info("wrote %s and %s", sm.output.pdf, sm.output.png)


run_logged(main, log)
