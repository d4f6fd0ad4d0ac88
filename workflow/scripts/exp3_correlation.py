"""Snakemake script: Sec. 6.1 Experiment 3 (fig:e15-correlation) for one model: at every training checkpoint the
cross-head Spearman correlation between the mean-field deviation S_bar (per-revision deviation store) and the
behavioural induction score (per-revision head_scores.csv) -> table (CSV) and figure (PDF + PNG)."""
import _mfpipe_checkout  # noqa: F401,I001 (first: this checkout's src/ on sys.path)

from mfpipe.workflow import tables as T
from mfpipe.deviation.store import open_deviation
from mfpipe.experiments.ranking.figures import exp3_figure, exp3_table
from mfpipe.experiments.ranking.head_scores import open_head_scores
from mfpipe.models.induction import training_window
from mfpipe.workflow.runner import run_logged
from mfpipe.workflow.logs import setup_logging

sm = snakemake  # noqa: F821 (injected by Snakemake)
log = setup_logging(sm.log[0])


def main() -> None:
    p = sm.params
    deviation, heads = list(sm.input.deviation), list(sm.input.heads)
    revisions, steps = [str(r) for r in p.revisions], [None if s is None else int(s) for s in p.steps]
    if not len(deviation) == len(heads) == len(revisions) == len(steps):
        raise ValueError(f"{len(deviation)} deviation stores, {len(heads)} head-score tables, {len(revisions)} "
                         f"revisions and {len(steps)} steps: one of each per revision")
    rows = []
    for rev, step, dev_path, heads_path in zip(revisions, steps, deviation, heads):
        scores = open_head_scores(heads_path)
        if scores.attrs.get("revision") not in (None, rev):  # inputs listed out of revision order
            raise ValueError(f"{heads_path} holds revision {scores.attrs['revision']}, expected {rev}")
        dev = open_deviation(dev_path, {"model": str(p.model), "revision": rev})
        rows.append({"model": str(p.model), "revision": rev, "step": step, "S_bar": dev["S_bar"],
                     "induction": scores["induction"]})
    df = exp3_table(rows)
    T.write_csv(df, sm.output.csv)
    training = getattr(sm.input, "training", None) or []  # [training.json] for a mini model, else []
    training = [training] if isinstance(training, str) else list(training)
    band = tuple(getattr(p, "band", None) or (0.1, 0.8))
    window = training_window(getattr(p, "window", None), training[0] if training else None, band)
    exp3_figure(df, sm.output.png, window=window, title=getattr(p, "title", None))
    log.info("induction window: %s\n%s", window, T.to_markdown(df, floatfmt="{:.3g}"))


run_logged(main, log)
