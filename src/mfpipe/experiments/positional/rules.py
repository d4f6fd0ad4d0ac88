"""The positional slice's planning: its targets and input functions of workflow/rules/positional.smk, on the run's
plan (:class:`mfpipe.workflow.plan.Plan`)."""

from __future__ import annotations

TABLES = ("positional", "positional_classes", "positional_repeated", "positional_ablation")


def enabled(plan, model: str) -> bool:
    """Whether ``model`` runs the positional analysis (``positional.models``: null, every model)."""
    models = plan.config["positional"]["models"]
    return models is None or model in models


def repeated_input(plan, wildcards) -> list[str]:
    """The repeated-text rises the ranking tables merge (none where the model does not run the slice)."""
    if not enabled(plan, wildcards.model):
        return []
    return [f"{plan.results}/tables/positional_repeated_{wildcards.model}_{wildcards.revision}.csv"]


def settings(plan) -> dict:
    """The job's ``params.positional``: the section without the run-wide keys (which models run it)."""
    return {k: v for k, v in plan.config["positional"].items() if k not in ("models", "batch_size")}


def targets(plan) -> list[str]:
    """Per rollout revision of every model that runs it: the four tables (CSV and Markdown) and the figure."""
    R, t = plan.results, []
    for m in plan.models:
        if not enabled(plan, m):
            continue
        for rev in plan.rollout_revisions[m]:
            t += [f"{R}/tables/{name}_{m}_{rev}.{e}" for name in TABLES for e in ("csv", "md")]
            t += [f"{R}/figures/positional_{m}_{rev}.{e}" for e in ("pdf", "png")]
    return t
