"""The prompt experiments' planning: their targets and the inputs of workflow/rules/prompts.smk, on the run's plan
(:class:`mfpipe.workflow.plan.Plan`)."""

from __future__ import annotations


def icl_task_data(plan) -> list[str]:
    """The vendored datasets named in `prompts.icl.tasks` (mfpipe.tasks): editing one reruns the prompt-class jobs."""
    return [f for f in (plan.task_data(f"{t}.json") for t in plan.config["prompts"]["icl"]["tasks"]) if f]


def lens_vectors(plan) -> int:
    """The deviation vectors the lenses job decodes through the J-lens (one per context: ``per_head`` of each of the
    ``n_lens_heads`` heads and the named ones), which :func:`mfpipe.jlens.rules.decode_path` weighs against the full
    J."""
    p = plan.config["prompts"]["lenses"]
    return (int(p["n_lens_heads"]) + len(p["heads"] or [])) * int(p["per_head"])


def targets(plan) -> list[str]:
    """Per rollout revision of every model: the lenses, the prompt-class and instance-meter tables and their
    figures (Exp. 2, 1)."""
    R, t = plan.results, []
    for m in plan.models:
        for rev in plan.rollout_revisions[m]:
            t += [f"{R}/lenses/{m}/{rev}/{f}" for f in ("contexts.md", "contexts.html", "decode.md", "contexts.csv")]
            t += [f"{R}/tables/{name}_{m}_{rev}.{e}" for name in ("icl_classes", "icl_corr", "icl_meter")
                  for e in ("csv", "md")]
            t += [f"{R}/figures/{name}_{m}_{rev}.{e}" for name in ("icl_classes", "icl_meter") for e in ("pdf", "png")]
    return t
