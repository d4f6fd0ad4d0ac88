"""Where a run's time went: Snakemake's benchmark files (every rule has ``benchmark:``, one file per job under
``logs/benchmarks/<rule>/…``) summed by rule and by stage (the rule file that defines the rule).

A benchmark file is Snakemake's TSV: ``s`` (wall seconds), ``max_rss`` (MB), ``cpu_time`` (seconds of CPU, user and
system) and more; a job too short to sample has ``NA`` for the memory columns. A job that ran several times keeps
its last file. Pure pandas."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import pandas as pd

__all__ = ["read_benchmarks", "cost_tables", "costs_markdown"]


def read_benchmarks(folder: str | Path) -> pd.DataFrame:
    """One row per job: ``rule`` (the first folder below ``folder``), ``job`` (the file's path below the rule's
    folder, i.e. its wildcards), ``wall_s``, ``cpu_s``, ``max_rss_mb``."""
    rows = []
    folder = Path(folder)
    for path in sorted(folder.rglob("*.tsv")):
        rel = path.relative_to(folder)
        df = pd.read_csv(path, sep="\t", na_values=["NA", "-"])
        if df.empty or "s" not in df.columns:
            continue
        last = df.iloc[-1]
        rows.append({"rule": rel.parts[0], "job": str(Path(*rel.parts[1:]).with_suffix("")),
                     "wall_s": float(last["s"]), "cpu_s": float(last.get("cpu_time", float("nan"))),
                     "max_rss_mb": float(last.get("max_rss", float("nan")))})
    return pd.DataFrame(rows, columns=["rule", "job", "wall_s", "cpu_s", "max_rss_mb"])


def cost_tables(jobs: pd.DataFrame, stages: Mapping[str, str]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(by rule, by stage), each sorted by total wall time: jobs, total / mean / max wall seconds, CPU seconds, the
    CPU share of the wall time (a job's mean busy cores), the largest peak RSS and the share of all job-seconds.
    ``stages`` maps a rule to its stage; a rule it lacks is its own stage."""
    df = jobs.assign(stage=[stages.get(r, r) for r in jobs["rule"]])
    total = float(df["wall_s"].sum()) or 1.0

    def summarise(by: list[str]) -> pd.DataFrame:
        g = df.groupby(by, sort=False)
        out = g.agg(jobs=("wall_s", "size"), wall_s=("wall_s", "sum"), mean_s=("wall_s", "mean"),
                    max_s=("wall_s", "max"), cpu_s=("cpu_s", "sum"), max_rss_mb=("max_rss_mb", "max")).reset_index()
        out["cores"] = out["cpu_s"] / out["wall_s"].where(out["wall_s"] > 0)
        out["share"] = out["wall_s"] / total
        return out.sort_values("wall_s", ascending=False, kind="stable").reset_index(drop=True)

    return summarise(["stage", "rule"]), summarise(["stage"])


def costs_markdown(by_rule: pd.DataFrame, by_stage: pd.DataFrame) -> str:
    """Both tables as Markdown, with the total job-seconds (the wall time of the run is less where jobs ran side by
    side)."""
    from mfpipe.workflow.tables import to_markdown

    def fmt(t: pd.DataFrame) -> pd.DataFrame:
        t = t.copy()
        for c in ("wall_s", "mean_s", "max_s", "cpu_s"):
            t[c] = t[c].round(1)
        t["max_rss_mb"] = t["max_rss_mb"].round(0)
        t["cores"] = t["cores"].round(2)
        t["share"] = (100 * t["share"]).round(1).astype(str) + " %"
        return t

    total = float(by_stage["wall_s"].sum())
    n = int(by_stage["jobs"].sum())
    return (f"Job-seconds of the run's jobs: {total:.0f} s over {n} jobs (Snakemake's benchmark files, "
            "logs/benchmarks/<rule>/…; the run's wall time is less where jobs ran side by side).\n\n"
            "## By stage\n\n" + to_markdown(fmt(by_stage), floatfmt="{:g}") +
            "\n## By rule\n\n" + to_markdown(fmt(by_rule), floatfmt="{:g}"))
