"""The explorer's targets and the inputs of its rules (workflow/rules/explorer.smk), on the run's plan
(:class:`mfpipe.workflow.plan.Plan`).

The explorer reads what the run already makes. Which tables exist depends on the config (a model without a training
sweep has no substitution sweep, a run without tasks no function vectors), so each table is an input only where the
run plans it: :func:`explorer_files` keeps a table when it, or the table its rule writes beside it (its ``anchor``),
is among the analysis targets the Snakefile plans (``planned``)."""

from __future__ import annotations

from collections.abc import Collection
from importlib import resources

__all__ = ["targets", "explorer_files", "flat_inputs", "static_files", "plotly_version"]

# per rollout revision: input key -> (path pattern, the planned target that says the rule runs)
PER_ROLLOUT = {
    "ranking_heads": ("tables/ranking_heads_{m}_{r}.csv", None),
    "ranking_roles": ("tables/ranking_roles_{m}_{r}.csv", None),
    "positional": ("tables/positional_{m}_{r}.csv", None),
    "positional_repeated": ("tables/positional_repeated_{m}_{r}.csv", None),
    "icl_meter_heads": ("tables/icl_meter_heads_{m}_{r}.csv", "tables/icl_meter_{m}_{r}.csv"),
    "fv": ("tables/fv_{m}_{r}.csv", None),
    "fv_heads": ("fv/{m}/{r}/heads.csv", "tables/fv_{m}_{r}.csv"),
    "divergence": ("tables/divergence_{m}_{r}.csv", None),
    "rollout": ("rollout/{m}/{r}/scores.csv", None),
    "lenses": ("lenses/{m}/{r}/contexts.csv", None),
}
# per model: input key -> path pattern (planned or not at all)
PER_MODEL = {
    "substitution": "tables/substitution_{m}.csv",
    "substitution_heads": "tables/substitution_heads_{m}.csv",
    "kernel_spread": "tables/kernel_spread_{m}.csv",
    "kernel_cka_adjacent": "tables/kernel_cka_adjacent_{m}.csv",
}


def targets(plan) -> list[str]:
    """The index over the models and each model's page."""
    R = plan.results
    return [f"{R}/explorer/{m}/index.html" for m in plan.models] + [f"{R}/explorer/index.html"]


def explorer_files(plan, model: str, planned: Collection[str]) -> dict:
    """``{key: {revision: path}}`` (per-revision inputs) and ``{key: path}`` (per-model tables) of one model's explorer:
    the statistics and deviation stores and head scores of every sweep revision, the head-level tables and run pages
    of each rollout revision, the model's sweep tables; each table only where ``planned`` holds it or its anchor."""
    R, m = plan.results, model
    planned = set(planned)
    revs = list(plan.revisions[m])
    files: dict = {
        "stats": {r: plan.store("stats", model=m, revision=r, dataset="stats") for r in revs},
        "deviation": {r: plan.store("deviation", model=m, revision=r) for r in revs},
        "head_scores": {r: f"{R}/heads/{m}/{r}/head_scores.csv" for r in revs
                        if f"{R}/heads/{m}/{r}/head_scores.csv" in planned},
    }
    for key, (pattern, anchor) in PER_ROLLOUT.items():
        got = {}
        for r in plan.rollout_revisions[m]:
            path = f"{R}/{pattern.format(m=m, r=r)}"
            if f"{R}/{(anchor or pattern).format(m=m, r=r)}" in planned:
                got[r] = path
        if got:
            files[key] = got
    for key, pattern in PER_MODEL.items():
        path = f"{R}/{pattern.format(m=m)}"
        if path in planned:
            files[key] = path
    return files


def flat_inputs(files: dict) -> list[str]:
    """Every path of :func:`explorer_files`, in a stable order (the rule's inputs)."""
    out = []
    for key in sorted(files):
        v = files[key]
        out += [v[r] for r in v] if isinstance(v, dict) else [v]
    return out


def static_files(relative_to=None) -> list[str]:
    """The explorer's own script and style (package data): editing one rebuilds the assets. Relative to
    ``relative_to`` where given (the working directory: a project moved elsewhere must rerun nothing)."""
    import os

    static = resources.files("mfpipe.explorer") / "static"
    paths = [str(static / n) for n in ("explorer.js", "explorer.css")]
    return [os.path.relpath(p, relative_to) for p in paths] if relative_to is not None else paths


def plotly_version() -> str:
    """The plotly package whose JavaScript bundle the assets ship (a param: another version rebuilds them)."""
    from importlib.metadata import version

    return version("plotly")
