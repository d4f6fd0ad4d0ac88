"""Snakemake script: the training-waypoint figure (fig:mfgap) of one model from its sweep table, or with
params.kind = topn its top-N sensitivity (fig:vocab-robustness), with the induction window shaded (configured,
or from the mini model's recorded induction-score curve)."""
import _mfpipe_checkout  # noqa: F401,I001 (first: this checkout's src/ on sys.path)

from mfpipe.experiments.substitution import figures as F
from mfpipe.models.induction import training_window
from mfpipe.workflow.runner import run_logged
from mfpipe.workflow.logs import setup_logging

sm = snakemake  # noqa: F821 (injected by Snakemake)
log = setup_logging(sm.log[0])


def main() -> None:
    p = sm.params
    training = getattr(sm.input, "training", None) or []  # [training.json] for a mini model, else []
    training = [training] if isinstance(training, str) else list(training)
    window = training_window(p.window, training[0] if training else None, tuple(p.band))
    log.info("induction window: %s", window)
    draw = F.topn_figure if getattr(p, "kind", "waypoint") == "topn" else F.waypoint_figure
    draw(sm.input.table, sm.output.pdf, sm.output.png, window=window, title=str(p.title))


run_logged(main, log)
