"""The J-lens's planning: the targets of workflow/rules/jlens.smk, on the run's plan
(:class:`mfpipe.workflow.plan.Plan`). The stores themselves are asked for by what decodes through them (the lenses,
the function vectors); the default target asks for the checks table, which the same job writes."""

from __future__ import annotations


def targets(plan) -> list[str]:
    """Per rollout revision of every model (where the lenses draw the J-lens): the J-lens checks table, CSV and
    Markdown."""
    R, t = plan.results, []
    for m in plan.models:
        for rev in plan.rollout_revisions[m]:
            t += [f"{R}/tables/jlens_checks_{m}_{rev}.{e}" for e in ("csv", "md")]
    return t
