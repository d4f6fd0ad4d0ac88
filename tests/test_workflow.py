"""Drive the real Snakemake workflow on the tiny `ci` config in a scratch working directory."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from workflow_runs import (
    CI_CONFIG,
    FOLLOWS_EVERY_RUN,
    REPO,
    clone,
    planned_jobs,
    result_files,
    run_got,
    run_settings,
    snakemake,
    without_timings,
)

from mfpipe.stats.store import read_attrs

pytestmark = pytest.mark.slow


def variant(tmp: Path, name: str, edit) -> Path:
    cfg = yaml.safe_load(CI_CONFIG.read_text())
    edit(cfg)
    p = tmp / f"{name}.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    wd = clone(tmp_path_factory.mktemp("wf"))
    # every job records the mfpipe modules it loaded (mfpipe.workflow.runner.record_loaded_modules), for the code-input test
    snakemake(wd, "--cores", "2", env={"MFPIPE_LOADED_MODULES": str(wd / "loaded_modules")})
    return wd


def test_ci_dag_builds_everything(built):
    r = built / "results"
    for m in ("mini-gpt2", "mini-neox"):
        assert (r / "minisuite" / m / "induction.csv").is_file()
        assert (r / "corpus" / "shakespeare-ci" / m / "tracked.json").is_file()
        assert sorted((r / "corpus" / "shakespeare-ci" / m / "shards" / "stats").glob("shard-*.npz"))
    assert (r / "tables" / "coverage_positions.md").is_file()
    assert list((built / "logs").rglob("*.log"))
    # the stores say their partials were rounded (config/ci.yaml: stats.partial_mantissa_bits, as the presets)
    stores = sorted(p for p in (r / "stats").rglob("*.zarr") if "partials" not in p.parts)
    assert stores and all(read_attrs(s)["partial_mantissa_bits"] == 11 for s in stores), stores


def test_every_job_has_its_cost_on_record(built):
    """Issue 31: every rule writes Snakemake's benchmark file per job, and the run sums them by rule and stage."""
    import pandas as pd

    bench = built / "logs" / "benchmarks"
    ran = {p.name for p in bench.iterdir() if p.is_dir()}
    rules = set(rule_scripts(built)) - {"figure_*"} | {f"figure_{f}" for f in ("rollout", "teacher_forced",
                                                                               "error_decomposition", "clustering")}
    ci_skips = {"tracked_types_topn", "substitution_topn", "substitution_topn_table", "figure_topn",
                "figure_vocab_mfgap"}  # no top-N arm
    assert rules - ci_skips - {"cross_corpus"} <= ran, sorted(rules - ran)
    costs = pd.read_csv(built / "results" / "tables" / "run_costs.csv")
    assert set(costs["rule"]) == ran - {"run_costs"} or set(costs["rule"]) == ran, (sorted(ran), costs["rule"])
    shard = costs.set_index("rule").loc["stats_shard"]
    assert shard["jobs"] == len(list((bench / "stats_shard").rglob("*.tsv"))) and shard["wall_s"] > 0
    assert shard["stage"] == "stats" and costs.set_index("rule").loc["ranking", "stage"] == "ranking"
    assert "## By stage" in (built / "results" / "tables" / "run_costs.md").read_text()


def test_estimate_plans_the_jobs_the_run_ran(built):
    """Issue 49: `mfpipe estimate`'s job list (Snakemake's dry run, the corpus checkpoint's shards planned) is the
    run's: the same jobs, each under the benchmark file the run wrote. The halves are read from the run's shards,
    and the ci config's budget-bound prediction of them is exact."""
    from mfpipe.estimate import jobs as E

    config = E.load_config([CI_CONFIG], base=built / "config" / "config.yaml")
    measured = E.predict_corpus(config, {}, results=built / "results")
    assert all(v["measured"] for v in measured.values()), measured
    predicted = E.predict_corpus(config, {}, results=built / "nowhere")
    assert {k: v["windows"] for k, v in predicted.items()} == {k: v["windows"] for k, v in measured.items()}
    jobs = E.planned_jobs(predicted, [CI_CONFIG], snakefile=built / "Snakefile")
    ran = {str(p.relative_to(built)) for p in (built / "logs" / "benchmarks").rglob("*.tsv")}
    assert {j["benchmark"] for j in jobs} == ran


def test_training_sweep_outputs(built):
    """Issue 10: one substitution result per sweep revision, the sweep table in training order, the figure."""
    import pandas as pd

    r = built / "results"
    df = pd.read_csv(r / "tables" / "substitution_mini-gpt2.csv")
    assert df["revision"].tolist() == ["step4", "step20"] and df["step"].tolist() == [4, 20]
    assert (df["substituted_share"] > 0.1).all() and df[["L_model", "L_MF", "D_MF"]].notna().all().all()
    assert ((df["L_MF"] - df["L_model"] - df["delta_L"]).abs() < 1e-9).all()
    assert (r / "substitution" / "mini-gpt2" / "step4" / "substitution.zarr" / "zarr.json").is_file()
    heads = pd.read_csv(r / "tables" / "substitution_heads_mini-gpt2.csv")
    assert len(heads) == 2 * 1 * 2 and heads["deviation"].between(0, 2).all()  # revisions x layers x heads
    assert (r / "figures" / "waypoint_mini-gpt2.png").stat().st_size > 0
    assert not (r / "figures" / "waypoint_mini-neox.png").exists()  # one revision is no sweep
    # kernel dynamics (CKA, spread) over the sweep, the bias table and calibration at the rollout revision
    cka = pd.read_csv(r / "tables" / "kernel_cka_mini-gpt2.csv")
    assert len(cka) == 4 and cka["cka"].between(-1e-9, 1 + 1e-9).all()
    assert (cka.loc[cka["rev_a"] == cka["rev_b"], "cka"] - 1).abs().max() < 1e-6
    for f in ("kernel_cka", "kernel_spread"):
        assert (r / "figures" / f"{f}_mini-gpt2.png").stat().st_size > 0
    for m in ("mini-gpt2", "mini-neox"):
        bias = pd.read_csv(r / "tables" / f"kernel_bias_{m}_step20.csv")
        assert bias["E_NX"].notna().all()
        res = pd.read_csv(r / "tables" / f"calibration_{m}_step20.csv")
        assert len(res) > 1
    # the rollout stage analyses the last revision only
    assert not (r / "rollout" / "mini-gpt2" / "step4").exists() and (r / "rollout" / "mini-gpt2" / "step20").is_dir()


