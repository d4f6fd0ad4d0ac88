"""The corpus stage's planning: its targets in workflow/rules/corpus.smk, on the run's plan
(:class:`mfpipe.workflow.plan.Plan`)."""

from __future__ import annotations


def targets(plan) -> list[str]:
    """Every model's tracked set on the primary corpus, and the position-coverage table over them (App. F)."""
    R = plan.results
    t = [f"{R}/corpus/{plan.corpus}/{m}/tracked.json" for m in plan.models]
    return t + [f"{R}/tables/coverage_positions.csv", f"{R}/tables/coverage_positions.md"]
