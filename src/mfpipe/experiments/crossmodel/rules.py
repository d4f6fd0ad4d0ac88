"""The models-side-by-side slice's planning: its targets and what workflow/rules/crossmodel.smk's rules read, on the
run's plan (:class:`mfpipe.workflow.plan.Plan`)."""

from __future__ import annotations


def tokens_per_step(plan, model: str) -> int | None:
    """Training tokens per step: the model's `tokens_per_step`, or a mini model's batch_size x context_length."""
    spec = plan.models[model]
    if spec.get("tokens_per_step"):
        return int(spec["tokens_per_step"])
    recipe = plan.mini.get(model)
    if spec["source"] == "minisuite" and recipe:
        return int(recipe["batch_size"]) * int(recipe["context_length"])
    return None


def plotted(plan) -> list[str]:
    """The models on the figure's token axis: a sweep of steps and known tokens per step."""
    return [m for m in plan.models if plan.sweeps(m) and tokens_per_step(plan, m)]


def last_rollout_tables(plan, name: str) -> list[str]:
    """Table ``name`` of each model's last rollout revision."""
    return [f"{plan.results}/tables/{name}_{m}_{plan.rollout_revisions[m][-1]}.csv" for m in plan.models]


def targets(plan) -> list[str]:
    """With two or more models: the comparison table, and the figure where a model sweeps."""
    if len(plan.models) < 2:
        return []
    R = plan.results
    t = [f"{R}/tables/crossmodel.csv", f"{R}/tables/crossmodel.md"]
    if plotted(plan):
        t += [f"{R}/figures/crossmodel.pdf", f"{R}/figures/crossmodel.png"]
    return t