def test_head_ranking_outputs(built):
    """Issue 11: pass 2 per sweep revision (merged from the statistics half's two shards), head scores, the Exp. 3
    table and figure across the sweep, and at the rollout revision the ranking tables and the M_cov / M_ctx scatter."""
    import pandas as pd

    from mfpipe.deviation.store import open_deviation

    r = built / "results"
    for m, revs in (("mini-gpt2", ["step4", "step20"]), ("mini-neox", ["step20"])):
        for rev in revs:
            ds = open_deviation(r / "deviation" / m / rev / "deviation.zarr", {"model": m, "revision": rev})
            assert ds.attrs["n_partials"] == 2 and ds.attrs["n_contexts"] > 1000
            assert (abs(ds["M_cov"] + ds["M_ctx"] - ds["D"]) < 1e-9).all() and (ds["D"] > 0).all()
            assert ds["S_bar"].notnull().all() and ds.attrs["n_types_scored"] >= 2
            heads = pd.read_csv(r / "heads" / m / rev / "head_scores.csv")
            assert len(heads) == 2 and heads[["induction", "previous_token", "bos_sink"]].notna().all().all()
        top = pd.read_csv(r / "tables" / f"ranking_top_{m}_step20.csv")
        assert top["rank"].tolist() == [1, 2] and top["S_bar"].is_monotonic_decreasing
        # App. readings: each head's rise under repetition, from the positional slice, beside S̄
        rises = pd.read_csv(r / "tables" / f"positional_repeated_{m}_step20.csv").set_index(["layer", "head"])
        assert sorted(top["rise_rank"]) == [1, 2] and top["rise"].notna().all()
        assert np.allclose(top["rise"], rises.loc[list(zip(top["layer"], top["head"])), "rise"], equal_nan=True)
        assert (r / "tables" / f"ranking_bottom_{m}_step20.md").is_file()
        assert (r / "figures" / f"ccmf_scatter_{m}_step20.png").stat().st_size > 0
        stab = pd.read_csv(r / "tables" / f"ranking_stability_{m}_step20.csv")
        assert stab["n_heads"].tolist() == [2]
    exp3 = pd.read_csv(r / "tables" / "exp3_correlation_mini-gpt2.csv")
    assert exp3["revision"].tolist() == ["step4", "step20"] and exp3["n_heads"].tolist() == [2, 2]
    assert (r / "figures" / "exp3_correlation_mini-gpt2.png").stat().st_size > 0
    assert not (r / "tables" / "exp3_correlation_mini-neox.csv").exists()  # one revision is no sweep


def test_explorer_opens_from_disk_offline_and_shows_the_tables_values(built, tmp_path):
    """Issue 61: the ci run's explorer, opened from disk in Chromium with the network off: the index links every model;
    the grid draws every head with the ranking table's S̄; the revision slider moves the grid to the substitution
    table's values of that revision; a click on a head opens its card with the kernel heatmap and its contexts; every
    link of the index, the card and the tables page resolves; the training page draws the sweep table's ΔL; no
    console error. The index page and every data file stay under 2 MB."""
    import pandas as pd
    from browser import broken_links, click_head, console_errors, grid_z, open_browser, set_revision, wait_for

    ex = built / "results" / "explorer"
    for f in [ex / "index.html", *ex.glob("*/index.html"), *ex.glob("*/data/model.js"), *ex.glob("*/data/cards/*/*.js")]:
        assert f.stat().st_size < 2e6, f
    tables = built / "results" / "tables"
    d = open_browser(tmp_path)
    try:
        d.get((ex / "index.html").as_uri())
        links = [a.get_attribute("href") for a in d.find_elements("css selector", "#models a")]
        assert len(links) == 2 and not broken_links(ex / "index.html", [a.split("explorer/", 1)[1] for a in links])
        d.find_element("link text", "mini-gpt2").click()
        wait_for(d, "window.MFX && MFX.data && document.getElementById('grid').data")
        rank = pd.read_csv(tables / "ranking_heads_mini-gpt2_step20.csv")
        z = np.array(grid_z(d), float)
        assert z.shape == (1, 2) and np.isfinite(z).all()  # every head drawn
        assert np.allclose(z[rank["layer"], rank["head"]], rank["S_bar"], rtol=1e-12, atol=0)
        sub = pd.read_csv(tables / "substitution_heads_mini-gpt2.csv")
        d.execute_script("const s=document.getElementById('score'); s.value='substitution_D';"
                         "s.dispatchEvent(new Event('change'));")
        for i, rev in enumerate(["step4", "step20"]):
            set_revision(d, i)
            z, want = np.array(grid_z(d), float), sub[sub["revision"] == rev]
            assert np.allclose(z[want["layer"], want["head"]], want["deviation"], rtol=1e-12, atol=0), rev
        click_head(d, 0, 1)
        assert d.find_elements("css selector", "#kernel .hm, #kernel .heatmaplayer")
        assert d.find_elements("css selector", "#contexts .context .tok.query")
        hrefs = d.execute_script("return Array.from(document.querySelectorAll('a')).map(a => a.getAttribute('href'));")
        assert "../index.html" in hrefs and len(hrefs) > 3 and not broken_links(ex / "mini-gpt2" / "index.html", hrefs)
        d.find_element("id", "tab-tables").click()
        hrefs = d.execute_script("return Array.from(document.querySelectorAll('#page-tables a'))"
                                 ".map(a => a.getAttribute('href'));")
        assert hrefs and not broken_links(ex / "mini-gpt2" / "index.html", hrefs)
        d.find_element("id", "tab-training").click()
        y = wait_for(d, "document.getElementById('training-delta_L') && document.getElementById('training-delta_L').data[0].y")
        sweep = pd.read_csv(tables / "substitution_mini-gpt2.csv").sort_values("step")
        assert np.allclose(np.array(y, float), sweep["delta_L"])
        for tab in ("rollout", "fv", "divergence"):
            d.find_element("id", f"tab-{tab}").click()
            wait_for(d, f"document.querySelector('#page-{tab} .js-plotly-plot, #page-{tab} .note')")
        # the divergence page draws every diagnostic any block has a number of (a ratio is NaN at block 0 of a rotary
        # model: drawn from block 1), not the depth coordinate
        steps = pd.read_csv(tables / "divergence_mini-gpt2_step20.csv")
        want = {k for k in steps.columns if k not in ("layer", "frac_depth") and steps[k].notna().any()
                and pd.api.types.is_numeric_dtype(steps[k]) and not pd.api.types.is_bool_dtype(steps[k])}
        drawn = wait_for(d, "document.getElementById('divergence-step20') && document.getElementById('divergence-step20')"
                            ".data && document.getElementById('divergence-step20').data.map(t => t.name)")
        assert want and set(drawn) == want, (drawn, want)
        assert console_errors(d) == []
    finally:
        d.quit()


def test_example_notebook_reads_the_run(built, tmp_path):
    """examples/reading_results.ipynb runs on this run's results (the reading API, provenance, its figure);
    the helpers are in tests/example_notebook.py, the API's own tests in tests/test_examples.py."""
    from example_notebook import check_executed, execute_notebook

    import mfpipe

    held = mfpipe.list_results(built / "results")
    assert {"stats", "deviation", "substitution", "kernel", "calibrated", "jlens"} <= set(held["kind"])
    J = mfpipe.open_results("jlens", "mini-gpt2", "step20", built / "results")["J"]  # App. P: J at the final point is I
    assert float(abs(J.sel(point="block").isel(layer=-1) - np.eye(J.sizes["out"])).max()) <= 1e-6
    check_executed(execute_notebook(built / "results", tmp_path), tmp_path)


def test_notebook_api_example_runs_on_the_mini_model(built, tmp_path):
    """examples/notebook_api.ipynb (issue 46) on the run's mini GPT-2 checkpoint and tokenizer, as a user loads them:
    statistics of a few hundred texts, P and W of a head, one prompt substituted, a head's deviation drawn, decoded."""
    from example_notebook import API_NOTEBOOK, check_executed, execute_notebook

    mini = built / "results" / "minisuite"
    env = {"MFPIPE_MODEL": str(mini / "mini-gpt2" / "checkpoints" / "step20"),
           "MFPIPE_TOKENIZER": str(mini / "tokenizer")}
    nb = execute_notebook(built / "results", tmp_path, notebook=API_NOTEBOOK, env=env)
    check_executed(nb, tmp_path, notebook=API_NOTEBOOK)
    text = "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "400 texts;" in text and "in-memory (mfpipe.collect_stats)" in text and "delta_L" in text, text[:2000]


