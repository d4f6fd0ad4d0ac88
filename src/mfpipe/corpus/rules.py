"""The corpus stage's planning: its targets in workflow/rules/corpus.smk, on the run's plan
(:class:`mfpipe.workflow.plan.Plan`)."""

from __future__ import annotations


def targets(plan) -> list[str]:
    """Every model's tracked set on the primary corpus, and the position-coverage table over them (App. F); the
    rank-frequency tables, their cutoff table and fig:zipf."""
    R = plan.results
    t = [f"{R}/corpus/{plan.corpus}/{m}/tracked.json" for m in plan.models]
    t += [f"{R}/tables/coverage_positions.csv", f"{R}/tables/coverage_positions.md"]
    t += [f"{R}/corpus/{plan.corpus}/{m}/rank_frequency.csv" for m in plan.models]
    return t + [f"{R}/tables/zipf_cutoff.csv", f"{R}/tables/zipf_cutoff.md", f"{R}/figures/zipf.pdf",
                f"{R}/figures/zipf.png"]
