"""The short calibration behind `mfpipe estimate`: a few batches of each corpus pass of one model, at its real
shape, on this device, in a process of its own (``python -m mfpipe.estimate.calibrate SPEC_JSON`` prints one JSON
object), so that its start-up and its peak memory are a job's.

The model: the mini suite's shape from its config; a hub or local model's ``config.json`` (from the local cache)
with its real weights where they are on this machine and weigh at most :data:`MAX_CALIBRATION_BYTES`, else random
weights cut to its first :data:`CUT_LAYERS` layers; every per-layer cost is scaled by ``layers / layers_run`` (the
embedding and the LM head too: an overestimate of a cut model's share outside its layers). The windows are
Zipf-distributed token ids, as in the corpus-pass benchmarks, in batches of the config's size (the jobs' memory and
their time per token are the batch's) or, where a batch's forward would take over :data:`MAX_BATCH_SECONDS`, of fewer
windows.

Measured (seconds per token, or per position, at full depth): the bare forward, pass 1 (``accumulate_shard``), the
merge's finalize, pass 2 (``deviation_shard``), the substitution (both forwards, ``mfpipe.substitute``), one
J-lens position (``position_jacobians``) and a decoded vector's Jacobian-vector products (``position_jvps``), a training step of a mini-suite model; the process's start-up to a
loaded model and its peak resident memory (and the device's peak on a GPU); the rate a streamed model reads its blocks
from a checkpoint, cold and warm, and what streaming takes off its jobs' memory (:mod:`mfpipe.estimate.weights`)."""

from __future__ import annotations

import importlib
import json
import math
import sys
import time

from mfpipe.estimate.timing import (jlens_batch, jlens_cache_bytes, jlens_decode_batch, jlens_held_bytes, jlens_rows,
                                   jlens_sums, time_fv, time_jlens, time_jvp, time_passes, time_training, timed)
from mfpipe.estimate.weights import stream_fields

__all__ = ["calibrate", "MAX_CALIBRATION_BYTES"]

MAX_CALIBRATION_BYTES = 1 << 30  # weights beyond this (or not on this machine) are cut in depth ...
CUT_LAYERS = 2  # ... to this many layers
TIMED_SECONDS = 2.0  # each pass's timed batches: about this many seconds of bare forwards
MAX_TIMED_BATCHES = 8
MAX_BATCH_SECONDS = 10.0  # a timed batch's forward at most: beyond, fewer windows than the job's batch


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


def _load_seconds(model) -> tuple[float, tuple[float, float]]:
    """Seconds a job takes to load this model's weights from a checkpoint folder (written here, read back as jobs
    read theirs), and the seconds per byte of reading its tensors cold and warm as a streamed model reads its blocks
    (:func:`mfpipe.estimate.weights.read_rates`)."""
    import tempfile

    import transformers

    from mfpipe.estimate.weights import read_rates

    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        t = timed(lambda: transformers.AutoModelForCausalLM.from_pretrained(tmp))[0]  # (the copy dropped at once)
        rates = read_rates(tmp)
    return t, rates


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
    """``(windows [n, T], the types from most to least probable)``: Zipf-distributed token ids, BOS first."""
    import numpy as np

    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, V + 1)
    perm = rng.permutation(V)
    toks = perm[rng.choice(V, size=(n, T), p=p / p.sum())]
    toks[:, 0] = bos
    return toks, perm


def _tracked(windows, perm, n: int, bos: int, V: int):
    """The config's N most probable types of the Zipf law (a few windows hold fewer distinct ones)."""
    import numpy as np

    from mfpipe.corpus.tracked import TrackedSet, count_types

    ids = np.asarray([int(i) for i in perm if i != bos][:n])
    return TrackedSet(type_ids=ids, strings=[str(i) for i in ids], counts=count_types([windows], V)[ids],
                      bos_id=int(bos), vocab_size=V)