def test_notebook_api_equals_the_runs_stores(built):
    """Issue 46: on the run's own windows and checkpoints (loaded with from_pretrained, as a user would), the notebook
    API gives the run's stores: collect_stats the statistics store array for array (same variables, coordinates and
    attributes but for where it came from), substitute the substitution store bit for bit, and the occurrence means of
    deviation's per-position terms pass 2's store (to float64 summation order), for both mini models. The process runs
    on the workflow's pinned numerics and one thread, as the run's jobs did (tests/notebook_reference.py)."""
    from notebook_reference import PROVENANCE

    from mfpipe.workflow.numerics import pinned_env

    results = built / "results"
    last = {m: max((p.name for p in (results / "stats" / m).iterdir() if p.name.startswith("step")),
                   key=lambda n: int(n[4:])) for m in ("mini-gpt2", "mini-neox")}
    pairs = [f"{m}:{rev}" for m, rev in last.items()]
    assert pairs == ["mini-gpt2:step20", "mini-neox:step20"]
    env = {**os.environ, **pinned_env()}
    out = subprocess.run([sys.executable, str(REPO / "tests" / "notebook_reference.py"), str(results), *pairs],
                         capture_output=True, text=True, env=env, cwd=built)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    for pair, r in report.items():
        st, sub, dev = r["stats"], r["substitution"], r["deviation"]
        assert st["variables"] and st["coords"] and st["unequal"] == [] and st["attrs_differ"] == [], (pair, st)
        assert set(st["attrs_other"]) <= PROVENANCE and st["tracked_fingerprint"] and st["n_windows"] == 256, (pair, st)
        assert sub["unequal"] == [] and sub["missing"] == [] and sub["max_abs_diff"] == 0.0, (pair, sub)
        assert dev["n_contexts"][0] == dev["n_contexts"][1] > 0, (pair, dev)
        assert max(dev[k] for k in ("D", "M_cov", "M_ctx", "zbar", "zhat_bar")) < 1e-12, (pair, dev)


def test_adding_a_revision_plans_only_that_revisions_jobs(built, tmp_path):
    """Issue 10: a new revision in the sweep adds its statistics, substitution and kernel jobs and the per-model
    tables and figures that gather every revision; nothing of the revisions already built reruns."""
    cfg = variant(tmp_path, "rev", lambda c: c["models"][0].update(revisions=["step4", "step8", "final"]))
    jobs = [(r, w) for r, w in planned_jobs(snakemake(built, "-n", configfiles=(CI_CONFIG, cfg))) if r != "all"]
    per_revision = {(r, w) for r, w in jobs if "revision=" in w}
    assert per_revision and all("revision=step8" in w and "model=mini-gpt2" in w for _, w in per_revision), jobs
    assert {"stats_shard", "stats_merge", "substitution", "kernel_revision", "deviation_shard", "deviation_merge",
            "head_scores"} <= {r for r, _ in per_revision}, jobs
    assert [w.split("dataset=")[1] for r, w in per_revision if r == "stats_merge"] == ["stats"]
    assert sum(r == "substitution" for r, _ in per_revision) == 1
    assert sum(r == "deviation_merge" for r, _ in per_revision) == 1 and sum(r == "head_scores" for r, _ in per_revision) == 1
    others = {(r, w) for r, w in jobs if "revision=" not in w}
    # the models-side-by-side table and figure gather every model's sweep: they follow it; so does the explorer's
    # index over the models (the model's explorer shows every revision: it reruns, below)
    crossmodel = {("crossmodel_table", ""), ("figure_crossmodel", ""), ("explorer_index", "")}
    assert crossmodel <= others, others
    others -= crossmodel
    assert all("model=mini-gpt2" in w for _, w in others) and {r for r, _ in others} <= {
        "substitution_table", "figure_waypoint", "kernel_dynamics", "substitution_topn_table", "figure_topn",
        "exp3_correlation", "explorer"}, others
    # App. M: a top-N arm adds its tracked set, its statistics (the N<n>/stats dataset) and a substitution per
    # revision, and the per-model top-N table and figure; nothing already built reruns
    cfg = variant(tmp_path, "topn", lambda c: c.update(substitution={"top_n": [32]}))
    jobs = [(r, w) for r, w in planned_jobs(snakemake(built, "-n", configfiles=(CI_CONFIG, cfg))) if r != "all"]
    rules = {r for r, _ in jobs}
    assert rules == {"tracked_types_topn", "stats_shard", "stats_merge", "substitution_topn", "substitution_topn_table",
                     "figure_topn", "figure_vocab_mfgap"}, jobs
    assert all("N32/stats" in w for r, w in jobs if r.startswith("stats_")), jobs
    assert sorted(w for r, w in jobs if r == "substitution_topn") == [
        "model=mini-gpt2, revision=step20, n=32", "model=mini-gpt2, revision=step4, n=32",
        "model=mini-neox, revision=step20, n=32"], jobs


def test_a_models_threads_rerun_nothing_and_its_tokens_per_step_only_what_reads_it(built, tmp_path):
    """How a job runs is no param of what it computes: a model's `threads` (its jobs' `threads:`; a forward's bits do
    not depend on it) plans nothing, not its corpus shards again; its `tokens_per_step` only the cross-model jobs,
    whose axis it sets (and the explorer's index, which shows their table)."""
    cfg = variant(tmp_path, "threads", lambda c: c["models"][0].update(threads=2))
    assert planned_jobs(snakemake(built, "-n", configfiles=(CI_CONFIG, cfg))) == []
    cfg = variant(tmp_path, "tps", lambda c: c["models"][0].update(tokens_per_step=4096))
    rules = {r for r, _ in planned_jobs(snakemake(built, "-n", configfiles=(CI_CONFIG, cfg)))} - {"all"}
    assert rules and rules <= {"crossmodel_table", "figure_crossmodel", "explorer_index"}, rules


def test_a_value_equal_to_another_params_or_swapped_with_it_reruns_its_jobs(built, tmp_path):
    """Snakemake compares a job's params as a set of values without their names: before stop 81 a new value equal to
    another param's (``prompts.icl.natural_length`` 20, where ``substitution.min_count`` is 20) or two values swapped
    (``ranking.top`` / ``bottom``) planned nothing, and the tables stayed as they were. Each rule's params by name are
    one more param (mfpipe.workflow.settings), so both plan the jobs that read them."""
    cfg = variant(tmp_path, "natural", lambda c: c.setdefault("prompts", {}).setdefault("icl", {}).update(
        natural_length=20))
    rules = {r for r, _ in planned_jobs(snakemake(built, "-n", configfiles=(CI_CONFIG, cfg)))}
    assert {"icl_classes"} <= rules, rules
    swap = variant(tmp_path, "swap", lambda c: c.setdefault("ranking", {}).update(top=15, bottom=20))
    rules = {r for r, _ in planned_jobs(snakemake(built, "-n", configfiles=(CI_CONFIG, swap)))}
    assert {"ranking"} <= rules, rules


def test_second_run_does_nothing(built):
    text = snakemake(built, "-n")
    assert planned_jobs(text) == [], text[-3000:]


