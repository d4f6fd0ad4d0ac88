#!/usr/bin/env python
"""The table of benchmarks/paper_shape.py (issue 58 item 1) from a finished run's files: per job, the benchmark
file's measured seconds and peak RSS, `mfpipe estimate`'s prediction for the same job (its ``--jobs`` CSV), the
tokens the job reads through its model and their bare-forward seconds at the calibration's rate; per stage, their
sums and ratios; Markdown and JSON."""

from __future__ import annotations

import json
from pathlib import Path


def _group_tokens(half: dict, sw: int, T: int, first: int, per_job, budget_windows: int | None = None) -> int:
    """Tokens of one job's run of a half's shards: from shard ``first``, ``per_job`` of them (None: all), within
    the first ``budget_windows`` windows (None: the whole half)."""
    w = int(half["n_windows"]) if budget_windows is None else min(int(half["n_windows"]), budget_windows)
    lo = first * sw
    hi = w if per_job is None else min(w, lo + int(per_job) * sw)
    return max(hi - lo, 0) * T


def job_tokens(rule: str, parts: list[str], cfg: dict, halves: dict) -> int | None:
    """The tokens one job of ``rule`` reads through its model (its benchmark file's path ``parts`` below the rule's
    folder give the dataset and the shard group), from the config and the corpus's manifest ``halves``
    (``fingerprint.json``); None for a job that reads no corpus tokens through a model (tables, figures, merges, the
    rollouts on the stores' kernels) or whose prompts are not windows (the function vectors' few-shot prompts)."""
    T, sw = int(cfg["corpus"]["context_length"]), int(cfg["corpus"]["shard_windows"])
    group = next((int(p[len("group-"):]) for p in parts if p.startswith("group-")), 0)
    ev = int(halves["eval"]["n_windows"])
    if rule == "corpus_shards":  # tokenized, not forwarded: both halves
        return int(halves["stats"]["n_tokens"]) + int(halves["eval"]["n_tokens"])
    if rule == "stats_shard":  # .../<dataset>/group-<i>: the dataset's half
        half = parts[[p.startswith("group-") for p in parts].index(True) - 1]
        return _group_tokens(halves[half], sw, T, group, cfg["stats"]["shards_per_job"])
    if rule in ("deviation_shard", "deviation_shard_recompute"):  # the statistics half, in whole shards of the budget
        budget = cfg["deviation"]["tokens"]
        windows = None if not budget else -(-int(budget) // (sw * T)) * sw
        return _group_tokens(halves["stats"], sw, T, group, cfg["deviation"]["shards_per_job"], windows)
    if rule in ("substitution", "substitution_recompute", "substitution_topn"):
        return min(-(-int(cfg["substitution"]["eval_tokens"]) // T), ev) * T
    p, pos = cfg["prompts"], cfg["positional"]
    k = min(int(p["icl_meter"]["chunk_length"] or T), (T - 1) // 2)
    rk = int(pos["repeated"]["chunk_length"] or (T - 1) // 2)
    per_rule = {
        "head_scores": int(cfg["ranking"]["head_scores"]["n_sequences"]) * T,
        "jlens": int(cfg["jlens"]["n_positions"]) * T,  # the windows of its sampled positions
        "lenses": (int(p["lenses"]["n_lens_heads"]) + len(p["lenses"]["heads"])) * int(p["lenses"]["per_head"]) * T,
        "icl_classes": (3 * int(p["icl"]["n_prompts"]) + int(p["icl"]["n_fewshot"])) * T,
        "icl_meter": min(int(p["icl_meter"]["n_sequences"]), ev) * (2 * k + 1),
        # the natural sample and the repeated [BOS; c; c] chunks
        "positional": min(int(pos["tokens"]), ev * T) + min(int(pos["repeated"]["n_sequences"]), ev) * (2 * rk + 1),
        "positional_ablation": min(int(pos["ablation_windows"]), ev) * T,
    }
    per_rule.update({f"{r}_recompute": per_rule[r] for r in ("icl_classes", "icl_meter")})
    return per_rule.get(rule)


def run_config(workdir: Path, files: list[str]) -> dict:
    """The config the run saw (its files over the clone's config/config.yaml, the schema's defaults filled in)."""
    from mfpipe.estimate.jobs import load_config

    return load_config([workdir / f for f in files], base=workdir / "config" / "config.yaml")


def job_frame(workdir: Path, files: list[str], calibration: dict):
    """One row per job of the finished run: its rule, stage, model, measured wall seconds and peak RSS (the
    benchmark file), the estimate's predicted seconds and peak (``estimate_jobs.csv``, joined on the benchmark
    file), the tokens it reads (:func:`job_tokens`) and those tokens' bare-forward seconds at the calibration's
    ``forward_s_per_token``."""
    import pandas as pd

    from mfpipe.estimate.report import stage_of_rules
    from mfpipe.workflow.costs import read_benchmarks

    cfg = run_config(workdir, files)
    real = read_benchmarks(workdir / "logs" / "benchmarks")
    est = pd.read_csv(workdir / "estimate_jobs.csv")
    est["key"] = [str(Path(j).relative_to(Path("logs/benchmarks") / r).with_suffix(""))
                  for j, r in zip(est["job"], est["rule"])]
    est = est.set_index(["rule", "key"])
    stages = stage_of_rules(workdir / "workflow" / "rules")
    manifests = {}
    rows = []
    for r in real.itertuples():
        parts = Path(r.job).parts
        model = next((m["name"] for m in cfg["models"] if m["name"] in parts), None)
        if model is not None and model not in manifests:
            path = workdir / cfg["results"] / "corpus" / cfg["corpus"]["name"] / model / "shards" / "fingerprint.json"
            manifests[model] = json.loads(path.read_text())["halves"]
        tokens = job_tokens(r.rule, list(parts), cfg, manifests[model]) if model else None
        rate = (calibration["models"].get(model) or {}).get("forward_s_per_token") if model else None
        hit = est.loc[(r.rule, r.job)] if (r.rule, r.job) in est.index else None
        rows.append({"rule": r.rule, "stage": stages.get(r.rule, r.rule), "model": model, "job": r.job,
                     "measured_s": r.wall_s, "measured_rss_mb": r.max_rss_mb,
                     "predicted_s": None if hit is None else float(hit["seconds"]),
                     "predicted_peak_mb": None if hit is None else float(hit["peak_mb"]),
                     "tokens": tokens, "bare_forward_s": tokens * rate if tokens and rate else None})
    return pd.DataFrame(rows)


def stage_table(jobs):
    """Per stage: jobs, measured and predicted job-seconds and their ratio, the largest measured and predicted peak
    and their ratio, the tokens its model jobs read, their bare-forward seconds and measured / bare forward; a total
    row."""
    import numpy as np
    import pandas as pd

    g = jobs.groupby("stage", sort=False).agg(
        jobs=("measured_s", "size"), measured_s=("measured_s", "sum"), predicted_s=("predicted_s", "sum"),
        unpredicted=("predicted_s", lambda s: int(s.isna().sum())), measured_rss_mb=("measured_rss_mb", "max"),
        predicted_peak_mb=("predicted_peak_mb", "max"), tokens=("tokens", lambda s: s.sum(min_count=1)),
        bare_forward_s=("bare_forward_s", lambda s: s.sum(min_count=1)))
    g = g.sort_values("measured_s", ascending=False)
    total = pd.DataFrame([{"jobs": g["jobs"].sum(), "measured_s": g["measured_s"].sum(),
                           "predicted_s": g["predicted_s"].sum(), "unpredicted": g["unpredicted"].sum(),
                           "measured_rss_mb": g["measured_rss_mb"].max(), "predicted_peak_mb": g["predicted_peak_mb"].max(),
                           "tokens": np.nan, "bare_forward_s": np.nan}], index=["total"])
    t = pd.concat([g, total])
    t["time_ratio"] = t["predicted_s"] / t["measured_s"]
    t["rss_ratio"] = t["predicted_peak_mb"] / t["measured_rss_mb"]
    t["bare_forwards"] = t["measured_s"] / t["bare_forward_s"]
    return t.reset_index(names="stage")


COLUMNS = {"stage": "stage", "jobs": "jobs", "measured_s": "measured s", "predicted_s": "predicted s",
           "time_ratio": "predicted / measured", "measured_rss_mb": "measured peak MiB",
           "predicted_peak_mb": "predicted peak MiB", "rss_ratio": "predicted / measured peak",
           "tokens": "tokens read", "bare_forward_s": "bare forward s", "bare_forwards": "measured / bare forward"}


def markdown(preset: str, info: dict, table) -> str:
    """One preset's section: what ran, the table, what its columns are."""
    import math

    from mfpipe.workflow.tables import to_markdown

    def cell(v):
        if v is None or (isinstance(v, float) and math.isnan(v)):
            return "-"
        if isinstance(v, float):
            return f"{v:.2f}" if abs(v) < 10 else f"{v:.0f}"
        return str(v)

    shown = table[list(COLUMNS)].rename(columns=COLUMNS).astype(object).map(cell)
    cal = info["calibration"]["models"]
    rates = ", ".join(f"{m} {1 / c['forward_s_per_token']:.0f} tok/s ({c['source']}; L={c['layers']}, "
                      f"d={c['d_model']}, T={c['T']}, batch {c['batch_size']})" for m, c in cal.items())
    unpredicted = int(table.loc[table["stage"] == "total", "unpredicted"].iloc[0])
    on = f" on {info['device']}" if info.get("device") else ""
    return (f"### {preset}\n\n`snakemake --cores {info['cores']} --configfile {' '.join(info['files'])}`{on}: "
            f"{info['wall_s']:.0f} s wall. Bare forward: the rate of `mfpipe estimate`'s own calibration "
            f"(forward_s_per_token): {rates}."
            + (" The run had a failed job (snakemake --keep-going; its log's end in failed.txt): the jobs that "
               "depend on it did not run." if info.get("failed") else "")
            + (f" {unpredicted} job(s) had no prediction (not in the estimate's plan)." if unpredicted else "")
            + "\n\n" + to_markdown(shown))


def write_report(root: Path, results: dict) -> tuple[Path, Path]:
    """``paper_shape.md`` and ``paper_shape.json`` in ``root`` from ``{preset: (info, stage table, job frame)}``."""
    md = ["# A paper-shape run (issue 58 item 1)\n",
          "Per stage (the rule file): the job-seconds and the largest peak RSS of the run's benchmark files "
          "(logs/benchmarks), `mfpipe estimate`'s prediction for the same config files (its --jobs CSV) and "
          "predicted / measured; the tokens the stage's model jobs read (corpus windows, prompts; '-' for stages "
          "that read none through a model) and the measured job-seconds over those tokens' bare-forward seconds.\n"]
    out = {}
    for preset, (info, table, jobs) in results.items():
        md.append(markdown(preset, info, table))
        out[preset] = {"wall_s": info["wall_s"], "cores": info["cores"], "configfiles": info["files"],
                       "device": info.get("device"),
                       "calibration": info["calibration"]["models"],
                       "stages": json.loads(table.to_json(orient="records")),
                       "jobs": json.loads(jobs.to_json(orient="records"))}
    (root / "paper_shape.md").write_text("\n".join(md))
    (root / "paper_shape.json").write_text(json.dumps(out, indent=1))
    return root / "paper_shape.md", root / "paper_shape.json"
