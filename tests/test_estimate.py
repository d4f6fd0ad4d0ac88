"""`mfpipe estimate` (issue 49 item 1): the config as Snakemake merges it, the corpus halves predicted, the dry run
with planned shards standing in for the corpus checkpoint, the dry run's job blocks parsed, the calibration's
measurements, the cost model's arithmetic and the one-line refusals naming a knob. The plan against a finished
run's jobs: tests/test_workflow.py (test_estimate_plans_the_jobs_the_run_ran)."""

import json
import math
import shutil
from pathlib import Path

import pytest

from mfpipe.estimate import costs as C
from mfpipe.estimate import jobs as J
from mfpipe.estimate import report as R

REPO = Path(__file__).resolve().parents[1]
CI = REPO / "config" / "ci.yaml"

DRY_RUN = """
Building DAG of jobs...
[Fri Nov 27 21:49:04 2026]
rule stats_shard:
    input: results/corpus/shakespeare/mini-neox/shards, /work/main/src/mfpipe/stats/jobs.py
    output: results/stats/mini-neox/step1088/partials/stats/group-00000
    jobid: 94
    benchmark: logs/benchmarks/stats_shard/stats/mini-neox/step1088/stats/group-00000.tsv
    reason: Forced execution
    wildcards: model=mini-neox, revision=step1088, dataset=stats, i=00000
    resources: tmpdir=/tmp, runtime=720

[Fri Nov 27 21:49:04 2026]
localrule coverage_table:
    input: results/corpus/shakespeare/mini-gpt2/tracked.json
    output: results/tables/coverage_positions.csv
    jobid: 3
    benchmark: logs/benchmarks/coverage_table/tables/coverage.tsv
    reason: Forced execution

[Fri Nov 27 21:49:04 2026]
checkpoint corpus_shards:
    output: results/corpus/shakespeare/mini-gpt2/shards
    wildcards: corpus=shakespeare, model=mini-gpt2

[Fri Nov 27 21:49:04 2026]
rule all:
    input: results/tables/coverage_positions.csv
    jobid: 0
Job stats:
job                           count
"""


def test_parse_dry_run_reads_every_job_block_but_all():
    jobs = J.parse_dry_run(DRY_RUN)
    assert [j["rule"] for j in jobs] == ["stats_shard", "coverage_table", "corpus_shards"]
    assert jobs[0]["wildcards"] == {"model": "mini-neox", "revision": "step1088", "dataset": "stats", "i": "00000"}
    assert jobs[0]["benchmark"].endswith("group-00000.tsv") and jobs[1]["wildcards"] == {}
    assert jobs[2]["wildcards"]["corpus"] == "shakespeare" and jobs[2]["benchmark"] is None


def test_load_config_merges_as_snakemake_does_and_names_a_missing_file(tmp_path):
    cfg = J.load_config([CI], ["results=elsewhere"], base=REPO / "config" / "config.yaml")
    assert cfg["corpus"]["name"] == "shakespeare-ci" and cfg["results"] == "elsewhere"
    assert cfg["minisuite"]["models"][0]["n_layer"] == 1  # ci.yaml's list replaced the default's
    assert cfg["jlens"]["n_positions"] > 0  # the schema's defaults filled in
    with pytest.raises(J.EstimateError, match="nope.yaml does not exist"):
        J.load_config([tmp_path / "nope.yaml"])
    with pytest.raises(J.EstimateError, match="KEY=VALUE"):
        J.load_config([CI], ["results"], base=REPO / "config" / "config.yaml")


def test_planned_shards_stand_in_for_the_corpus_checkpoint(monkeypatch):
    from mfpipe.workflow.plan import PLANNED_SHARDS_ENV, Plan

    cfg = J.load_config([CI], base=REPO / "config" / "config.yaml")
    plan = Plan(cfg, REPO / "src")  # no checkpoints object: reading the checkpoint would fail
    monkeypatch.setenv(PLANNED_SHARDS_ENV, json.dumps({"shakespeare-ci/mini-gpt2/stats": 3}))
    assert plan.half_shard_ids("shakespeare-ci", "mini-gpt2", "stats") == ["00000", "00001", "00002"]
    # the shard files are not written yet: the corpus checkpoint's folder is the jobs' input
    assert plan.half_shard_files("shakespeare-ci", "mini-gpt2", "stats") == [
        f"{cfg['results']}/corpus/shakespeare-ci/mini-gpt2/shards"]