def test_a_finished_run_copied_elsewhere_plans_nothing(built, tmp_path):
    """Issue 60, item 5: the finished run's folder (checkout, results, logs, .snakemake) copied with `cp -a`, which
    keeps every mtime, to another path plans nothing there: no job's recorded set of inputs changes (code inputs are
    paths relative to the working directory, mfpipe.workflow.codedeps.code_inputs; absolute ones planned every job
    again), no output is older than its inputs. The copy runs its own library (its src/, by relative paths)."""
    dest = tmp_path / "elsewhere" / "project"
    dest.parent.mkdir()
    subprocess.run(["cp", "-a", str(built), str(dest)], check=True)
    text = snakemake(dest, "-n")
    assert planned_jobs(text) == [] and "Nothing to be done" in text, text[-3000:]
    # what Snakemake compares (--rerun-triggers input): each job's recorded inputs, the code among them relative
    records = [json.loads(p.read_text()) for p in (dest / ".snakemake" / "metadata").iterdir()]
    inputs = {i for r in records for i in r.get("input") or []}
    assert any(i.startswith("src/mfpipe/") for i in inputs), sorted(inputs)[:5]
    assert not [i for i in inputs if os.path.isabs(i)], sorted(i for i in inputs if os.path.isabs(i))[:5]


