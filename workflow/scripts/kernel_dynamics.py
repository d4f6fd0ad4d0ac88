"""Snakemake script: kernel dynamics of one model across its checkpoints (Sec. 5.3, App. N) -- linear CKA of W
between every pair of checkpoints and between adjacent ones, the row spread per head -- as tables and the two
figures (fig:cka, fig:spread), from the per-revision kernel stores of `kernel_revision`.

input.kernels    the kernel.zarr of every revision, in revision order; input.training (optional): the mini suite's
                 training.json (its induction_curve gives the window when params.window is null)
output.cka, output.adjacent (CSV: rev_a, rev_b, step_a, step_b, cka), output.spread (CSV: revision, step, layer,
head, spread), output.cka_pdf, output.cka_png, output.spread_pdf, output.spread_png
params.model, params.revisions (list), params.steps (list of int, same order), params.window (null or [start, stop])
Refuses kernels of another model, tracked set, corpus sample, support or rank, or listed out of revision order.
"""
import _mfpipe_checkout  # noqa: F401,I001 (first: this checkout's src/ on sys.path)
from mfpipe.experiments.substitution.figures import cka_figure, spread_figure
from mfpipe.workflow.runner import run_logged
from mfpipe.models.induction import training_window
from mfpipe.experiments.substitution.kernel_dynamics import check_same_source, dynamics_tables, open_kernel
from mfpipe.workflow.logs import setup_logging
from mfpipe.stats.api import ProvenanceError
from mfpipe.workflow.tables import write_csv

sm = snakemake  # noqa: F821 (injected by Snakemake)
log = setup_logging(sm.log[0] if sm.log else None)


def main() -> None:
    model = str(sm.params.model)
    revisions = [str(r) for r in sm.params.revisions]
    steps = [int(s) for s in sm.params.steps]
    paths = [str(p) for p in sm.input.kernels]
    if len(paths) != len(revisions) or len(steps) != len(revisions):
        raise ValueError(f"{len(paths)} kernel stores, {len(revisions)} revisions and {len(steps)} steps: "
                         "they must correspond one to one, in revision order")
    datasets = [open_kernel(p) for p in paths]
    for p, ds in zip(paths, datasets):
        if str(ds.attrs.get("model")) != model:
            raise ProvenanceError(f"kernel store {p} is for model {ds.attrs.get('model')!r}, expected {model!r}")
    check_same_source(datasets, paths, revisions)
    matrix, cka, adjacent, spread = dynamics_tables(datasets, revisions, steps)
    # the same window as the waypoint figure: from config, else from the mini model's recorded induction curve
    training = getattr(sm.input, "training", None) or []  # [training.json] for a mini model, else []
    training = [training] if isinstance(training, str) else list(training)
    band = tuple(getattr(sm.params, "band", None) or (0.1, 0.8))
    window = training_window(getattr(sm.params, "window", None), training[0] if training else None, band)
    write_csv(cka, sm.output.cka)
    write_csv(adjacent, sm.output.adjacent)
    write_csv(spread, sm.output.spread)
    cka_figure(matrix, adjacent["cka"].to_numpy(), steps, sm.output.cka_pdf, png=sm.output.cka_png, window=window,
               title=f"{model}: how much the mean-field kernel W changes across training")
    spread_figure(spread, sm.output.spread_pdf, png=sm.output.spread_png, window=window,
                  title=f"{model}: how evenly each head divides its attention across token types")
    log.info("%s: %d checkpoints, adjacent CKA %s; induction window %s", model, len(revisions),
             " ".join(f"{v:.3f}" for v in adjacent["cka"]), window)


run_logged(main, log)