def test_predict_corpus_caps_at_the_budget_and_counts_local_text():
    cfg = J.load_config([CI], base=REPO / "config" / "config.yaml")
    pred = J.predict_corpus(cfg, {}, results="/nonexistent")
    # ci.yaml: 8192 tokens a half at T = 32, 128-window shards; the embedded corpus holds far more
    assert pred["shakespeare-ci/mini-gpt2/stats"] == {"windows": 256, "shards": 2, "measured": False,
                                                       "tokenize_s_per_token": None, "tokenize_text": None}
    assert pred["python-docs-ci/mini-neox/eval"]["windows"] == 4096 // 32
    # the default config's budget (2 M tokens a half) is more than the embedded corpus holds: all of the half's
    # text at the default 4 characters a token, ~0.5 M tokens (the default run measured 0.55 M)
    default = J.load_config([], base=REPO / "config" / "config.yaml")
    whole = J.predict_corpus(default, {}, results="/nonexistent")["shakespeare/mini-gpt2/stats"]
    assert 300_000 < whole["windows"] * 64 < 900_000 and whole["shards"] == math.ceil(whole["windows"] / 4096)


def test_stage_of_rules_finds_rules_made_in_a_loop():
    stages = R.stage_of_rules(REPO / "workflow" / "rules")
    assert stages.get("stats_shard") == "stats" and stages.get("corpus_shards") == "corpus"
    assert stages.get("figure_rollout") == "rollout" and stages.get("figure_clustering") == "rollout"
    assert stages.get("no_such_rule", "x") == "x"


def fake_context(n_tracked=100, host_mb=None):
    cfg = J.load_config([CI], [f"tracked={{'n_tracked': {n_tracked}}}"], base=REPO / "config" / "config.yaml")
    corpus = J.predict_corpus(cfg, {}, results="/nonexistent")
    cal = {m["name"]: {"layers": 4, "heads": 2, "d_model": 32, "n_tracked": n_tracked, "startup_s": 3.0, "peak_rss_mb": host_mb or 500.0,
                       "peak_mb": {"forward": 400.0, "pass1": host_mb or 500.0},
                       "pass1_s_per_token": 1e-5, "pass1_first_s": 0.5, "store_write_s_per_cell": 1e-8,
                       "store_read_s_per_cell": 1e-9, "store_bytes_per_cell": 2.0, "store_open_s": 0.25,
                       "finalize_s": 0.1, "deviation_store_bytes": 1e6} for m in cfg["models"]}
    startup = {k: 1.0 for k in ("table", "store", "figure", "store_figure", "tokenizer")}
    return C.Context(cfg, corpus, cal, startup)


def test_a_statistics_job_costs_its_start_up_its_tokens_and_its_partials():
    ctx = fake_context()
    wc = {"model": "mini-gpt2", "revision": "final", "dataset": "stats", "i": "00000"}
    cost = C.job_cost(ctx, "stats_shard", wc)
    tokens, cells = 256 * 32, 4 * 2 * 100 * 102  # ci.yaml's stats half; L·H·N·(N+2)
    work = tokens * 1e-5 + 0.5 + 2 * cells * 1e-8  # pass 1, its first batch, two shards' partials written
    assert cost["seconds"] == pytest.approx(3.0 + work) and cost["startup_s"] == 3.0 and cost["modelled"]
    assert cost["disk_bytes"] == pytest.approx(2 * cells * 2.0)  # two shards' partials
    merge = C.job_cost(ctx, "stats_merge", {"model": "mini-gpt2", "revision": "final", "dataset": "stats"})
    assert merge["seconds"] == pytest.approx(1.0 + 0.25 + 2 * cells * 1e-9 + cells * 1e-8 + 0.1)
    # a table job costs its start-up only (priced so: tests/test_estimate_coverage.py); a rule without a price too,
    # and says so
    table = C.job_cost(ctx, "coverage_table", {})
    assert table == {"seconds": 1.0, "startup_s": 1.0, "peak_mb": 0.0, "disk_bytes": 0.0, "modelled": True}
    assert C.job_cost(ctx, "no_such_rule", {}) == {**table, "modelled": False}