def test_token_budget_change_rebuilds_only_corpus_onward(built, tmp_path):
    cfg = variant(tmp_path, "budget", lambda c: c["corpus"].update(tokens_per_half=c["corpus"]["tokens_per_half"] // 2))
    rules = {r for r, _ in planned_jobs(snakemake(built, "-n", configfiles=(CI_CONFIG, cfg)))}
    assert "corpus_shards" in rules and "tracked_types" in rules
    assert not rules & {"minisuite_tokenizer", "minisuite_train", "induction_table"}, rules


def test_n_change_rebuilds_only_tracked_onward(built, tmp_path):
    cfg = variant(tmp_path, "n", lambda c: c["tracked"].update(n_tracked=c["tracked"]["n_tracked"] // 2))
    rules = {r for r, _ in planned_jobs(snakemake(built, "-n", configfiles=(CI_CONFIG, cfg)))}
    assert "tracked_types" in rules
    assert not rules & {"corpus_shards", "minisuite_tokenizer", "minisuite_train", "induction_table"}, rules


def test_partial_rounding_change_rebuilds_only_statistics_onward(built, tmp_path):
    """... and with `stats.shards_per_job: 1` and `deviation.shards_per_job: 1` (the ci run takes a half's two shards
    in one job, in either pass) every shard is a job."""
    cfg = variant(tmp_path, "bits", lambda c: c.update(stats={"partial_mantissa_bits": None, "shards_per_job": 1},
                                                       deviation={"shards_per_job": 1}))
    jobs = planned_jobs(snakemake(built, "-n", configfiles=(CI_CONFIG, cfg)))
    rules = {r for r, _ in jobs}
    assert {"stats_shard", "stats_merge"} <= rules, rules

    def wc(w):
        return dict(kv.split("=", 1) for kv in w.split(", "))

    # the primary corpus's halves: a job per shard, where the ci run had one per half
    corpus = built / "results" / "corpus" / "shakespeare-ci"
    merges = [wc(w) for r, w in jobs if r == "stats_merge" and wc(w)["dataset"] in ("stats", "eval")]
    want = sorted((m["model"], m["revision"], m["dataset"], p.stem.removeprefix("shard-")) for m in merges
                  for p in (corpus / m["model"] / "shards" / m["dataset"]).glob("shard-*.npz"))
    got = sorted((w["model"], w["revision"], w["dataset"], w["i"]) for w in map(wc, (w for r, w in jobs if r == "stats_shard"))
                 if w["dataset"] in ("stats", "eval"))
    assert got == want and any(i == "00001" for *_, i in got), (got, want)
    # pass 2 (the statistics half of each revision): a job per shard
    dev = sorted((w["model"], w["revision"], w["i"]) for w in map(wc, (w for r, w in jobs if r == "deviation_shard")))
    want_dev = sorted((model, revision, i) for model, revision, dataset, i in want if dataset == "stats")
    assert dev == want_dev and len({d[:2] for d in dev}) == 3, (dev, want_dev)
    assert not rules & {"corpus_shards", "tracked_types", "minisuite_tokenizer", "minisuite_train", "induction_table"}, rules


def test_training_option_change_retrains_only_that_model(built, tmp_path):
    def edit(c):
        c["minisuite"]["models"][1]["lr"] = 2e-3  # mini-neox only
    cfg = variant(tmp_path, "train", edit)
    jobs = planned_jobs(snakemake(built, "-n", configfiles=(CI_CONFIG, cfg)))
    trains = [w for r, w in jobs if r == "minisuite_train"]
    assert trains == ["mini=mini-neox"], jobs
    rules = {r for r, _ in jobs}
    assert "minisuite_tokenizer" not in rules and "corpus_shards" not in rules
    assert not [w for r, w in jobs if "mini-gpt2" in w], jobs


def test_deleting_a_figure_reruns_only_its_plotting_job(built):
    """A figure is drawn by its own rule from a table (never inside the forward-pass job that wrote the table); the
    rollout figures are made the same way (one loop in workflow/rules/rollout.smk), the prompt figures were not.
    Two prompt figures deleted together: exactly their two plotting jobs are planned, and run."""
    pngs = {}
    for figure, rule in (("icl_classes", "figure_icl_classes"), ("fv", "figure_fv")):
        figs = sorted((built / "results" / "figures").glob(f"{figure}_mini-gpt2_*.png"))
        assert figs, f"the ci DAG builds the {figure} figure"
        pngs[rule] = figs[0]
    for png in pngs.values():
        png.unlink()
    jobs = sorted((r, w) for r, w in planned_jobs(snakemake(built, "-n")) if r != "all")
    assert [r for r, _ in jobs] == sorted(pngs) and all("model=mini-gpt2" in w for _, w in jobs), jobs
    snakemake(built, "--cores", "1", *(str(png.relative_to(built)) for png in pngs.values()))
    assert all(png.is_file() and png.stat().st_size > 0 for png in pngs.values())
    assert planned_jobs(snakemake(built, "-n")) == []


# ------------------------------------------------------------------------------------ code inputs
def rule_scripts(repo: Path) -> dict[str, str]:
    """rule name -> its code key, read from the rule files (the figure rules are made in a loop): the job function
    ``mfpipe.<package>.jobs:<function>`` of a rule whose code is ``job("<package>", "<function>")``, else the file name
    of its `script:` (the keys of mfpipe.workflow.codedeps.code_inputs)."""
    out, uses = {}, []
    for f in sorted((repo / "workflow" / "rules").glob("*.smk")):
        for block in re.split(r"(?m)^(?=(?:rule|checkpoint) \w+:|\s+rule:)", f.read_text()):
            job = re.search(r'code=job\("([\w.]+)", "(\w+)"\)', block)
            script = re.search(r'script:\s*\n\s*"\.\./scripts/([\w.]+)"', block)
            if job:
                key = f"mfpipe.{job.group(1)}.jobs:{job.group(2)}"
            elif script:
                key = script.group(1)
            else:
                continue
            named = re.match(r"(?:rule|checkpoint) (\w+):", block)
            if named:
                out[named.group(1)] = key
            elif 'f"figure_{_fig}"' in block:
                out["figure_*"] = key
        # `use rule a as b with:` runs a's script
        for a, b in re.findall(r"(?m)^use rule (\w+) as (\w+) with:", f.read_text()):
            uses.append((a, b))
    for a, b in uses:
        out[b] = out[a]
    return out


def rule_graph(workdir: Path) -> dict[str, set[str]]:
    """rule -> the rules that consume its outputs (from `snakemake --rulegraph`)."""
    text = snakemake(workdir, "--rulegraph")
    names = dict(re.findall(r"^\s*(\d+)\[label = \"(\w+)\"", text, flags=re.M))
    graph = {n: set() for n in names.values()}
    for a, b in re.findall(r"^\s*(\d+) -> (\d+)", text, flags=re.M):
        graph[names[a]].add(names[b])
    return graph


def downstream(graph: dict[str, set[str]], rules: set[str]) -> set[str]:
    out, todo = set(rules), list(rules)
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in out:
                out.add(nxt)
                todo.append(nxt)
    return out


def job_inputs(text: str) -> list[tuple[str, list[str]]]:
    """(rule, input paths) of every job a dry run lists."""
    jobs, current = [], None
    for line in text.splitlines():
        m = re.match(r"^\s*(?:rule|checkpoint|localrule|localcheckpoint) (\w+):\s*$", line)
        if m:
            current = [m.group(1), []]
            jobs.append(current)
            continue
        m = re.match(r"^\s*input: (.*)$", line)
        if m and current is not None:
            current[1] = [p.strip() for p in m.group(1).split(",")]
    return [tuple(j) for j in jobs]


def test_editing_a_module_reruns_exactly_the_rules_whose_scripts_import_it(built):
    """Issue 9: a rule's code inputs are derived from its script's imports (mfpipe.workflow.codedeps), so editing a
    library module plans the rules whose script imports it, directly or not, and what consumes their outputs;
    and no other rule is stale by itself.

    Checked in two parts (one dry run per module took most of the CI budget): every job of every rule declares as
    inputs exactly the library files its script imports (one forced dry run lists them all), and for a sample of
    modules (few, some and many importers) an edit plans exactly those rules and their consumers; with no edit
    nothing is planned (so no rule's job is stale by itself: with the declared inputs exact, an edit reaches the
    rules importing the module alone)."""
    from mfpipe.workflow.codedeps import code_inputs

    src = built / "src"
    scripts = rule_scripts(built)
    graph = rule_graph(built)
    rules = set(graph) - {"all"}
    script_of = {r: scripts[r if r in scripts else "figure_*"] for r in rules}
    code = code_inputs(src, built / "workflow" / "scripts")
    deps = {r: set(code[key]) for r, key in script_of.items()}
    modules = sorted(str(p) for p in (src / "mfpipe").rglob("*.py"))
    # 1. declared code inputs, every job of every rule: a forced dry run lists every job but those a rerun
    # checkpoint (the corpus shards) would only create, a second one forcing every rule downstream of it lists them
    upstream = {"corpus_shards"} | {r for r in rules if "corpus_shards" in downstream(graph, {r})}
    jobs = job_inputs(snakemake(built, "-n", "--forceall"))
    jobs += job_inputs(snakemake(built, "-n", "--forcerun", *sorted(rules - upstream)))
    seen, wrong = set(), []
    for rule, inputs in jobs:
        if rule == "all":
            continue
        seen.add(rule)
        declared = {str(built / p) for p in inputs if str(built / p) in modules}  # declared relative to the run's folder
        if declared != deps[rule]:
            wrong.append(f"{rule}: declares {sorted(declared - deps[rule])} it does not import, lacks "
                         f"{sorted(deps[rule] - declared)}")
    assert seen == rules and not wrong, "\n".join(wrong)
    # 2. at run time: every mfpipe module a job of the run has loaded is one of its rule's code inputs (a lazy or
    # importlib import the static analysis missed would show up here). Exempt: what _mfpipe_checkout loads for every
    # job on purpose (the package and its heap control, which change a job's speed, not its result).
    exempt = {str((src / "mfpipe" / f).resolve())
              for f in ("__init__.py", "version.py", "workflow/__init__.py", "workflow/heap.py")}
    records = [json.loads(p.read_text()) for p in sorted((built / "loaded_modules").glob("*.json"))]
    assert {r["rule"] for r in records} >= rules - {"corpus_shards"} - {r for r in rules if r.startswith("figure_")}, (
        "every kind of job recorded what it loaded", sorted(rules - {r["rule"] for r in records}))
    missed = {f"{r['rule']}: {sorted(set(r['files']) - deps[r['rule']] - exempt)}" for r in records
              if set(r["files"]) - deps[r["rule"]] - exempt}
    assert not missed, "jobs loaded mfpipe modules their rule does not declare:\n" + "\n".join(sorted(missed))
    # 3. edits of a sample of modules
    importers_of = {m: {r for r in rules if m in deps[r]} for m in modules}
    by_count = sorted(m for m in modules if importers_of[m])
    by_count.sort(key=lambda m: len(importers_of[m]))
    # few importers (pass 1's compiled loops, imported lazily), some, the most, and the mean field's deviation
    native_loops = str(src / "mfpipe" / "stats" / "_native_loops.py")
    sample = {native_loops, by_count[len(by_count) // 2], by_count[-1], str(src / "mfpipe" / "meanfield" / "deviation.py")}
    mismatches = []
    for name in sorted(sample):
        module = Path(name)
        importers = importers_of[name]
        original = module.read_bytes()
        stat = module.stat()
        module.write_bytes(original + b"\n# edited by test_workflow\n")
        try:
            planned = {r for r, _ in planned_jobs(snakemake(built, "-n"))} - {"all"}
        finally:
            module.write_bytes(original)
            os.utime(module, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        want = downstream(graph, importers) - {"all"} - FOLLOWS_EVERY_RUN
        if "corpus_shards" in want:
            # the shard jobs of a checkpoint that reruns exist only once it has run: a dry run cannot list them
            want -= {"stats_shard", "deviation_shard", "deviation_shard_recompute"}
        if name == native_loops:
            # pass 1's compiled loops (loaded lazily, on the first batch): the statistics shards are stale; pass 2's
            # shards are not stale by themselves (they rerun only as consumers of the statistics they read)
            assert "stats_shard" in importers and "deviation_shard" not in importers, sorted(importers)
            assert "stats_shard" in planned, sorted(planned)
        if planned != want:
            mismatches.append(f"{module.relative_to(src)}: planned {sorted(planned)}, want {sorted(want)} (imported "
                              f"by {sorted(importers)})")
    assert not mismatches, "\n".join(mismatches)
    # no rule stale by itself but for an edit of what it imports: the unedited run plans nothing, and (1.) a job's
    # code inputs are exactly its imports, so an edit makes no other rule's job stale but as a consumer (a second dry
    # run per module, allowed to run only the other rules, checked this at ~14 s a module)
    assert planned_jobs(snakemake(built, "-n")) == []


# ------------------------------------------------------------------------------------ SLURM (issue 12)
SLURM_UP = REPO / ".ci" / "slurm-up"


def slurm_available() -> str | None:
    """None when a SLURM cluster answers (bringing up the single-node one of .ci/slurm-up if need be), else why not.
    Under .ci/run (MFPIPE_SLURM=required) a cluster that does not answer is a failure, not a skip."""
    if os.environ.get("MFPIPE_SLURM") != "required" and not shutil.which("sinfo"):
        return "no SLURM here (sinfo not found); .ci/run brings up a single-node cluster with .ci/slurm-up"
    out = subprocess.run([str(SLURM_UP)], capture_output=True, text=True, timeout=900)
    if out.returncode == 0:
        return None
    reason = (out.stderr.strip().splitlines() or ["(no output)"])[-1]
    assert out.returncode == 3 and os.environ.get("MFPIPE_SLURM") != "required", f".ci/slurm-up failed: {out.stderr[-3000:]}"
    return reason


def slurm_test_profile(dest: Path) -> Path:
    """profiles/slurm as shipped, plus what this cluster needs: squeue for job status (the plugin's default,
    sacct, needs slurmdbd and would wait forever), no account (none exists without slurmdbd), and short polls."""
    cfg = yaml.safe_load((REPO / "profiles" / "slurm" / "config.v8+.yaml").read_text())
    assert cfg["executor"] == "slurm"
    cfg.update({"slurm-status-command": "squeue", "slurm-no-account": True,
                "slurm-init-seconds-before-status-checks": 2, "seconds-between-status-checks": 3})
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.v8+.yaml").write_text(yaml.safe_dump(cfg))
    return dest


def same_result(a: Path, b: Path) -> bool:
    """Equal results: Zarr folders (statistics stores and per-shard partials) and .npz files by their arrays and
    attributes (their containers carry write times), JSON without its timings, figures by existence (a PDF carries
    its creation date; its numbers are in the compared table), every other file byte for byte."""
    import numpy as np

    if a.suffix == ".zarr":
        import xarray as xr

        if not b.is_dir():
            return False
        da, db = xr.open_zarr(a, consolidated=False).load(), xr.open_zarr(b, consolidated=False).load()
        return da.identical(db)
    if a.suffix == ".npz":
        with np.load(a, allow_pickle=False) as x, np.load(b, allow_pickle=False) as y:
            return sorted(x.files) == sorted(y.files) and all(
                np.array_equal(x[k], y[k], equal_nan=x[k].dtype.kind in "fc") for k in x.files)  # NaN: no share
    if a.suffix in (".pdf", ".png"):
        return b.stat().st_size > 0
    if a.suffix == ".json":
        import json

        return without_timings(json.loads(a.read_text())) == without_timings(json.loads(b.read_text()))
    return a.read_bytes() == b.read_bytes()


def test_slurm_profile_run_equals_local_run(built, tmp_path_factory):
    """Issue 12: the ci config through `--profile profiles/slurm` on a real (single-node) SLURM completes,
    submits its forward-pass jobs to SLURM, and gives the same results as the local run of `built`. Issue 27,
    item 4: the run got every setting the profile states (the workflow profile profiles/default overrode none, and
    no --cores caps the submitted jobs' threads), as Snakemake held them when it started (logs/run_settings.json).

    CI time: the run is a copy of `built` (`cp -a`: its records kept, nothing to do there) with one model's outputs
    from its statistics onward deleted, and asked for them again: statistics, pass 2, the rollout and the
    substitution rerun through SLURM; training and the corpus, the same kind of submitted job, stay the local run's
    (they cost a third of the run in start-ups and SLURM's polls)."""
    reason = slurm_available()
    if reason:
        pytest.skip(reason)
    wd = tmp_path_factory.mktemp("slurm") / "project"
    subprocess.run(["cp", "-a", str(built), str(wd)], check=True)
    profile = slurm_test_profile(tmp_path_factory.mktemp("profile") / "slurm")
    targets = [f"results/tables/{t}_mini-neox_step20.csv" for t in ("rollout", "error_decomposition")]
    targets += ["results/substitution/mini-neox/step20/substitution.zarr"]
    r = wd / "results"
    for gone in ("stats/mini-neox/step20/stats.zarr", "stats/mini-neox/step20/eval.zarr", "stats/mini-neox/step20/partials",
                 "deviation/mini-neox/step20", "substitution/mini-neox/step20"):
        shutil.rmtree(r / gone)
    for gone in (r / "rollout" / "mini-neox" / "step20" / "scores.csv", *(wd / t for t in targets[:2]),
                 r / "tables" / "teacher_forced_mini-neox_step20.csv"):
        gone.unlink()
    before = {k: p.stat().st_mtime_ns for k, p in result_files(r).items()}
    text = snakemake(wd, "--profile", str(profile), *targets)
    ids = re.findall(r"Job \d+ has been submitted with SLURM jobid (\d+) \(log: .*/rule_(\w+)/", text)
    settings = run_settings(wd)
    report = os.environ.get("MFPIPE_SLURM_REPORT")
    if report:
        Path(report).write_text(
            "SLURM profile run of the ci config, the settings it ran with (logs/run_settings.json):\n"
            + "".join(f"  {k}: {v}\n" for k, v in settings.items() if k != "executor_settings")
            + "".join(f"  executor_settings.{k}: {v}\n" for k, v in settings["executor_settings"].items())
            + "submitted jobs (SLURM jobid rule):\n" + "".join(f"  {j} {r}\n" for j, r in ids))
    stated = yaml.safe_load((profile / "config.v8+.yaml").read_text())  # profiles/slurm + this cluster's needs
    assert run_got(settings, stated) == stated, settings
    assert settings["executor"] == "slurm" and settings["jobs"] == 100 and settings["cores"] is None, settings
    # what runs on the submitting host (the localrules) runs in the local executor's pool (profiles/slurm says 5)
    assert settings["login_node_job_slots"] == 5, settings
    rules = {r for _, r in ids}
    assert {"stats_shard", "deviation_shard", "rollout_scores", "error_accounting", "substitution"} <= rules, ids
    assert not rules & {"stats_merge", "rollout_table", "substitution_table"} and not any(
        r.startswith("figure_") for r in rules), f"cheap rules stay local: {sorted(rules)}"
    local, remote = result_files(built / "results"), result_files(wd / "results")
    rerun = {k for k, p in remote.items() if p.stat().st_mtime_ns != before.get(k)}  # what the SLURM run wrote
    assert rerun and set(rerun) <= set(local), sorted(set(rerun) - set(local))
    assert any(k.startswith("stats/mini-neox/step20/") for k in rerun) and any("deviation" in k for k in rerun) and any(
        "rollout_mini-neox" in k for k in rerun) and any(k.startswith("substitution/mini-neox/") for k in rerun), sorted(rerun)
    differ = [k for k in sorted(rerun) if not same_result(local[k], remote[k])]
    assert not differ, f"the SLURM run differs from the local run in {differ}"


# ------------------------------------------------------------------------------------ report (issue 12)
def test_report_collects_every_figure_and_table_with_captions_and_the_config(built, tmp_path):
    """`snakemake --report report.zip` from the ci run: every figure target (PDF and PNG) and every result table
    is in the archive, with its caption (workflow/report/*.rst), and the run's configuration is recorded."""
    import zipfile

    figures = sorted(p.name for p in (built / "results" / "figures").iterdir())
    # 5 rollout figures x 2 models, mini-gpt2's sweep: waypoint, kernel CKA, kernel spread, Exp. 3; the head-ranking
    # scatter, prompt classes, instance meter, function vectors and their clean-prompt sweep, positional transport, the
    # per-layer curves across corpora (fig:curves) and the rollout's divergence (App. llama) x 2 models; the two models
    # side by side; the tokenizers' rank-frequency (fig:zipf); x (pdf, png)
    assert len(figures) == (5 * 2 + 4 + 8 * 2 + 1 + 1) * 2, figures
    out = tmp_path / "report.zip"
    snakemake(built, "--report", str(out))
    with zipfile.ZipFile(out) as z:
        names = z.namelist()
        html = "\n".join(z.read(n).decode("utf-8", "replace") for n in names if n.endswith((".html", ".js")))
    in_zip = {Path(n).name for n in names}
    assert not [f for f in figures if f not in in_zip], sorted(in_zip)
    tables = ["rollout", "teacher_forced", "error_decomposition", "mlp_gap", "clustering", "anisotropy", "cross_corpus"]
    want_tables = [f"{t}_{m}_step20.csv" for t in tables for m in ("mini-gpt2", "mini-neox")]
    want_tables += ["coverage_positions.csv", "coverage_attention.csv", "induction.md"]
    want_tables += [f"substitution_{m}.csv" for m in ("mini-gpt2", "mini-neox")]
    want_tables += [f"{t}_{m}_step20.csv" for t in ("kernel_bias", "calibration") for m in ("mini-gpt2", "mini-neox")]
    want_tables += [f"kernel_{t}_mini-gpt2.csv" for t in ("cka", "cka_adjacent", "spread")]
    want_tables += [f"{t}_{m}_step20.csv" for t in ("ranking_top", "ranking_bottom", "ranking_stability", "icl_classes",
                                                     "icl_corr", "icl_meter", "fv", "fv_clean", "jlens_checks",
                                                     "positional", "positional_ablation", "positional_repeated",
                                                     "positional_classes")
                   for m in ("mini-gpt2", "mini-neox")]
    want_tables += ["exp3_correlation_mini-gpt2.csv", "run_costs.csv"]  # and where the run's time went
    # issue 44: App. llama's divergence and exclusion arm, App. I's tables, App. B's recomputation with U, tab:gemma's
    # single-revision correlation, the behavioural roles in the ranking, fig:zipf's cutoffs
    want_tables += [f"{t}_{m}_step20.csv" for t in ("divergence", "divergence_curvature", "divergence_units",
                                                     "divergence_tokens", "divergence_pairs_summary", "exclusion",
                                                     "layer_localized", "rogue_dims", "pinning", "calibrated",
                                                     "exp3_single", "ranking_roles")
                    for m in ("mini-gpt2", "mini-neox")] + ["zipf_cutoff.csv"]
    assert not [t for t in want_tables if t not in in_zip], sorted(in_zip)
    for fig in ("rollout", "teacher_forced", "error_decomposition", "clustering", "cross_corpus", "ccmf_scatter", "exp3",
                "icl_classes", "icl_meter", "fv", "fv_clean", "positional", "divergence", "curves", "zipf"):
        caption = (REPO / "workflow" / "report" / f"figure_{fig}.rst").read_text().split(":")[0]
        first = caption.split("{{")[0].strip()
        assert first and first in html, f"caption of {fig} missing from the report"
    for table in ("divergence_steps", "divergence_units", "layer_localized", "rogue_dims", "pinning", "calibrated",
                  "exclusion", "zipf_cutoff", "ranking_roles", "exp3_single", "positional", "positional_repeated",
                  "positional_classes", "positional_ablation"):
        caption = (REPO / "workflow" / "report" / f"table_{table}.rst").read_text().split("(")[0].strip()
        assert caption and caption in html, f"caption of table {table} missing from the report"
    # the configuration block of workflow/report/workflow.rst: the run's config, the ci file's values over the defaults
    assert "shakespeare-ci" in html and "tokens_per_half&quot;: 8192" in html, "the run's configuration is in the report"


# ------------------------------------------------------------------------------------ faults (issue 12, item 4)
# All on the built clone, one output at a time (no whole-DAG rerun): each test deletes a single output, runs
# Snakemake for it alone and kills the run -- SIGKILL to its whole process group -- at the moment its job has
# written the output completely into the temporary sibling but not yet renamed it into place (the
# MFPIPE_STALL_BEFORE_PUBLISH seam of mfpipe.workflow.io), then reruns it as a user would (`--unlock`, rerun).
def kill_while_publishing(workdir: Path, target: Path, tmp_path: Path) -> None:
    import signal
    import time

    mark = tmp_path / f"stalled-{target.name}"
    env = {**os.environ, "MFPIPE_STALL_BEFORE_PUBLISH": str(target.relative_to(workdir)), "MFPIPE_STALL_MARK": str(mark)}
    cmd = [sys.executable, "-m", "snakemake", "--snakefile", str(workdir / "Snakefile"), "--directory", str(workdir),
           "--configfile", str(CI_CONFIG), "--cores", "1", str(target.relative_to(workdir))]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while not mark.exists():
            assert proc.poll() is None, f"the run ended before writing {target}: {proc.stdout.read().decode()[-3000:]}"
            assert time.monotonic() < deadline, f"{target} was never written"
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert not target.exists(), f"a killed job left {target}, which a rerun would take as done"
    assert list(target.parent.glob(f".{target.name}.tmp-*")), "the kill came after the rename: nothing was tested"
    snakemake(workdir, "--unlock")


def rerun_cleanly(workdir: Path, target: Path) -> None:
    snakemake(workdir, "--cores", "1", str(target.relative_to(workdir)))
    assert target.exists()
    assert not list(target.parent.glob(f".{target.name}.tmp-*")), "the rerun left the killed job's temporary folder"


def files_bytes(root: Path) -> dict[str, bytes]:
    """Every file of a store by relative path, except Snakemake's completion stamp (a write time)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != ".snakemake_timestamp"}


def partial_arrays(path: Path) -> dict:
    """A partial's arrays and attributes (a Zarr folder; its chunk files' bytes carry no write time)."""
    import numpy as np
    import zarr

    g = zarr.open_group(str(path), mode="r")
    return {"attrs": np.asarray(repr(dict(g.attrs))), **{k: np.asarray(g[k][...]) for k in g.array_keys()}}


def damage_in_place(folder: Path, damage) -> None:
    """Apply ``damage(folder)`` and give every file and folder back its old times: Snakemake sees nothing to redo."""
    times = {p: p.stat() for p in [folder, *folder.rglob("*")]}
    damage(folder)
    for p, st in times.items():
        if p.exists():
            os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))


def arrays_equal(a: dict, b: dict) -> bool:
    import numpy as np

    return sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)


def failing_run(workdir: Path, *args: str, n_causes: int = 1) -> tuple[str, str]:
    """(stdout+stderr, the first mfpipe error line) of a Snakemake run that must fail with ``n_causes`` such lines
    (one per failed job)."""
    out = subprocess.run([sys.executable, "-m", "snakemake", "--snakefile", str(workdir / "Snakefile"), "--directory",
                          str(workdir), "--configfile", str(CI_CONFIG), *args], capture_output=True, text=True, timeout=900)
    text = out.stdout + out.stderr
    assert out.returncode != 0, text[-3000:]
    # each failed job's cause, as its stderr's last line and again where the profile shows the failed rule log
    causes = sorted({ln for ln in text.splitlines() if ln.startswith("mfpipe error: ")})
    assert len(causes) == n_causes, text[-3000:]
    return text, causes[0]


def test_killed_figure_shard_and_merge_jobs_leave_nothing_half_written_and_resume_bit_identically(built, tmp_path):
    stats = built / "results" / "stats" / "mini-gpt2" / "step20"
    # a figure
    fig = sorted((built / "results" / "figures").glob("clustering_mini-gpt2_*.png"))[0]
    fig.unlink()
    kill_while_publishing(built, fig, tmp_path)
    rerun_cleanly(built, fig)
    assert fig.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and fig.read_bytes()[-8:-4] == b"IEND"
    # a statistics job (its run of shards: both of the half's, one partial each)
    group = stats / "partials" / "stats" / "group-00000"
    want_parts = {p.name: partial_arrays(p) for p in sorted(group.glob("shard-*.zarr"))}
    assert sorted(want_parts) == ["shard-00000.zarr", "shard-00001.zarr"]
    shutil.rmtree(group)
    kill_while_publishing(built, group, tmp_path)
    rerun_cleanly(built, group)
    assert sorted(p.name for p in group.glob("shard-*.zarr")) == sorted(want_parts)
    assert all(arrays_equal(partial_arrays(group / name), want) for name, want in want_parts.items())
    # the merge (the store now also holds the rebuilt partial): bit-identical to the uninterrupted run's store
    store = stats / "stats.zarr"
    want_store = files_bytes(store)
    shutil.rmtree(store)
    kill_while_publishing(built, store, tmp_path)
    rerun_cleanly(built, store)
    assert files_bytes(store) == want_store
    # what consumes the rebuilt (identical) store is up to date: mark it so instead of recomputing it
    snakemake(built, "--cores", "1", "--touch")
    assert planned_jobs(snakemake(built, "-n")) == []


def test_a_damaged_partial_is_refused_deleted_and_rebuilt_not_merged(built):
    """A partial with a truncated kernel chunk (the stats half; found when the merge reaches its layer of P) and a
    partial of another shard in a partial's place (the eval half: readable, right shapes, wrong windows) are each
    refused by the merge with one line naming the partial, deleted, and rebuilt by the rerun; the stores then equal
    the uninterrupted run's, bit for bit."""
    stats = built / "results" / "stats" / "mini-gpt2" / "step20"
    truncated = stats / "partials" / "stats" / "group-00000" / "shard-00001.zarr"
    swapped = stats / "partials" / "eval" / "group-00000" / "shard-00001.zarr"
    stores = [stats / "stats.zarr", stats / "eval.zarr"]
    want = {s: files_bytes(s) for s in stores}
    chunk = sorted(p for p in (truncated / "P_sum").rglob("*") if p.is_file() and p.name != "zarr.json")[-1]

    def truncate(folder):
        chunk.write_bytes(chunk.read_bytes()[: chunk.stat().st_size // 2])

    def swap(folder):
        other = folder.parent / "shard-00000.zarr"
        for f in folder.rglob("*"):
            if f.is_file() and f.name != ".snakemake_timestamp":
                f.unlink()
        for f in other.rglob("*"):
            if f.is_file() and f.name != ".snakemake_timestamp":
                (folder / f.relative_to(other)).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(f, folder / f.relative_to(other))

    damage_in_place(truncated, truncate)
    damage_in_place(swapped, swap)
    for s in stores:
        shutil.rmtree(s)
    text, _ = failing_run(built, "--cores", "1", "--keep-going", *(str(s.relative_to(built)) for s in stores),
                          n_causes=2)
    lines = [ln for ln in (built / "logs").rglob("merge.log") for ln in ln.read_text().splitlines()
             if ln.startswith("mfpipe error: ")]
    rel = lambda p: str(p.relative_to(built))  # noqa: E731
    assert any(rel(truncated) in ln and "is unreadable" in ln and "rerun to rebuild it" in ln for ln in lines), lines
    assert any(rel(swapped) in ln and "was not computed from corpus shard" in ln and "rerun to rebuild it" in ln
               for ln in lines), lines
    # deleted with the folder of the job that wrote it, so that the rerun runs that job again
    assert not truncated.parent.exists() and not swapped.parent.exists(), "a damaged partial must not stay to be merged again"
    snakemake(built, "--cores", "1", *(rel(s) for s in stores))
    assert all(files_bytes(s) == want[s] for s in stores)
    snakemake(built, "--cores", "1", "--touch")
    assert planned_jobs(snakemake(built, "-n")) == []


def test_a_corrupted_corpus_shard_is_refused_with_one_line_naming_it(built):
    """A corpus shard whose contents differ from the checksum fingerprint.json recorded is refused by the job
    that reads it (its statistics would otherwise be merged as valid), with one line naming it and what to do."""
    import numpy as np

    shards = built / "results" / "corpus" / "shakespeare-ci" / "mini-gpt2" / "shards"
    shard = shards / "stats" / "shard-00001.npz"
    part = built / "results" / "stats" / "mini-gpt2" / "step20" / "partials" / "stats" / "group-00000"
    original, st = shard.read_bytes(), shard.stat()
    part_copy = part.with_name("group-00000.aside")
    shutil.copytree(part, part_copy)  # copy2: the files keep their times
    with np.load(shard) as z:
        tokens, doc_ids = z["tokens"].copy(), z["doc_ids"]
    tokens[3, 5] = (tokens[3, 5] + 1) % 512  # a valid file with one token changed: only the checksum can tell
    with open(shard, "wb") as fh:
        np.savez(fh, tokens=tokens, doc_ids=doc_ids)
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    shutil.rmtree(part)
    try:
        text, cause = failing_run(built, "--cores", "1", str(part.relative_to(built)))
        assert cause.startswith(f"mfpipe error: CorpusError: corpus shard {shard.relative_to(built)} is corrupt")
        assert f"delete the folder {shards.relative_to(built)} and rerun" in cause
        log = (built / "logs" / "stats" / "mini-gpt2" / "step20" / "stats" / "group-00000.log").read_text()
        assert cause in log and log.index(cause) < log.index("Traceback")
    finally:  # put back what the test broke, as old as it was (rebuilding the corpus would rerun the whole DAG)
        shard.write_bytes(original)
        os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
        shutil.rmtree(part, ignore_errors=True)
        part_copy.rename(part)
    snakemake(built, "--cores", "1", "--touch")
    assert planned_jobs(snakemake(built, "-n")) == []


def test_a_store_of_another_model_is_refused_with_one_line_in_the_rule_log_and_on_stderr(built):
    """Issue 12, item 3: a rollout job given mini-neox's statistics store for mini-gpt2 fails with one line naming
    the store and what to do, above the traceback in its rule log and on stderr, and nothing else."""
    stats = built / "results" / "stats"
    store = stats / "mini-gpt2" / "step20" / "stats.zarr"
    aside = store.with_name("stats.zarr.aside")
    target = built / "results" / "tables" / "teacher_forced_mini-gpt2_step20.csv"
    outputs = sorted(target.parent.glob("*_mini-gpt2_step20.*"))
    saved = {p: (p.read_bytes(), p.stat()) for p in outputs}
    store.rename(aside)
    shutil.copytree(stats / "mini-neox" / "step20" / "stats.zarr", store)
    try:
        text, cause = failing_run(built, "--cores", "1", "--allowed-rules", "error_accounting", "--forcerun",
                                  "error_accounting", str(target.relative_to(built)))
        assert cause.startswith(f"mfpipe error: ProvenanceError: statistics store {store.relative_to(built)} does not "
                                "match: model is 'mini-neox', expected 'mini-gpt2'"), cause
        assert "delete" in cause and "rerun the stats stage" in cause
        # the job's own output ends with the cause; below it the profile's show-failed-logs repeats the rule log
        job_output = text.split("Logfile logs/rollout/")[0]
        assert cause in job_output and "Traceback" not in job_output, "the traceback belongs in the rule log"
        # and the workflow's onerror handler repeats it as the last console line, after Snakemake's summary
        assert text.rstrip().splitlines()[-1] == cause, text[-1500:]
        log = (built / "logs" / "rollout" / "mini-gpt2" / "step20" / "error_accounting.log").read_text()
        assert cause in log and log.index(cause) < log.index("Traceback")
    finally:
        shutil.rmtree(store)
        aside.rename(store)
        for p, (data, st) in saved.items():
            p.write_bytes(data)
            os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
    snakemake(built, "--cores", "1", "--touch")
    assert planned_jobs(snakemake(built, "-n")) == []
