"""The mini suite's planning: the input functions of workflow/rules/minisuite.smk, on the run's plan
(:class:`mfpipe.workflow.plan.Plan`)."""

from __future__ import annotations


def tasks_input(plan, wildcards) -> list[str]:
    """The few-shot tasks, for a mini model that trains on few-shot rows (`fewshot_fraction` > 0)."""
    if float(plan.mini[wildcards.mini].get("fewshot_fraction") or 0) > 0:
        return [f"{plan.results}/minisuite/tasks.json"]
    return []