class _Peaks:
    """Each stage's rise of the resident memory over what the process held when it began (the high-water mark reset
    through ``/proc/self/clear_refs``, Linux; elsewhere the process's peak so far). The heap's free memory is handed
    back first (:func:`~mfpipe.workflow.heap.release_free_memory`): the jobs keep freed memory, so without it a stage
    measured after a larger one reused that one's pages and rose by little (the J-lens's rise read 0.15 GiB after
    the passes, its job peaked 1.7 GiB above the weights at GPT-2 small's shape)."""

    def __init__(self):
        self.rise: dict[str, float] = {}

    def __call__(self, name: str, fn):
        from mfpipe.workflow.heap import release_free_memory

        release_free_memory()
        rss = _rss_mb()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass
        out = fn()
        self.rise[name] = max(_peak_rss_mb() - rss, 0.0)
        return out


def calibrate(spec: dict, config: dict, *, batches: int = 1, device: str = "cpu", threads: int | None = None) -> dict:
    """The measurements of the module's docstring for model ``spec`` of ``config`` (see :func:`main`)."""
    import torch

    from mfpipe.stats import pass1 as P1
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
    model, adapter, source = _adapter(model, source)
    # the process so far (imports, the model's classes, its build) and a load of its weights from a folder
    load_s, rates = _load_seconds(model)
    startup = _process_age() + load_s
    scale = layers / adapter.n_layers
    # a batch's kernel sums of all layers are kept for one add per batch up to DEFERRED_SUMS_MAX bytes: scaled by
    # the depth run, the cut model keeps them where the whole model would (its time and memory are the whole one's)
    P1.DEFERRED_SUMS_MAX = int(P1.DEFERRED_SUMS_MAX / scale)
    peaks = _Peaks()
    out = {"model": spec["name"], "source": source, "layers": layers, "layers_run": adapter.n_layers,
           "heads": adapter.n_heads, "d_model": adapter.d_model, "d_head": adapter.d_head, "startup_s": startup,
           "runtime_batch_size": int(config["runtime"]["batch_size"]),
           "wpos": adapter.position_table() is not None}  # a learned position table: the positional job decodes
    windows, ts = peaks("forward", lambda: _forward(model, adapter, config, batches, device, out))
    B, T = out["batch_size"], out["T"]
    # a batch cut below the jobs' (MAX_BATCH_SECONDS): a window's share of a forward's memory (one more window
    # measured), added to the batched stages' peaks for each window the jobs' batch holds beyond the timed one
    out["window_mb"] = _window_mb(model, windows, B, device, peaks) if B < out["runtime_batch_size"] else 0.0
    out.update(time_passes(model, adapter, windows, ts, B, scale, config, peaks))
    out.update(_jlens(adapter, windows, T, config, layers, scale, peaks))
    # the J-lens decode through Jacobian-vector products (jlens.decode: the lenses'): a position's own work, a vector
    out["jvp_position_s"], out["jvp_s_per_vector"] = (
        x * scale for x in peaks("jvp", lambda: time_jvp(adapter, windows, T, config)))
    with torch.no_grad():  # a batch of short prompts (function vectors' injections): the per-call cost
        short = torch.as_tensor(windows[:B, :4], device=device)
        out["short_forward_s"] = min(timed(lambda: adapter.base(input_ids=short, use_cache=False))[0]
                                     for _ in range(3)) * scale
    try:  # (priced at two bare forwards a token where a model's reads cannot be patched so)
        out["fv_s_per_token"] = time_fv(adapter, windows, config) * scale
    except Exception as e:  # noqa: BLE001
        out["fv_s_per_token"], out["fv_error"] = None, f"{type(e).__name__}: {str(e)[:200]}"
    if spec["source"] == "minisuite":
        out["train_s_per_token"] = peaks("train", lambda: time_training(model, windows, B))
    # weights timed in float32 for a 16-bit model (see _adapter) count at the model's own width
    width = 0.5 if "timed in float32" in source else 1.0
    held = out["pass1_held_bytes"]
    if width != 1.0:  # a 16-bit model timed in float32 sums its mlp_out too (Adapter.mlp_out_from_resid: float32's)
        held += adapter.n_layers * (int(ts.n) + 2) * adapter.d_model * 8
    # the kernel and pass 2's sums are held whole, all layers at once: counted at the depth run and at full depth
    arrays = [layer_arrays(n, adapter.n_heads, int(ts.n), adapter.d_head, int(config["deviation"]["top_k"]),
                           adapter.d_model) for n in (adapter.n_layers, layers)]
    out["pass2_sums_mb"] = (arrays[1]["pass2"] - arrays[1]["substitution"]) / 2**20  # what only pass 2 holds
    more = out["window_mb"] * max(out["runtime_batch_size"] - B, 0)
    out.update(_memory(model, adapter, base_rss, scale, peaks, width, held, arrays, more))
    # its blocks' weights streamed where they would not fit (runtime.stream_weights): one block's memory, a read a batch
    out.update(stream_fields(config, spec, adapter, out, width, scale, rates, device))
    if device.startswith("cuda"):
        out["device_peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
    out["n_tracked"] = int(ts.n)
    return out


def _jlens(adapter, windows, T: int, config: dict, layers: int, scale: float, peaks) -> dict:
    """The J-lens job's rates (a position's seconds, a streamed model's block reads per position) and its memory's rise
    (``peaks.rise["jlens"]``), at full depth ``layers``."""
    out = {"jlens_s_per_position": time_jlens(adapter, windows, T, config) * scale}
    # its memory: the sums it holds, at full depth, and beside them a batch of its positions (a chunk of backward
    # passes, the graph through their tokens: one layer's work at a time, not scaled by the depth) and their prefixes'
    # caches (per layer: the layers not run added)
    sums = jlens_sums(adapter, config)
    peaks("jlens", lambda: jlens_batch(adapter, windows, T, config, sums))
    sums = None  # handed back before the next measure
    # (a chunk's gradients, one [rows, d] per input: 2 per layer, the layers not run added too)
    rows = jlens_rows(adapter, config)
    peaks.rise["jlens"] += (jlens_held_bytes(layers, adapter.d_model, config)
                            + (jlens_cache_bytes(adapter, T, config) + 2 * 4 * rows * adapter.d_model)
                            * (layers - adapter.n_layers)) / 2**20
    # its second phase, the decode agreement: a traced forward of a batch beside J (float32, at full depth); the job
    # hands the first phase's freed memory back between them (mfpipe.jlens.jobs), so its peak is the larger phase's
    peaks("jlens_decode", lambda: jlens_decode_batch(adapter, windows, T, config))
    decode = peaks.rise.pop("jlens_decode") + 2 * (layers + 1) * adapter.d_model ** 2 * 4 / 2**20
    peaks.rise["jlens"] = max(peaks.rise["jlens"], decode)
    # a streamed model's J-lens reads its blocks per position: the prefix's forward, the token's, each backward call
    out["jlens_reads_per_position"] = 2 + math.ceil(adapter.d_model / rows)
    return out


def _adapter(model, source: str):
    """(model, its adapter, source): random 16-bit weights the structural probe cannot place (its checks compare
    tensors that 16-bit rounding of random weights at full width sets apart) are timed in float32, and the source
    says so."""
    import torch

    from mfpipe.models.adapters import get_adapter
    from mfpipe.models.adapters.structure import UnsupportedArchitectureError

    try:
        return model, get_adapter(model), source
    except UnsupportedArchitectureError:
        if model.dtype not in (torch.bfloat16, torch.float16) or "random" not in source:
            raise
        dtype = str(model.dtype).replace("torch.", "")
        return model.float(), get_adapter(model.float()), f"{source}; timed in float32 (random {dtype} not placed)"


def _forward(model, adapter, config: dict, batches: int, device: str, out: dict):
    """The bare forward's seconds per token (into ``out``, with the batch and T the passes take), and the windows
    and tracked set of the passes."""
    import torch

    T = min(int(config["corpus"]["context_length"]), int(getattr(model.config, "max_position_embeddings", 1 << 30)))
    V = int(model.config.vocab_size)
    bos = model.config.bos_token_id if model.config.bos_token_id is not None else V - 1
    B = int(config["runtime"]["batch_size"])
    windows, perm = _zipf(V, B * (MAX_TIMED_BATCHES + 1), T, int(bos))
    ids = torch.as_tensor(windows[:1], device=device)
    with torch.no_grad():
        adapter.base(input_ids=ids, use_cache=False)  # warm-up
        one = timed(lambda: adapter.base(input_ids=ids, use_cache=False))[0]  # a window's forward
    # each pass times as many batches of the job's size after its warm-up as make about TIMED_SECONDS of forwards (a
    # small model's batch is milliseconds: a steady time needs several), at least one: a batch of the job's size,
    # not fewer windows, for its memory is the job's (the activations grow with the batch) and so is its time per
    # token (GPT-2 small at T = 512: pass 2 took 0.75 and the calibrated kernel's passes 3x the seconds per token
    # of batch-1 timings, its paper-shape run)
    # (a batch whose forward would take over MAX_BATCH_SECONDS, a 16-bit 7B model's on a CPU, is cut to fewer
    # windows: the estimate says its peaks were measured at that batch)
    B = int(max(1, min(B, MAX_BATCH_SECONDS // max(one, 1e-9))))
    n_batches = int(min(MAX_TIMED_BATCHES, max(int(batches), math.ceil(TIMED_SECONDS / max(one * B, 1e-6)))))
    windows = windows[: B * (n_batches + 1)]
    rest = windows[B:]
    with torch.no_grad():
        fwd, _ = timed(lambda: [adapter.base(input_ids=torch.as_tensor(rest[i:i + B], device=device),
                                             use_cache=False) for i in range(0, len(rest), B)])
    scale = out["layers"] / adapter.n_layers
    out.update({"T": T, "batch_size": B, "forward_s_per_token": fwd * scale / rest.size})
    return windows, _tracked(rest, perm, int(config["tracked"]["n_tracked"]), int(bos), V)


# the float64 [L+1, N, d] centroid arrays a rollout job holds whole: the evaluation half's (the truth), the statistics
# half's filled copy, the store's read before it is filled, the prediction being scored (its kernel is read one layer
# at a time: mfpipe.experiments.rollout.layered); tests/test_rollout_kernels.py measures the growth per layer
ROLLOUT_CENTROID_COPIES = 4


def layer_arrays(L: int, H: int, N: int, dh: int, top_k: int, d: int = 0) -> dict:
    """Bytes of the arrays the substitution, pass 2 and the rollout jobs hold whole over ``L`` layers at ``N``
    tracked types: the kernel W [L,H,N,N+2] and mu [L,H,N+2,dh] in float32 (``kernel_from_store``), for pass 2 its
    float64 sums and residual Grams (``DeviationAccumulator``; tests/test_streaming.py checks both against the real
    ones), for a rollout its centroids at every depth (:data:`ROLLOUT_CENTROID_COPIES`, width ``d``)."""
    K = N + 2
    kernel = L * H * K * (N + dh) * 4
    sums = 8 * L * (2 * N + 6 * N * H + 4 * N * H * dh + N * H * dh + H + 2 * H * top_k + H * dh * dh)
    return {"substitution": kernel, "pass2": kernel + sums, "rollout": ROLLOUT_CENTROID_COPIES * (L + 1) * N * d * 8}


def _window_mb(model, windows, B: int, device: str, peaks) -> float:
    """MiB the model's forward (its logits too) rises by per window (the logits, a layer's activations): a window's
    share of the batched stages' memory, at least; the rise of ``B + 1`` windows over one's, per window (one window
    more than ``B`` read 0-203 MiB at GPT-2 small's shape, where a window's logits alone are 98)."""
    import torch

    def forward(n):
        with torch.no_grad():
            model(input_ids=torch.as_tensor(windows[:n], device=device), use_cache=False)

    rises = []
    for n in (1, B + 1):
        peaks("_window", lambda n=n: forward(n))
        rises.append(peaks.rise.pop("_window"))
    return max(rises[1] - rises[0], 0.0) / B


BATCHED = ("forward", "pass1", "pass2", "substitution")  # the stages whose memory grows with runtime.batch_size


def _memory(model, adapter, base_rss: float, scale: float, peaks, width: float = 1.0, held_bytes: float = 0.0,
            arrays: list | None = None, more_windows_mb: float = 0.0) -> dict:
    """Each kind of job's peak resident memory at full depth (MiB): the process without the model, the weights
    (the layers' scaled, the embedding and LM head once) and the rise of its stage, scaled where the stage's
    buffers are per layer (training's) and not for the forward (one layer's activations
    at a time); pass 1's rise with ``held_bytes`` (its accumulators at the depth run) scaled and the rest not, the
    larger of its forwards and its partial's write (benchmarks/stats_memory.py measures the same at several depths);
    pass 2's, the substitution's and the rollouts' with the arrays they hold whole (``arrays``: :func:`layer_arrays`
    at the depth run and at full depth) counted at full depth and the rest not (a batch's logits are the LM head's,
    once); the :data:`BATCHED` stages' with ``more_windows_mb`` for the windows the timed batch left out."""
    size = lambda params: sum(p.numel() * p.element_size() for p in params)  # noqa: E731
    layer_bytes = sum(size(adapter.block_module(l).parameters()) for l in range(adapter.n_layers))
    other = (size(model.parameters()) - layer_bytes) * width
    layer_bytes *= width
    weights = (other + layer_bytes * scale) / 2**20
    rise = dict(peaks.rise)
    # pass 1 (the stats_shard job): what its reducer holds whole is per layer (the sums of every layer), the rest
    # (one layer's activations, the batch's plan, one block of derived sums as the partial is written) is not
    held = held_bytes / 2**20
    rise["pass1"] = max(rise["pass1"] + held * (scale - 1), held * scale + rise.pop("pass1_write", 0.0))
    # pass 2, the substitution and the rollouts: the kernel, pass 2's sums, the rollout's centroids (``arrays``: at
    # the depth run, at full depth) are per layer, the rest (one layer's activations and kernel, a batch's logits, the
    # unembedding) is not; without ``arrays`` pass 2's and the rollout's all scaled
    for k in ("pass2", "substitution", "rollout") if arrays else ():
        if k in rise:
            rise[k] = max(rise[k] - arrays[0][k] / 2**20, 0.0) + arrays[1][k] / 2**20
    # the forward holds one layer's activations at a time: not per layer
    per_layer = {"train"} | (set() if arrays else {"pass2", "rollout"})
    for k in BATCHED:
        if k in rise:
            rise[k] += more_windows_mb
    peak = {k: base_rss + weights + r * (scale if k in per_layer else 1.0) for k, r in rise.items()}
    return {"peak_mb": peak, "peak_rss_mb": max(peak.values()), "param_bytes": int(other + layer_bytes * scale)}


def main(argv=None) -> int:
    """``python -m mfpipe.estimate.calibrate '{"spec": ..., "config": ..., "device": ..., "threads": ...}'``."""
    args = json.loads((argv or sys.argv[1:])[0])
    out = calibrate(args["spec"], args["config"], device=args.get("device", "cpu"), threads=args.get("threads"))
    print("MFPIPE-CALIBRATION " + json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
