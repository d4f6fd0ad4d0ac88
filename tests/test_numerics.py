"""Pinned numerics (issue 42, mfpipe.workflow.numerics): a training run gives the same bits whatever CPU code paths
its environment asks for, where the unpinned run does not; the provenance record; pinning in a fresh process."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mfpipe.workflow.numerics import has_avx2, numerics_info, pinned, pinned_env

SRC = Path(__file__).resolve().parents[1] / "src"
# what a user's environment may ask for; the two "code paths" of each comparison below (benchmarks/HISTORY.md,
# "Issue 42": each of these changes an unpinned run's bits on an AVX2 / AVX-512 machine)
PATH_A = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "AUTO", "OMP_NUM_THREADS": "2"}
PATH_B = {}  # the machine's own choices
PINNED_KEYS = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "NPY_DISABLE_CPU_FEATURES", "OPENBLAS_CORETYPE", "NUMBA_CPU_NAME",
               "OMP_NUM_THREADS")

# a GPT-NeoX model (its erf GELU is oneDNN's where oneDNN is on), two layers, 40 steps of 16 rows
TRAIN = """
import hashlib, json, sys
from mfpipe.workflow.numerics import pin_env
if sys.argv[3] == "pinned":
    pin_env()  # as the workflow's job runner does, before the job's imports (NumPy reads its variable on import)
from pathlib import Path
from mfpipe.minisuite.train import train_mini_model
tok, out, pinned = sys.argv[1], Path(sys.argv[2]), sys.argv[3] == "pinned"
text = ("Who's there? Nay, answer me: stand, and unfold yourself. Long live the king! " * 40)
cfg = dict(name="num", architecture="gpt_neox", n_layer=2, d_model=32, n_head=4, d_mlp=64, context_length=32,
           steps=40, batch_size=16, lr=3e-3, warmup_steps=5, seed=0, induction_sequences=8, eval_rows=4, repeat_max=8,
           induction_every=0, linear_checkpoints=[])
summary = train_mini_model(cfg, tok, [text[i:i + 400] for i in range(0, len(text), 400)], out, threads=1,
                           progress=False, pinned=pinned)
digest = hashlib.sha256((out / "checkpoints" / "step40" / "model.safetensors").read_bytes()).hexdigest()
print(json.dumps({"digest": digest, "numerics": summary["numerics"],
                  "losses": [r["text_loss"] for r in summary["checkpoints"]]}))
