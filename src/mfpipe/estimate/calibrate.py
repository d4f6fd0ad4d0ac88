"""The short calibration behind `mfpipe estimate`: a few batches of each corpus pass of one model, at its real
shape, on this device, in a process of its own (``python -m mfpipe.estimate.calibrate SPEC_JSON`` prints one JSON
object), so that its start-up and its peak memory are a job's.

The model: the mini suite's shape from its config; a hub or local model's ``config.json`` (from the local cache)
with its real weights where they are on this machine and weigh at most :data:`MAX_CALIBRATION_BYTES`, else random
weights cut to its first :data:`CUT_LAYERS` layers; every per-layer cost is scaled by ``layers / layers_run`` (the
embedding and the LM head too: an overestimate of a cut model's share outside its layers). The windows are
Zipf-distributed token ids, as in the corpus-pass benchmarks, in batches of the config's size or, where a batch's
forward would take over :data:`TIMED_SECONDS`, of fewer windows.

Measured (seconds per token, or per position, at full depth): the bare forward, pass 1 (``accumulate_shard``), the
merge's finalize, pass 2 (``deviation_shard``), the substitution (both forwards, ``mfpipe.substitute``), one
J-lens position (``position_jacobians``), a training step of a mini-suite model; the process's start-up to a
loaded model and its peak resident memory (and the device's peak on a GPU)."""

from __future__ import annotations

import importlib
import json
import math
import sys
import time

__all__ = ["calibrate", "MAX_CALIBRATION_BYTES"]

MAX_CALIBRATION_BYTES = 1 << 30  # weights beyond this (or not on this machine) are cut in depth ...
CUT_LAYERS = 2  # ... to this many layers
TIMED_SECONDS = 2.0  # each pass's timed batches: about this many seconds of bare forwards
MAX_TIMED_BATCHES = 8


def _process_age() -> float:
    import psutil

    return time.time() - psutil.Process().create_time()


def _rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def _peak_rss_mb() -> float:
    from pathlib import Path

    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _load_seconds(model) -> float:
    """Seconds a job takes to load this model's weights from a checkpoint folder (written here, read back as jobs
    read theirs)."""
    import tempfile

    import transformers

    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        t, _ = _timed(lambda: transformers.AutoModelForCausalLM.from_pretrained(tmp))
    return t


def _build(spec: dict, config: dict, results: str):
    import torch
    import transformers

    from mfpipe.models.tiny import meta_parameter_count

    if spec["source"] == "minisuite":
        from mfpipe.minisuite.model import build_model, resolve_config
        from mfpipe.workflow.config import minimodel

        mm = resolve_config(minimodel(config, spec["name"]))
        vocab = int(config["minisuite"]["tokenizer"]["vocab_size"])
        torch.manual_seed(0)
        model = build_model(mm, vocab)
        return model, "mini-suite shape, random weights", model.config.num_hidden_layers
    from mfpipe.models.loader import resolve_location

    path, rev = resolve_location(spec, (spec.get("revisions") or [None])[-1], results)
    cfg = transformers.AutoConfig.from_pretrained(path, revision=rev, trust_remote_code=False)
    layers = int(cfg.num_hidden_layers)
    dtype = getattr(torch, spec.get("dtype") or config["runtime"]["dtype"])
    nbytes = meta_parameter_count(cfg) * torch.finfo(dtype).bits // 8
    if nbytes <= MAX_CALIBRATION_BYTES:
        try:
            from mfpipe.models.loader import load_model

            model = load_model(dict(spec), (spec.get("revisions") or [None])[-1], dtype=str(dtype).split(".")[-1],
                               device="cpu", results_dir=results)
            return model, "real weights (local cache)", layers
        except Exception:  # noqa: BLE001 -- not on this machine: random weights of the same shape
            pass
    # per-layer costs scale with depth: two layers time a large model's layers as well as all of them
    keep = max(1, min(layers, CUT_LAYERS, int(layers * MAX_CALIBRATION_BYTES / max(nbytes, 1))))
    cfg.num_hidden_layers = keep
    for key in ("layer_types", "block_types"):  # per-layer lists follow the depth
        if isinstance(getattr(cfg, key, None), list):
            setattr(cfg, key, getattr(cfg, key)[:keep])
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=dtype)
    return model, f"random weights from config.json, {keep} of {layers} layers", layers


