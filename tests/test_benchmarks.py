"""The benchmark scripts run end to end on a small shape (a smoke test of their code paths, not of any speed: the
ratios they print are measurements, see README)."""

from __future__ import annotations

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
