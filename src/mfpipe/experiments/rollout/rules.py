"""The rollout slice's planning: its targets, its figures and the output paths of workflow/rules/rollout.smk, on the
run's plan (:class:`mfpipe.workflow.plan.Plan`)."""

from __future__ import annotations

from mfpipe.experiments.rollout import exclusion

# the tables of one rollout revision (CSV + Markdown): Table 1, the error accounting, App. G, App. I
TABLES = ("rollout", "teacher_forced", "error_decomposition", "mlp_gap", "clustering", "anisotropy", "cross_corpus",
          "layer_localized", "rogue_dims", "pinning")
# the divergence diagnostics' tables (App. llama): results/tables/divergence[_<part>]_<model>_<revision>.csv, the steps
# table without a part; one Markdown page for all of them (divergence_<model>_<revision>.md)
DIVERGENCE_TABLES = ("steps", "curvature", "units", "tokens", "top_tokens", "magnitude", "pairs", "pairs_summary")


def divergence_outputs(plan) -> dict[str, str]:
    """The divergence job's CSV outputs, table name -> path template of ``{model}`` and ``{revision}``."""
    R = plan.results
    return {k: f"{R}/tables/divergence{'' if k == 'steps' else '_' + k}_{{model}}_{{revision}}.csv"
            for k in DIVERGENCE_TABLES}


def divergence_targets(plan, model: str, revision: str) -> list[str]:
    R = plan.results
    t = [f"{R}/tables/divergence{'' if k == 'steps' else '_' + k}_{model}_{revision}.csv" for k in DIVERGENCE_TABLES]
    return t + [f"{R}/tables/divergence_{model}_{revision}.md"] + [
        f"{R}/figures/divergence_{model}_{revision}.{ext}" for ext in ("pdf", "png")]


def figures(plan) -> dict[str, tuple[str, str]]:
    """The rollout figures, one rule each (results/figures/<name>_<model>_<revision>.{pdf,png}): figure name ->
    (the table it is drawn from, its title), both templates of ``{model}`` and ``{revision}``."""
    R = plan.results
    return {
        "rollout": (f"{R}/rollout/{{model}}/{{revision}}/scores.csv",
                    "Mean-field rollout vs alternative kernels: {model} @ {revision}"),
        "teacher_forced": (f"{R}/tables/teacher_forced_{{model}}_{{revision}}.csv",
                           "Teacher-forced attention output: {model} @ {revision}"),
        "error_decomposition": (f"{R}/tables/error_decomposition_{{model}}_{{revision}}.csv",
                                "Per-layer error accounting: {model} @ {revision}"),
        "clustering": (f"{R}/tables/clustering_{{model}}_{{revision}}.csv",
                       "Within-type clustering: {model} @ {revision}"),
        "cross_corpus": (f"{R}/tables/cross_corpus_{{model}}_{{revision}}.csv",
                         "Cross-corpus rollout (centered cosine): {model} @ {revision}"),
        "curves": (f"{R}/rollout/{{model}}/{{revision}}/cross_corpus_scores.csv",
                   "Per-layer rollout quality across corpora: {model} @ {revision}"),
    }


def table_stem(plan, name: str) -> str:
    """results/tables/<name>_{model}_{revision}: one table of the error accounting (CSV + Markdown)."""
    return f"{plan.results}/tables/{name}_{{model}}_{{revision}}"


def figure_targets(plan, model: str, revision: str) -> list[str]:
    R = plan.results
    return [f"{R}/figures/{fig}_{model}_{revision}.{ext}" for fig in figures(plan) for ext in ("pdf", "png")]


def targets(plan) -> list[str]:
    """Every output of the rollout stage for the configured models and revisions."""
    R = plan.results
    t = [f"{R}/tables/coverage_attention.csv", f"{R}/tables/coverage_attention.md"]
    for m in plan.models:
        for rev in plan.rollout_revisions[m]:
            t.append(f"{R}/rollout/{m}/{rev}/scores.csv")
            for name in TABLES:
                t += [f"{R}/tables/{name}_{m}_{rev}.csv", f"{R}/tables/{name}_{m}_{rev}.md"]
            t += figure_targets(plan, m, rev) + divergence_targets(plan, m, rev)
    return t + exclusion.targets(plan)  # the exclusion arm's tables (workflow/rules/exclusion.smk)