def test_a_job_that_cannot_fit_gets_one_line_naming_it_and_the_knob(tmp_path):
    import pandas as pd
    import psutil

    host = psutil.virtual_memory().total / 2**20
    ctx = fake_context(host_mb=4 * host)
    stats = {"model": "mini-gpt2", "dataset": "stats"}
    rows = [{"rule": "stats_shard", "model": "mini-gpt2", "job": f"logs/benchmarks/stats_shard/x/group-{i}.tsv",
             **C.job_cost(ctx, "stats_shard", {**stats, "i": i}), "disk_kept_bytes": 0.0} for i in ("00000", "00001")]
    rows.append({"rule": "coverage_table", "model": None, "job": "logs/benchmarks/coverage_table/t.tsv",
                 **C.job_cost(ctx, "coverage_table", {}), "disk_kept_bytes": 0.0})
    lines = R.fit_problems(pd.DataFrame(rows), ctx, "cpu", tmp_path)
    assert len(lines) == 1, lines  # one line for the model: its largest job, how many more, the knob
    assert lines[0].startswith("logs/benchmarks/stats_shard/x/group-00000.tsv: needs ~"), lines
    assert "(and 1 more of its jobs" in lines[0] and "tracked.n_tracked" in lines[0] and "mini-gpt2" in lines[0]
    # on a CPU the kernel sums can go to a mapped file: named first, with what it takes off (L H N (N+2) float32)
    kernel_gib = 4 * 2 * 100 * 102 * 4 / 2**30
    assert f"set stats.kernel_sums: disk (~{kernel_gib:.1f} GiB of kernel sums" in lines[0]
    ctx.config["stats"]["kernel_sums"] = "disk"
    on_disk = C.job_cost(ctx, "stats_shard", {**stats, "i": "00000"})
    assert on_disk["peak_mb"] == pytest.approx(rows[0]["peak_mb"] - kernel_gib * 1024)
    ctx.config["stats"]["kernel_sums"] = "memory"
    rows[2]["disk_kept_bytes"] = rows[2]["disk_bytes"] = 1e18  # more than any disk
    lines = R.fit_problems(pd.DataFrame(rows), ctx, "cpu", tmp_path)
    assert len(lines) == 2 and "keeps" in lines[1] and "`results`" in lines[1]
    # partials live until their merge: the peak counts one dataset's (both shards' here), not the run's sum
    rows[2]["disk_kept_bytes"] = rows[2]["disk_bytes"] = 0.0
    free = shutil.disk_usage(tmp_path).free
    for r in rows[:2]:
        r["disk_bytes"] = 0.6 * free
    assert "at its peak" in R.fit_problems(pd.DataFrame(rows), ctx, "cpu", tmp_path)[-1]
    rows[1]["job"] = "logs/benchmarks/stats_shard/y/group-00000.tsv"  # another dataset: merged in between
    assert not any("peak" in x for x in R.fit_problems(pd.DataFrame(rows), ctx, "cpu", tmp_path)[1:])