"""


def _clean_env(extra: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in PINNED_KEYS}
    env["PYTHONPATH"] = str(SRC) + os.pathsep + env.get("PYTHONPATH", "")
    return env | extra


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    from mfpipe.minisuite.tokenizer import train_tokenizer

    d = tmp_path_factory.mktemp("tok") / "tok"
    train_tokenizer(["Who's there? Nay, answer me: stand, and unfold yourself. Long live the king!"] * 20, 300, 1, d)
    return d


def _train_pairs(tok_dir, tmp_path, runs):
    """Run each (label, env, mode) training in its own process, two at a time; {label: its JSON line}."""
    out = {}
    for i in range(0, len(runs), 2):
        procs = {label: subprocess.Popen([sys.executable, "-c", TRAIN, str(tok_dir), str(tmp_path / label), mode],
                                         env=_clean_env(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                         text=True) for label, env, mode in runs[i:i + 2]}
        for label, p in procs.items():
            stdout, stderr = p.communicate(timeout=600)
            assert p.returncode == 0, stderr[-3000:]
            out[label] = json.loads(stdout.strip().splitlines()[-1])
    return out


@pytest.mark.skipif(not has_avx2(), reason="pinned numerics are for x86-64 CPUs with AVX2")
def test_training_is_bit_identical_under_two_code_paths(tok_dir, tmp_path):
    runs = _train_pairs(tok_dir, tmp_path, [("pinned_a", PATH_A, "pinned"), ("pinned_b", PATH_B, "pinned"),
                                            ("native_a", PATH_A, "native"), ("native_b", PATH_B, "native")])
    a, b = runs["pinned_a"], runs["pinned_b"]
    assert a["numerics"]["pinned"] and b["numerics"]["pinned"], (a["numerics"], b["numerics"])
    assert a["numerics"] == b["numerics"]
    assert a["numerics"]["cpu_capability"] == "AVX2" and a["numerics"]["threads"] == 1
    assert a["digest"] == b["digest"] and a["losses"] == b["losses"]
    # the two paths are different code: unpinned, the same runs differ (ATen's default kernels draw other
    # initial weights), so the equality above is the pinning's doing
    na, nb = runs["native_a"], runs["native_b"]
    assert na["numerics"]["cpu_capability"] == "DEFAULT" and nb["numerics"]["cpu_capability"] != "DEFAULT"
    assert na["digest"] != nb["digest"]


def test_numerics_info_fields():
    info = numerics_info()
    assert info["torch"] == torch.__version__
    assert info["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert info["threads"] == torch.get_num_threads()
    assert {"blas", "mkl", "mkl_branch", "onednn", "numpy_simd", "pinned"} <= set(info)
    json.dumps(info)  # a store attribute


def test_pinned_in_fresh_process():
    """Before torch's first kernel the pin takes, whatever the environment asked for: AVX2 kernels, MKL's
    COMPATIBLE branch, no oneDNN, one thread, NumPy without its AVX-512 loops."""
    code = ("import json\nfrom mfpipe.workflow.numerics import pinned\n"
            "with pinned() as info:\n    print(json.dumps(info))\n")
    out = subprocess.run([sys.executable, "-c", code], env=_clean_env(PATH_A), capture_output=True, text=True,
                         check=True).stdout
    info = json.loads(out.strip().splitlines()[-1])
    assert info["threads"] == 1 and not info["onednn"], info
    if has_avx2():
        assert info["pinned"] and info["cpu_capability"] == "AVX2", info
        assert "X86_V4" not in (info["numpy_simd"] or ""), info
    if info["blas"] == "mkl":
        assert info["mkl_branch"] == "COMPATIBLE", info


def test_pinned_restores_threads_onednn_and_environment():
    """A test process (or a notebook) that trains pinned and then starts processes must hand them its own
    environment: a pinned child beside an unpinned parent computes other bits."""
    prev, prev_onednn = torch.get_num_threads(), torch.backends.mkldnn.enabled
    env = {k: os.environ.get(k) for k in PINNED_KEYS}
    with pinned(threads=1):
        assert torch.get_num_threads() == 1 and not torch.backends.mkldnn.enabled
        assert os.environ["MKL_CBWR"] == "COMPATIBLE"
    assert torch.get_num_threads() == prev and torch.backends.mkldnn.enabled == prev_onednn
    assert {k: os.environ.get(k) for k in PINNED_KEYS} == env


def test_pinned_env_only_where_it_applies(monkeypatch):
    from mfpipe.workflow import numerics

    monkeypatch.setattr(numerics, "has_avx2", lambda: False)
    assert pinned_env() == {"MKL_CBWR": "COMPATIBLE"}  # harmless anywhere; the AVX2 pins would fault without AVX2
    monkeypatch.setattr(numerics, "has_avx2", lambda: True)
    assert pinned_env()["ATEN_CPU_CAPABILITY"] == "avx2" and pinned_env()["OPENBLAS_CORETYPE"] == "Haswell"


def test_a_store_records_its_numerics(tmp_path):
    import xarray as xr

    from mfpipe.stats.store import write_store

    write_store(xr.Dataset({"x": ("layer", [1.0, 2.0])}), tmp_path / "s.zarr")
    got = xr.open_zarr(tmp_path / "s.zarr").attrs["numerics"]
    assert got == json.loads(json.dumps(numerics_info()))
    carried = {"torch": "x", "pinned": True}  # a merge carries its parts' numerics, not its own
    write_store(xr.Dataset({"x": ("layer", [1.0])}, attrs={"numerics": carried}), tmp_path / "m.zarr")
    assert xr.open_zarr(tmp_path / "m.zarr").attrs["numerics"] == carried


def test_native_mode_pins_nothing(monkeypatch):
    monkeypatch.setenv("MFPIPE_NUMERICS", "native")
    assert pinned_env() == {}
    assert numerics_info()["pinned"] is False
    monkeypatch.setenv("MFPIPE_NUMERICS", "fast")
    with pytest.raises(ValueError, match="MFPIPE_NUMERICS='fast'"):
        pinned_env()
