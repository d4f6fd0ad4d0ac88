"""The models-side-by-side jobs, one function per rule of workflow/rules/crossmodel.smk (run by
mfpipe.workflow.runner.run_job). Each imports what it runs inside its own body, so its code inputs are its own."""

from __future__ import annotations


def crossmodel_table(job) -> None:
    """The cross-model comparison table (one row per model: rollout accuracy, ΔL and D_MF at the last revision and at
    their peak, the top heads by S̄ with their roles, the function-vector transfer where the model has it).

    input.substitution, input.rollout, input.ranking   each model's tables, in params.models order
    input.fv          the function-vector tables of params.fv_models
    output.csv / md   the table; params.tokens_per_step per model
    """
    from mfpipe.experiments.crossmodel import compare as C
    from mfpipe.workflow import tables as T

    p, inp = job.params, job.input
    fv = dict(zip(p.fv_models, inp.fv))
    rows = [C.comparison_row(m, substitution=s, rollout=r, ranking=h, tokens_per_step=p.tokens_per_step[m],
                             fv=fv.get(m))
            for m, s, r, h in zip(p.models, inp.substitution, inp.rollout, inp.ranking)]
    df = C.comparison_table(rows)
    T.write_csv(df, job.output.csv)
    T.write_text(T.to_markdown(df, floatfmt="{:.4f}"), job.output.md)
    job.log.info("\n%s", T.to_markdown(df, floatfmt="{:.4f}"))


def figure_crossmodel(job) -> None:
    """The cross-model waypoint figure (fig:crossmodel), each model's induction window (configured, or from the mini
    model's recorded induction-score curve) shaded in its colour.

    input.tables      each plotted model's substitution sweep table (params.models order)
    input.training    the mini models' training.json (results/minisuite/<model>/training.json)
    params            models, tokens_per_step, windows (configured induction windows), band
    """
    from mfpipe.experiments.crossmodel import figures as F
    from mfpipe.models.induction import training_window

    p = job.params
    training = {f.split("/")[-2]: f for f in job.input.training}  # results/minisuite/<model>/training.json
    models = []
    for m, table in zip(p.models, job.input.tables):
        window = training_window(p.windows[m], training.get(m), tuple(p.band))
        job.log.info("%s: %s tokens per step, induction window %s", m, p.tokens_per_step[m], window)
        models.append({"name": m, "table": table, "tokens_per_step": p.tokens_per_step[m], "window": window})
    F.crossmodel_figure(models, job.output.pdf, job.output.png, title="Models side by side across training")
