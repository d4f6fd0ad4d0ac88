"""The head ranking's planning: its targets and the input functions of workflow/rules/ranking.smk, on the run's plan
(:class:`mfpipe.workflow.plan.Plan`)."""

from __future__ import annotations


def deviation_results(plan, wildcards) -> list[str]:
    """The deviation store of every sweep revision of a model (Exp. 3 reads them all)."""
    return [plan.store("deviation", model=wildcards.model, revision=rev) for rev in plan.revisions[wildcards.model]]


def head_score_results(plan, wildcards) -> list[str]:
    """The head scores of every sweep revision of a model (Exp. 3 reads them all)."""
    return [f"{plan.results}/heads/{wildcards.model}/{rev}/head_scores.csv" for rev in plan.revisions[wildcards.model]]


def targets(plan) -> list[str]:
    """Per model: every sweep revision's head scores; for a real sweep the Exp. 3 table and figure; per rollout
    revision the ranking tables, the split-half stability and the M_cov / M_ctx scatter."""
    R, t = plan.results, []
    for m in plan.models:
        t += [f"{R}/heads/{m}/{rev}/head_scores.csv" for rev in plan.revisions[m]]
        if plan.sweeps(m):
            t += [f"{R}/tables/exp3_correlation_{m}.csv"] + [f"{R}/figures/exp3_correlation_{m}.{e}" for e in ("pdf", "png")]
        for rev in plan.rollout_revisions[m]:
            t += [f"{R}/tables/ranking_{name}_{m}_{rev}.{e}" for name in ("top", "bottom", "stability") for e in ("csv", "md")]
            t += [f"{R}/tables/ranking_heads_{m}_{rev}.csv"]
            # Sec. 6.3's behavioural roles in the ranking; tab:gemma's single-revision S-bar / induction correlation
            t += [f"{R}/tables/{name}_{m}_{rev}.{e}" for name in ("ranking_roles", "exp3_single") for e in ("csv", "md")]
            t += [f"{R}/figures/ccmf_scatter_{m}_{rev}.{e}" for e in ("pdf", "png")]
    return t