def _zipf(V: int, n: int, T: int, bos: int, seed: int = 0):
    import numpy as np

    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, V + 1)
    toks = rng.permutation(V)[rng.choice(V, size=(n, T), p=p / p.sum())]
    toks[:, 0] = bos
    return toks


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def calibrate(spec: dict, config: dict, *, batches: int = 1, device: str = "cpu", threads: int | None = None) -> dict:
    """The measurements of the module's docstring for model ``spec`` of ``config`` (see :func:`main`)."""
    import torch

    from mfpipe.corpus.tracked import count_types, select_tracked
    from mfpipe.models.adapters import get_adapter
    from mfpipe.workflow.heap import keep_freed_memory
    from mfpipe.workflow.numerics import pin_torch

    keep_freed_memory()
    pin_torch(threads)
    # a forward job's start-up imports its pass's code (the corpus passes' compiled loops, the stores) first
    for module in ("mfpipe.workflow.runner", "mfpipe.stats.shards", "mfpipe.stats.store", "mfpipe.deviation.shards"):
        importlib.import_module(module)

    base_rss = _rss_mb()
    model, source, layers = _build(spec, config, config["results"])
    model = model.to(device).eval().requires_grad_(False)
    model.config._attn_implementation = "eager"
    adapter = get_adapter(model)
    # the process so far (imports, the model's classes, its build) and a load of its weights from a folder
    startup = _process_age() + _load_seconds(model)
    scale = layers / adapter.n_layers
    T = min(int(config["corpus"]["context_length"]), int(getattr(model.config, "max_position_embeddings", 1 << 30)))
    B = int(config["runtime"]["batch_size"])
    V = int(model.config.vocab_size)
    bos = model.config.bos_token_id if model.config.bos_token_id is not None else V - 1
    windows = _zipf(V, B * (MAX_TIMED_BATCHES + 1), T, int(bos))
    ids = torch.as_tensor(windows[:1], device=device)
    with torch.no_grad():
        adapter.base(input_ids=ids, use_cache=False)  # warm-up
        one = _timed(lambda: adapter.base(input_ids=ids, use_cache=False))[0]  # a window's forward
    # each pass times as many batches after its warm-up as make about TIMED_SECONDS of forwards (a small model's
    # batch is milliseconds: a steady time needs several); a batch whose forward takes longer is cut to fewer
    # windows (the seconds per token of a compute-bound forward hardly depend on the batch)
    B = int(max(1, min(B, TIMED_SECONDS // max(one, 1e-9))))
    n_batches = int(min(MAX_TIMED_BATCHES, max(int(batches), math.ceil(TIMED_SECONDS / max(one * B, 1e-6)))))
    windows = windows[: B * (n_batches + 1)]
    timed = windows[B:]
    ntok = timed.size
    with torch.no_grad():
        fwd, _ = _timed(lambda: [adapter.base(input_ids=torch.as_tensor(timed[i:i + B], device=device),
                                              use_cache=False) for i in range(0, len(timed), B)])
    out = {"model": spec["name"], "source": source, "layers": layers, "layers_run": adapter.n_layers,
           "heads": adapter.n_heads, "d_model": adapter.d_model, "T": T, "batch_size": B, "startup_s": startup,
           "runtime_batch_size": int(config["runtime"]["batch_size"]),
           "forward_s_per_token": fwd * scale / ntok}
    ts = select_tracked(count_types([timed], V), int(config["tracked"]["n_tracked"]), int(bos), decode=str)
    out.update(_passes(model, adapter, windows, ts, B, scale, config))
    out["jlens_s_per_position"] = _jlens(adapter, windows, T, config) * scale
    with torch.no_grad():  # a batch of short prompts (function vectors' injections): the per-call cost
        short = torch.as_tensor(windows[:B, :4], device=device)
        out["short_forward_s"] = min(_timed(lambda: adapter.base(input_ids=short, use_cache=False))[0]
                                     for _ in range(3)) * scale
    if spec["source"] == "minisuite":
        out["train_s_per_token"] = _train_step(model, windows, B)
    peak = _peak_rss_mb()
    out["peak_rss_mb"] = base_rss + (peak - base_rss) * scale  # weights and per-layer buffers at full depth
    out["param_bytes"] = int(sum(p.numel() * p.element_size() for p in model.parameters()) * scale)
    if device.startswith("cuda"):
        out["device_peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
    out["partial_cells"] = int(adapter.n_layers * adapter.n_heads * ts.n * (ts.n + 2) * scale)
    out["n_tracked"] = int(ts.n)
    return out


def _warm_and_timed(fn, warm, timed) -> tuple[float, float, object]:
    """(seconds per token on ``timed``, the first call's extra seconds (compilation, caches), the result on
    ``timed``) of ``fn(windows)``, run on ``warm`` first."""
    t_warm, _ = _timed(lambda: fn(warm))
    t, out = _timed(lambda: fn(timed))
    per = t / timed.size
    return per, max(t_warm - per * warm.size, 0.0), out


def _passes(model, adapter, windows, ts, B: int, scale: float, config: dict) -> dict:
    import numpy as np

    from mfpipe.deviation import shards as DP
    from mfpipe.notebook.analysis import substitute
    from mfpipe.stats.api import MeanFieldStats
    from mfpipe.stats.partials import merge_sums, stored_form, with_derived
    from mfpipe.stats.shards import accumulate_shard
    from mfpipe.stats.store import finalize

    warm, timed = windows[:1], windows[B:]  # one window warms each pass up (compiled loops, caches)
    p1, f1, sums = _warm_and_timed(lambda w: accumulate_shard(model, adapter, w, ts, batch_size=B, progress=False),
                                   warm, timed)
    part = with_derived({k: stored_form(k, v, None) for k, v in sums.items() if k != "resid_mid_sum"})
    meta = {"model": "calibration", "revision": "calibration", "half": "stats", "corpus": "calibration",
            "corpus_fingerprint": "calibration", "model_type": adapter.model_type}
    tm, ds = _timed(lambda: finalize(merge_sums([part]), ts, meta))
    stats = MeanFieldStats(ds)
    d = config["deviation"]
    p2, f2, _ = _warm_and_timed(
        lambda w: DP.deviation_shard(model, adapter, w, np.zeros(w.shape, dtype=np.int64), ts, stats, min_count=1,
                                     batch_size=B, top_k=int(d["top_k"]), other_share_max=float(d["other_share_max"]),
                                     progress=False), warm, timed)
    ps, fs, _ = _warm_and_timed(lambda w: substitute(model, ds, w, tracked=ts, min_count=1, batch_size=B), warm, timed)
    out = {"pass1_s_per_token": p1 * scale, "pass1_first_s": f1, "finalize_s": tm * scale,
           "pass2_s_per_token": p2 * scale, "pass2_first_s": f2,
           "substitution_s_per_token": ps * scale, "substitution_first_s": fs}
    out.update(_store_math(stats, ds, timed, ts, B, config))
    return out


def _store_math(stats, ds, windows, ts, B: int, config: dict) -> dict:
    """The model-free work of the store jobs: a store's write and read per cell of the kernel sums, one head's Gram
    matrix and eigendecomposition at N (the kernel dynamics), one calibration pass per pair weight."""
    import tempfile
    from pathlib import Path

    import numpy as np
    import torch
    import xarray as xr

    from mfpipe.experiments.substitution.calibration import calibrate, corpus_pass, window_batches
    from mfpipe.stats.api import open_stats
    from mfpipe.stats.store import write_store

    cells = int(ds["P"].size)
    with tempfile.TemporaryDirectory() as tmp:
        tw, _ = _timed(lambda: write_store(ds, f"{tmp}/s.zarr"))
        tr, _ = _timed(lambda: xr.open_zarr(f"{tmp}/s.zarr")["P"].values)
        to, _ = _timed(lambda: open_stats(f"{tmp}/s.zarr"))
        nbytes = sum(f.stat().st_size for f in Path(tmp).rglob("*") if f.is_file())
    N, K = ts.n, ts.n + 2
    X = np.random.default_rng(0).random((N, K))
    tg, G = _timed(lambda: X @ X.T)
    te, _ = _timed(lambda: np.linalg.eigh(G))
    T = windows.shape[1]

    # the calibrated kernel's passes (float32, as calibrate_kernel runs them): one layer's W through one window and
    # through three, for the cost per pair weight apart from each pass's own
    W = torch.rand(ds.sizes["head"], N, K, dtype=torch.float32)
    W = W / W.sum(-1, keepdim=True)

    def one_pass(w):
        return _timed(lambda: corpus_pass(W, window_batches([w], ts, batch_size=B)))[0]

    one, three = windows[:1], windows[:3]  # a pass costs ~H·T² per window: at T = 512 seconds a window on a CPU
    one_pass(one)  # warm-up
    small, big = one_pass(one), one_pass(three)
    pairs = ds.sizes["head"] * T * T  # one window's
    per_pair = max(big - small, 0.0) / (2 * pairs)
    # an iteration's own work beside its pass (the update of U in float64, the residuals): two iterations and the
    # final residual's pass are three passes
    t_cal = _timed(lambda: calibrate(W, W, window_batches([one], ts, batch_size=B), iterations=2,
                                     dtype=torch.float32))[0]
    return {"store_open_s": to, "store_write_s_per_cell": tw / cells, "store_read_s_per_cell": tr / cells, "store_bytes_per_cell": nbytes / cells,
            "eigh_s_per_head": te + tg, "flop_s": tg / (2.0 * N * N * K),
            "calibration_s_per_pair": per_pair, "calibration_pass_s": max(small - per_pair * pairs, 0.0),
            "calibration_update_s": max(t_cal - 3 * small, 0.0) / 2}


def _jlens(adapter, windows, T: int, config: dict) -> float:
    from mfpipe.models.adapters.jacobian import position_jacobians

    B = min(int(config["jlens"].get("batch_size") or config["runtime"]["batch_size"]), 2)
    t, _ = _timed(lambda: position_jacobians(adapter, windows[:B], [T // 2] * B,
                                             grad_chunk=int(config["jlens"]["grad_chunk"])))
    return t / B


def _train_step(model, windows, B: int, steps: int = 3) -> float:
    """Seconds per token of a training step (AdamW, the loss on every position) on the mini suite's pinned
    numerics, one thread, as its training job runs."""
    from mfpipe.workflow.numerics import TRAIN_THREADS, pinned

    with pinned(TRAIN_THREADS):
        return _steps(model, windows, B, steps)


def _steps(model, windows, B: int, steps: int) -> float:
    import torch

    model.train().requires_grad_(True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.as_tensor(windows[:B])
    total = 0.0
    for i in range(steps + 1):
        t0 = time.perf_counter()
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        if i:
            total += time.perf_counter() - t0
    model.eval().requires_grad_(False)
    return total / steps / x.numel()


def main(argv=None) -> int:
    """``python -m mfpipe.estimate.calibrate '{"spec": ..., "config": ..., "device": ..., "threads": ...}'``."""
    args = json.loads((argv or sys.argv[1:])[0])
    out = calibrate(args["spec"], args["config"], device=args.get("device", "cpu"), threads=args.get("threads"))
    print("MFPIPE-CALIBRATION " + json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
