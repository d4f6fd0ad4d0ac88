"""Snakemake script: the cross-model waypoint figure (fig:crossmodel), each model's induction window (configured,
or from the mini model's recorded induction-score curve) shaded in its colour."""
import _mfpipe_checkout  # noqa: F401,I001 (first: this checkout's src/ on sys.path)

from mfpipe.experiments.crossmodel import figures as F
from mfpipe.workflow.runner import run_logged
from mfpipe.workflow.logs import setup_logging
from mfpipe.models.induction import training_window

sm = snakemake  # noqa: F821 (injected by Snakemake)
log = setup_logging(sm.log[0])


def main() -> None:
    p = sm.params
    training = {f.split("/")[-2]: f for f in sm.input.training}  # results/minisuite/<model>/training.json
    models = []
    for m, table in zip(p.models, sm.input.tables):
        window = training_window(p.windows[m], training.get(m), tuple(p.band))
        log.info("%s: %s tokens per step, induction window %s", m, p.tokens_per_step[m], window)
        models.append({"name": m, "table": table, "tokens_per_step": p.tokens_per_step[m], "window": window})
    F.crossmodel_figure(models, sm.output.pdf, sm.output.png, title="Models side by side across training")


run_logged(main, log)