def test_the_calibration_measures_every_rate_a_job_is_priced_by():
    from mfpipe.estimate.calibrate import calibrate, layer_arrays

    cfg = J.load_config([CI], base=REPO / "config" / "config.yaml")
    out = calibrate(cfg["models"][0], cfg, threads=1)
    assert out["layers"] == out["layers_run"] == 1 and out["source"].startswith("mini-suite shape")
    rates = [k for k in out if k.endswith(("_s_per_token", "_s_per_cell", "_s_per_position", "_s_per_pair"))]
    assert {"forward_s_per_token", "pass1_s_per_token", "pass2_s_per_token", "substitution_s_per_token",
            "train_s_per_token", "jlens_s_per_position", "calibration_s_per_pair"} <= set(rates)
    assert all(out[k] >= 0 and math.isfinite(out[k]) for k in rates)
    assert out["forward_s_per_token"] > 0 and out["startup_s"] > 0 and out["peak_rss_mb"] > 0
    assert out["jvp_s_per_vector"] > 0 and math.isfinite(out["jvp_position_s"]) and out["jvp_position_s"] >= 0
    assert set(out["peak_mb"]) == {"forward", "pass1", "pass2", "substitution", "jlens", "jvp", "train", "rollout"}
    assert out["rollout_s"] is not None and "rollout_error" not in out, out.get("rollout_error")
    # the rollout jobs' peak counts the centroids they hold at every depth (their kernel is read a layer at a time)
    centroids = layer_arrays(out["layers"], out["heads"], out["n_tracked"], out["d_head"], 1, out["d_model"])
    assert out["peak_mb"]["rollout"] > centroids["rollout"] / 2**20 > 0
    assert out["n_tracked"] == cfg["tracked"]["n_tracked"]  # the Zipf law's top N, however few windows
    assert out["deviation_partial_bytes"] > 0 and out["d_head"] * out["heads"] == out["d_model"]
    # every rule's formula finds what it reads
    ctx = C.Context(cfg, J.predict_corpus(cfg, {}, results="/nonexistent"), {m["name"]: out for m in cfg["models"]},
                    {k: 1.0 for k in ("table", "store", "figure", "store_figure", "tokenizer")})
    wcs = {"model": "mini-gpt2", "mini": "mini-gpt2", "revision": "final", "dataset": "stats", "i": "00000",
           "corpus": "shakespeare-ci"}
    for rule in C.RULES:
        cost = C.job_cost(ctx, rule, wcs)
        assert cost["seconds"] > 0 and cost["modelled"], rule


def test_a_batch_cut_below_the_jobs_adds_a_windows_share_to_the_batched_stages():
    """Where the calibration times fewer windows than the jobs' batch (MAX_BATCH_SECONDS: a 16-bit 7B model's on a
    CPU), the batched stages' peaks get a window's share of a forward's memory (B + 1 windows against one) for each
    window left out; the rollout's and the J-lens's do not batch windows."""
    import numpy as np
    import torch

    from mfpipe.estimate import calibrate as Cal

    class Grows(torch.nn.Module):  # a forward that holds 40 MiB a window at its peak
        def forward(self, input_ids, use_cache=False):
            held = np.ones((len(input_ids), 40 << 17))  # 40 MiB of float64 a window, touched
            return float(held.sum())

    peaks = Cal._Peaks()
    per_window = Cal._window_mb(Grows(), np.zeros((4, 8), dtype=np.int64), 2, "cpu", peaks)
    assert 30 < per_window < 50 and "_window" not in peaks.rise
    peaks.rise = {"forward": 10.0, "pass1": 20.0, "pass2": 30.0, "substitution": 40.0, "rollout": 50.0, "jlens": 60.0}
    model = torch.nn.Linear(2, 2)
    adapter = type("A", (), {"n_layers": 1, "block_module": lambda self, l: torch.nn.Linear(1, 1)})()
    plain = Cal._memory(model, adapter, 0.0, 1.0, peaks)["peak_mb"]
    more = Cal._memory(model, adapter, 0.0, 1.0, peaks, more_windows_mb=3 * per_window)["peak_mb"]
    assert {k: round(more[k] - plain[k], 6) for k in plain} == {
        **{k: round(3 * per_window, 6) for k in Cal.BATCHED}, "rollout": 0.0, "jlens": 0.0}


def test_a_bad_config_value_ends_the_estimate_in_one_line(capsys, monkeypatch):
    """``mfpipe estimate --config runtime.batch_size=abc`` printed the ConfigError's traceback, exit 1 (found at stop
    81); it is one line naming the key, exit 2, as an estimate error is."""
    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    assert R.main(["--config", "runtime.batch_size=abc"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mfpipe estimate: ") and "runtime.batch_size" in err[0], err
