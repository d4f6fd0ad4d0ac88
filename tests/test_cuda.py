"""The pipeline on a CUDA device gives the CPU's results (runs only where torch sees a GPU; skipped elsewhere).

`runtime.device: auto`, the default config's, puts every analysis job on the GPU of a GPU workstation: pass 1
on the torch engine (the CPU's compiled loops do not run there), pass 2, the substitution, the calibration, the
rollout, the prompts, the function vectors and the J-lens, each with its tensors on the device. This module runs
the ci config twice side by side, `runtime.device: cpu` and `cuda`, from one training (the mini suite trains on
the CPU either way, and both runs start from a copy of its checkpoints), and compares every result:

- labelled stores, .npz and CSV tables: the same variables, columns, coordinates, attributes and integer / text
  values; floating-point values within ``RTOL`` / ``ATOL`` (float32 kernels on another device sum in another
  order; NaN where the other has NaN);
- JSON: equal but for timings; figures: drawn; Markdown and HTML: rendered from the compared tables, not compared;
- the run's cost table: timings, not compared.

On a GPU machine: `pytest tests/test_cuda.py` (about 2 minutes on an H100 with 16 cores;
`MFPIPE_CUDA_REPORT=<file>` writes every file's largest deviation there).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from workflow_runs import CI_CONFIG, clone, result_files, without_timings


def _cuda() -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover
        return False
    return torch.cuda.is_available()


needs_cuda = pytest.mark.skipif(not _cuda(), reason="no CUDA device (torch.cuda.is_available())")

# float32 work summed in another order: the statistics are float64 sums of float32 terms, the model's own
# activations differ at float32 rounding from the first matmul on
RTOL, ATOL = 2e-3, 1e-5
# test statistics (Hedges' g, Welch's p, rank correlations) of class means that are differences of nearly equal
# float32 numbers (M_ctx = D - M_cov is ~1e-6 on induction prompts): their inputs are compared at RTOL, they at this
STAT_COLUMNS, STAT_RTOL = {"g", "p_welch", "rho", "p", "r", "p_spearman", "p_pearson"}, 2e-2
# results that are timings or renderings of compared tables
NOT_COMPARED_SUFFIXES = (".md", ".html", ".tsv")
NOT_COMPARED = ("tables/run_costs.csv",)
# provenance attributes that name the device, its numerics or the run's time, not the result
DEVICE_ATTRS = {"device", "created", "elapsed_s", "wall_time_s", "cpu_time_s", "numerics"}
# where a ranked list is stored: its ranked values, and what names the item at each rank. Items may trade places
# only at a near-tie (values within tolerance of the neighbouring rank's), as float32 noise can reorder those
RANKED_STORE = ("top_D", ("top_window", "top_position", "top_shard"))
RANKED_TABLE = ("D", ("shard", "window", "position"), ("layer", "head"))  # lens contexts: rank within (layer, head)
RANKED_LISTS = {"decode_ids": "decode_probs", "decode_tokens": "decode_probs", "jlens_ids": "jlens_probs",
                "jlens_tokens": "jlens_probs", "key_positions": "key_shares", "key_tokens": "key_shares"}


def _run(workdir: Path, overlay: dict, cores: int) -> subprocess.Popen:
    path = workdir / "device.yaml"
    path.write_text(yaml.safe_dump(overlay))
    cmd = [sys.executable, "-m", "snakemake", "--snakefile", str(workdir / "Snakefile"), "--directory", str(workdir),
           "--configfile", str(CI_CONFIG), str(path), "--cores", str(cores)]
    with open(workdir / "run.log", "w") as log:  # the child holds its own copy of the descriptor
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)


def _wait(proc: subprocess.Popen, workdir: Path, timeout: int = 1800) -> None:
    proc.wait(timeout=timeout)
    assert proc.returncode == 0, (workdir / "run.log").read_text()[-6000:]


def _near(x, y, rtol: float = RTOL) -> np.ndarray:
    return np.isclose(np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64), rtol=rtol, atol=ATOL)


def _close(a, b, where: str, out: list[str], rtol: float = RTOL) -> float:
    """Compare two arrays (any dtype); append what differs to ``out``; return the largest relative deviation."""
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape:
        out.append(f"{where}: shape {a.shape} vs {b.shape}")
        return np.inf
    if a.dtype.kind in "fc" or b.dtype.kind in "fc":
        a, b = a.astype(np.float64), b.astype(np.float64)
        nan_a, nan_b = np.isnan(a), np.isnan(b)
        if not np.array_equal(nan_a, nan_b):
            out.append(f"{where}: NaN at {int((nan_a != nan_b).sum())} places that the other has finite")
            return np.inf
        fa, fb = a[~nan_a], b[~nan_b]
        if fa.size == 0:
            return 0.0
        dev = np.abs(fa - fb)
        with np.errstate(invalid="ignore"):  # inf - inf: equal infinities deviate by nothing
            dev = np.where(fa == fb, 0.0, dev)
        rel = float((dev / np.maximum(np.abs(fb), ATOL / RTOL)).max())
        bad = ~np.isclose(fa, fb, rtol=rtol, atol=ATOL)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            out.append(f"{where}: {int(bad.sum())} of {fa.size} values beyond rtol {rtol} / atol {ATOL}, e.g. "
                       f"{fa[i]!r} vs {fb[i]!r}")
        return rel
    if a.dtype.kind == "O" or b.dtype.kind == "O":  # text columns: empty cells (NaN) equal empty cells
        import pandas as pd

        a, b = np.where(pd.isna(a), None, a), np.where(pd.isna(b), None, b)
    if not np.array_equal(a, b):
        out.append(f"{where}: {int((a != b).sum()) if a.shape else 1} of {max(a.size, 1)} values differ")
        return np.inf
    return 0.0


def _swaps_at_near_ties(values: np.ndarray, differ: np.ndarray) -> np.ndarray:
    """Where ``differ`` (the item at a rank, last axis) is explained by a near-tie of ``values`` with the previous or
    next rank."""
    v = np.asarray(values, dtype=np.float64)
    tie = np.zeros(v.shape, dtype=bool)
    nb = _near(v[..., 1:], v[..., :-1])
    tie[..., 1:] |= nb
    tie[..., :-1] |= nb
    return differ & tie


def _json_close(x, y, where: str, out: list[str]) -> None:
    if isinstance(x, dict) and isinstance(y, dict):
        if sorted(x) != sorted(y):
            out.append(f"{where}: keys {sorted(set(x) ^ set(y))}")
        for k in set(x) & set(y):
            _json_close(x[k], y[k], f"{where}.{k}", out)
    elif isinstance(x, list) and isinstance(y, list) and len(x) == len(y):
        for i, (u, v) in enumerate(zip(x, y)):
            _json_close(u, v, f"{where}[{i}]", out)
    elif isinstance(x, float) and isinstance(y, (int, float)) and not isinstance(y, bool):
        if not (np.isnan(x) and np.isnan(y)) and not _near(x, y):
            out.append(f"{where}: {x!r} vs {y!r}")
    elif x != y:
        out.append(f"{where}: {x!r} vs {y!r}")


def _attrs(attrs: dict) -> dict:
    return {k: v for k, v in attrs.items() if k not in DEVICE_ATTRS}


def _store(a: Path, b: Path, name: str, out: list[str]) -> float:
    import xarray as xr

    x, y = xr.open_zarr(a, consolidated=False).load(), xr.open_zarr(b, consolidated=False).load()
    if _attrs(x.attrs) != _attrs(y.attrs):
        keys = sorted(k for k in set(x.attrs) | set(y.attrs) if x.attrs.get(k) != y.attrs.get(k))
        out.append(f"{name}: attributes differ: {keys}")
    if sorted(x.variables) != sorted(y.variables):
        out.append(f"{name}: variables {sorted(x.variables)} vs {sorted(y.variables)}")
        return np.inf
    worst, ranked = 0.0, set()
    value, items = RANKED_STORE
    if value in x.variables:
        differ = np.zeros(x[value].shape, dtype=bool)
        for v in items:
            if v in x.variables:
                differ |= x[v].values != y[v].values
        swapped = _swaps_at_near_ties(x[value].values, differ)
        if (differ & ~swapped).any():
            out.append(f"{name}: {int((differ & ~swapped).sum())} ranked items differ away from a near-tie of {value}")
        for v in items:
            if v in x.variables:
                ranked.add(v)
                worst = max(worst, _close(np.where(swapped, 0, x[v].values), np.where(swapped, 0, y[v].values),
                                          f"{name}:{v}", []))
    for v in x.variables:
        if v not in ranked:
            worst = max(worst, _close(x[v].values, y[v].values, f"{name}:{v}", out))
    return worst


def _parse_list(cell):
    import json as _json

    if isinstance(cell, str) and cell.startswith("["):
        try:
            return _json.loads(cell)
        except ValueError:
            return cell
    return cell


def _table(a: Path, b: Path, name: str, out: list[str]) -> float:
    import pandas as pd

    x, y = pd.read_csv(a), pd.read_csv(b)
    if list(x.columns) != list(y.columns) or len(x) != len(y):
        out.append(f"{name}: columns / rows {list(x.columns)} x {len(x)} vs {list(y.columns)} x {len(y)}")
        return np.inf
    keep = np.ones(len(x), dtype=bool)
    value, items, groups = RANKED_TABLE
    if value in x.columns and set(items) <= set(x.columns):
        # rows of one ranked list are consecutive; a row whose item differs must sit at a near-tie with a neighbour
        differ = np.zeros(len(x), dtype=bool)
        for c in items:
            differ |= x[c].to_numpy() != y[c].to_numpy()
        same_group = np.ones(len(x) - 1, dtype=bool)
        for c in groups:
            if c in x.columns:
                same_group &= x[c].to_numpy()[1:] == x[c].to_numpy()[:-1]
        tie = np.zeros(len(x), dtype=bool)
        nb = same_group & _near(x[value].to_numpy()[1:], x[value].to_numpy()[:-1])
        tie[1:] |= nb
        tie[:-1] |= nb
        if (differ & ~tie).any():
            out.append(f"{name}: {int((differ & ~tie).sum())} ranked rows differ away from a near-tie of {value}")
        keep &= ~(differ & tie)  # a swapped row describes the other context: compared where it sits in the other
    worst = 0.0
    for c in x.columns:
        u, v = x[c].to_numpy()[keep], y[c].to_numpy()[keep]
        if c in RANKED_LISTS and RANKED_LISTS[c] in x.columns:  # a ranked list in a cell: swaps at near-ties
            pu = [_parse_list(s) for s in x[RANKED_LISTS[c]].to_numpy()[keep]]
            iu, iv = [_parse_list(s) for s in u], [_parse_list(s) for s in v]
            for r, (p, i, j) in enumerate(zip(pu, iu, iv)):
                if i == j:
                    continue
                if not (isinstance(i, list) and isinstance(j, list) and len(i) == len(j) == len(p)):
                    out.append(f"{name}:{c}: row {r}: {i!r} vs {j!r}")
                    continue
                d = np.array([s != t for s, t in zip(i, j)])
                if not _swaps_at_near_ties(np.asarray(p, dtype=np.float64), d)[d].all():
                    out.append(f"{name}:{c}: row {r}: {i!r} vs {j!r} away from a near-tie of {RANKED_LISTS[c]}")
            continue
        cells = [_parse_list(s) for s in u]
        if cells and all(isinstance(s, list) and all(isinstance(t, (int, float)) for t in s) for s in cells):
            other = [_parse_list(s) for s in v]
            if [len(s) for s in cells] != [len(s) if isinstance(s, list) else -1 for s in other]:
                out.append(f"{name}:{c}: list lengths differ")
                continue
            u, v = np.concatenate([np.asarray(s, dtype=np.float64) for s in cells] or [np.zeros(0)]), \
                np.concatenate([np.asarray(s, dtype=np.float64) for s in other] or [np.zeros(0)])
        worst = max(worst, _close(u, v, f"{name}:{c}", out, rtol=STAT_RTOL if c in STAT_COLUMNS else RTOL))
    return worst


def compare(a: Path, b: Path, name: str, out: list[str]) -> float:
    """The largest relative deviation between result files ``a`` and ``b``; what differs beyond tolerance is
    appended to ``out``."""
    if a.suffix == ".zarr":
        return _store(a, b, name, out)
    if a.suffix == ".npz":
        with np.load(a, allow_pickle=False) as x, np.load(b, allow_pickle=False) as y:
            if sorted(x.files) != sorted(y.files):
                out.append(f"{name}: arrays {sorted(x.files)} vs {sorted(y.files)}")
                return np.inf
            return max([_close(x[k], y[k], f"{name}:{k}", out) for k in x.files] or [0.0])
    if a.suffix == ".csv":
        return _table(a, b, name, out)
    if a.suffix == ".json":
        _json_close(without_timings(json.loads(a.read_text())), without_timings(json.loads(b.read_text())), name, out)
        return 0.0
    if a.suffix in (".pdf", ".png"):
        if not b.stat().st_size:
            out.append(f"{name}: empty figure")
        return 0.0
    if a.read_bytes() != b.read_bytes():
        out.append(f"{name}: bytes differ")
        return np.inf
    return 0.0


def test_the_comparison_flags_what_differs_and_lets_near_ties_trade_places(tmp_path):
    """The GPU test's comparison, on every machine: a value moved beyond tolerance, a NaN, an item that trades
    places with one of another value, are flagged; float noise, and items trading places at a near-tie of their
    ranked values (in a store, in a table's ranked rows and in a cell's ranked list), are not."""
    import pandas as pd
    import xarray as xr

    def table(name, **cols):
        path = tmp_path / f"{name}.csv"
        pd.DataFrame(cols).to_csv(path, index=False)
        return path

    def problems(a, b):
        out = []
        compare(a, b, a.name, out)
        return out

    base = {"layer": [0, 0, 0], "head": [1, 1, 1], "rank": [0, 1, 2], "D": [0.5, 0.3, 0.3], "shard": [0, 0, 0],
            "window": [4, 7, 9], "position": [2, 2, 2], "key_tokens": ['["a", "b"]', '["c", "d"]', '["e", "f"]'],
            "key_shares": ["[0.6, 0.4]", "[0.5, 0.5]", "[0.9, 0.1]"], "g": [0.14692, 1.0, 2.0]}
    ref = table("ref", **base)
    assert problems(ref, table("noise", **{**base, "D": [0.5 * (1 + 1e-6), 0.3, 0.3], "g": [0.14641, 1.0, 2.0]})) == []
    assert problems(ref, table("tie", **{**base, "window": [4, 9, 7], "key_tokens": ['["a", "b"]', '["e", "f"]',
                                                                                       '["c", "d"]']})) == []
    assert problems(ref, table("cell_tie", **{**base, "key_tokens": ['["a", "b"]', '["d", "c"]', '["e", "f"]']})) == []
    assert problems(ref, table("moved", **{**base, "D": [0.5, 0.31, 0.3]}))
    assert problems(ref, table("nan", **{**base, "D": [0.5, np.nan, 0.3]}))
    assert problems(ref, table("swap", **{**base, "window": [7, 4, 9]}))  # 0.5 and 0.3 are no tie
    assert problems(ref, table("cell_swap", **{**base, "key_tokens": ['["b", "a"]', '["c", "d"]', '["e", "f"]']}))
    assert problems(ref, table("stat", **{**base, "g": [0.2, 1.0, 2.0]}))

    def store(name, top_window, top_D=(0.5, 0.3, 0.3), extra=0.0):
        path = tmp_path / f"{name}.zarr"
        xr.Dataset({"top_D": ("rank", np.asarray(top_D)), "top_window": ("rank", np.asarray(top_window)),
                    "P": ("t", np.array([0.25, 0.75]) + extra)}, attrs={"model": "m", "device": name}).to_zarr(path)
        return path

    zref = store("zref", [4, 7, 9])
    assert problems(zref, store("ztie", [4, 9, 7])) == []
    assert problems(zref, store("zswap", [7, 4, 9]))
    assert problems(zref, store("zmoved", [4, 7, 9], extra=1e-2))
    j = tmp_path / "a.json"
    j.write_text(json.dumps({"p": 0.0018487384, "n": 3, "elapsed_s": 1.0}))
    k = tmp_path / "b.json"
    k.write_text(json.dumps({"p": 0.0018487385, "n": 3, "elapsed_s": 9.0}))
    assert problems(j, k) == []
    k.write_text(json.dumps({"p": 0.0018487385, "n": 4}))
    assert problems(j, k)


@needs_cuda
@pytest.mark.slow
def test_the_ci_run_on_cuda_gives_the_cpu_run_results(tmp_path_factory):
    cores = max(2, (os.cpu_count() or 2) // 2)
    # side by side, each on half the cores: the mini suite trains on the CPU in both (the same checkpoints, compared
    # below), every analysis job then runs on its run's device
    runs = {dev: clone(tmp_path_factory.mktemp(dev)) for dev in ("cpu", "cuda")}
    procs = {dev: _run(wd, {"runtime": {"device": dev}}, cores) for dev, wd in runs.items()}
    for dev, proc in procs.items():
        _wait(proc, runs[dev])
    logs = "\n".join(p.read_text() for p in (runs["cuda"] / "logs").rglob("*.log"))
    assert " on cuda" in logs, "no job of the cuda run says it ran on the GPU"
    cpu, gpu = (result_files(runs[dev] / "results") for dev in ("cpu", "cuda"))
    assert sorted(cpu) == sorted(gpu), sorted(set(cpu) ^ set(gpu))
    problems, report = [], []
    for name in sorted(cpu):
        if name.endswith(NOT_COMPARED_SUFFIXES) or name in NOT_COMPARED:
            continue
        report.append(f"{compare(cpu[name], gpu[name], name, problems):.3g}\t{name}")
    if os.environ.get("MFPIPE_CUDA_REPORT"):
        Path(os.environ["MFPIPE_CUDA_REPORT"]).write_text(
            "largest relative deviation, cuda run against cpu run, per result file\n" + "\n".join(report)
            + "\n\nbeyond tolerance:\n" + "\n".join(problems) + "\n")
    assert not problems, "\n".join(problems)
