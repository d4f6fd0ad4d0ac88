"""The mini suite's planning: its targets and the input functions of workflow/rules/minisuite.smk, on the run's plan
(:class:`mfpipe.workflow.plan.Plan`)."""

from __future__ import annotations


def tasks_input(plan, wildcards) -> list[str]:
    """The few-shot tasks, for a mini model that trains on few-shot rows (`fewshot_fraction` > 0)."""
    if float(plan.mini[wildcards.mini].get("fewshot_fraction") or 0) > 0:
        return [f"{plan.results}/minisuite/tasks.json"]
    return []


def training_summary(plan, wildcards) -> list[str]:
    """A mini model's training.json (its recorded induction-score curve shades the induction window of the training
    sweep's figures); nothing for another model."""
    if plan.is_mini(wildcards.model):
        return [f"{plan.results}/minisuite/{wildcards.model}/training.json"]
    return []


def targets(plan) -> list[str]:
    """Per mini-suite model the run analyses: its induction scores; with any, the induction table."""
    R, t = plan.results, []
    mini_used = sorted({m for m, spec in plan.models.items() if spec["source"] == "minisuite"})
    for m in mini_used:
        t.append(f"{R}/minisuite/{m}/induction.csv")
    if mini_used:
        t.append(f"{R}/tables/induction.md")
    return t
