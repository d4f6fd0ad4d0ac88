"""The timed work of :mod:`mfpipe.estimate.calibrate`: a few batches of pass 1, pass 2 and the substitution (each
after a one-window warm-up), the stores' write and read, the kernel dynamics' eigendecompositions, the calibrated
kernel's passes, one J-lens position (its full J, and a decoded vector's products) and a mini-suite training step, each as seconds per unit of its work."""

from __future__ import annotations

import math
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

__all__ = ["timed", "warm_and_timed", "time_passes", "time_jlens", "jlens_batch", "jlens_decode_batch", "jlens_sums",
           "jlens_rows", "jlens_cache_bytes", "jlens_held_bytes", "time_jvp", "time_fv", "time_training", "store_math",
           "lm_head_s_per_token", "count_s_per_token"]


def _sync() -> None:
    """Wait for a GPU's queued work (a CUDA call returns once queued): a calibration on ``--device cuda`` times the
    work, not its launch."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def timed(fn):
    """``(seconds, fn())``, a GPU's queued work included."""
    _sync()
    t0 = time.perf_counter()
    out = fn()
    _sync()
    return time.perf_counter() - t0, out


def warm_and_timed(fn, warm, windows) -> tuple[float, float, object]:
    """(seconds per token on ``windows``, the first call's extra seconds (compilation, caches), the result on
    ``windows``) of ``fn(windows)``, run on ``warm`` first."""
    t_warm, _ = timed(lambda: fn(warm))
    t, out = timed(lambda: fn(windows))
    per = t / windows.size
    return per, max(t_warm - per * warm.size, 0.0), out


def time_passes(model, adapter, windows, ts, B: int, scale: float, config: dict, peaks) -> dict:
    import numpy as np

    from mfpipe.deviation import shards as DP
    from mfpipe.notebook.analysis import substitute
    from mfpipe.stats.api import MeanFieldStats
    from mfpipe.stats.partials import merge_sums, save_partial, stored_form, with_derived
    from mfpipe.stats.shards import accumulate_shard, pass1_reducer
    from mfpipe.stats.store import finalize

    warm, rest = windows[:1], windows[B:]  # one window warms each pass up (compiled loops, caches)
    job_reducer = partial(pass1_reducer, lazy_derived=True)  # the stats_shard job's (shards.shard_partials)
    p1, f1, sums = peaks("pass1", lambda: warm_and_timed(
        lambda w: accumulate_shard(model, adapter, w, ts, batch_size=B, progress=False, reducer=job_reducer),
        warm, rest))
    # the job's partial, its derived sums made a layer at a time; what the reducer holds whole grows with depth
    held = sum(v.nbytes for v in sums.values() if isinstance(v, np.ndarray) and v.ndim >= 3)
    bits = (config.get("stats") or {}).get("partial_mantissa_bits")
    with tempfile.TemporaryDirectory() as tmp:  # a shard's partial: its derived sums made as they are written
        pw, _ = timed(lambda: peaks("pass1_write", lambda: save_partial(Path(tmp) / "p.zarr", sums, {},
                                                                          mantissa_bits=bits)))
    part = with_derived({k: stored_form(k, v, None) for k, v in sums.items() if k != "resid_mid_sum"})
    meta = {"model": "calibration", "revision": "calibration", "half": "stats", "corpus": "calibration",
            "corpus_fingerprint": "calibration", "model_type": adapter.model_type, "bos_id": int(ts.bos_id),
            "context_length": int(windows.shape[1]),
            # the rollout's row-sum check allows the model's rounding (a 16-bit model's rows are ~4e-4 off 1): without
            # its dtype the calibration's rollout failed on every 16-bit preset, and its jobs took the largest peak
            "dtype": str(adapter.dtype).removeprefix("torch.")}
    tm, ds = timed(lambda: finalize(merge_sums([part]), ts, meta))
    stats = MeanFieldStats(ds)
    d = config["deviation"]
    p2, f2, (dev_sums, dev_meta) = peaks("pass2", lambda: warm_and_timed(
        lambda w: DP.deviation_shard(model, adapter, w, np.zeros(w.shape, dtype=np.int64), ts, stats, min_count=1,
                                     batch_size=B, top_k=int(d["top_k"]), other_share_max=float(d["other_share_max"]),
                                     progress=False), warm, rest))
    ps, fs, _ = peaks("substitution", lambda: warm_and_timed(
        lambda w: substitute(model, ds, w, tracked=ts, min_count=1, batch_size=B), warm, rest))
    # the substitution's two losses run the LM head at every position: that part is the full model's already
    head = lm_head_s_per_token(model, adapter, B, windows.shape[1])
    # the stores' sizes before compression (a store of real text compresses little: the default run's statistics
    # stores are ~0.85 of this), per cell of the kernel sums for the statistics store
    dev_bytes = DP.deviation_dataset(dev_sums, dev_meta, ts, min_occurrences=1).nbytes
    # a pass-2 partial (DP.save_partial): the shard's sums, per layer
    dev_partial = sum(np.asarray(v).nbytes for k, v in dev_sums.items() if k in DP.DIMS)
    out = {"pass1_s_per_token": p1 * scale, "pass1_first_s": f1, "finalize_s": tm * scale,
           "pass2_s_per_token": p2 * scale, "pass2_first_s": f2,
           "substitution_s_per_token": max(ps - 2 * head, 0.0) * scale + 2 * head, "substitution_first_s": fs,
           "lm_head_s_per_token": head,
           "store_bytes_per_cell": ds.nbytes / ds["P"].size, "deviation_store_bytes": dev_bytes * scale,
           "deviation_partial_bytes": dev_partial * scale,
           "pass1_held_bytes": held, "partial_write_s": pw * scale}
    out.update(store_math(stats, ds, windows, ts, B, config, device=adapter.device))
    out.update(analyses(model, adapter, stats, config, scale, peaks))
    return out


def analyses(model, adapter, stats, config: dict, scale: float, peaks=None) -> dict:
    """The store-bound analyses of a revision, on the calibration's statistics (as both halves), at full depth: the
    kernel dynamics' work for one layer (``kernel_dataset``'s loop body) times the layers, and Alg. 1 with the
    config's rollout kernels (``run_rollouts``; None where the calibration's store is not one it accepts) and its
    memory's rise (``peaks("rollout")``: the store read one layer of its kernel at a time, the centroids whole)."""
    import numpy as np

    from mfpipe.experiments.rollout.runs import run_rollouts
    from mfpipe.experiments.substitution import kernel_dynamics as KD
    from mfpipe.stats.api import MeanFieldStats

    def one_layer():  # kernel_dataset's work for layer 0
        mask = KD.support_mask(np.asarray(stats.context_count().values), stats.n, 1)
        W = np.asarray(stats.W(min_count=1, layer=0).values, dtype=np.float64)
        F = KD.kernel_factors(W, mask, rank=min(int(config["substitution"]["kernels"]["rank"]), stats.n))
        X = KD.masked_kernel(W, mask)
        return F, KD.row_spread(W, mask), ((X - X.mean(1, keepdims=True)) ** 2).sum(axis=(1, 2))

    out = {"kernel_revision_s": timed(one_layer)[0] * stats.n_layers * scale}
    r = config["rollout"]
    try:
        ev = MeanFieldStats(stats.ds.assign_attrs(half="eval"))  # the same sums as the evaluation half
        run = lambda: run_rollouts(model, adapter, stats, ev, kernels=r["kernels"],  # noqa: E731
                                   pin=bool(r["pin_rogue"]), min_count=1)
        out["rollout_s"] = timed(lambda: peaks("rollout", run) if peaks is not None else run())[0] * scale
    except Exception as e:  # noqa: BLE001 -- priced by its flops instead
        out["rollout_s"], out["rollout_error"] = None, f"{type(e).__name__}: {str(e)[:200]}"
    return out


def lm_head_s_per_token(model, adapter, B: int, T: int) -> float:
    import torch

    head = model.get_output_embeddings()
    x = torch.randn(B, T, adapter.d_model, dtype=adapter.dtype, device=adapter.device)
    with torch.no_grad():
        head(x)
        return timed(lambda: head(x))[0] / (B * T)


def store_math(stats, ds, windows, ts, B: int, config: dict, device="cpu") -> dict:
    """The model-free work of the store jobs: a store's write and read per cell of the kernel sums, one head's Gram
    matrix and eigendecomposition at N (the kernel dynamics), one calibration pass per pair weight on ``device``
    (the calibrate_kernel job's: runtime.device, the model's)."""
    import tempfile

    import numpy as np
    import torch
    import xarray as xr

    from mfpipe.experiments.substitution.calibration import calibrate, corpus_pass, window_batches
    from mfpipe.stats.api import open_stats
    from mfpipe.stats.store import write_store

    cells = int(ds["P"].size)
    with tempfile.TemporaryDirectory() as tmp:
        tw, _ = timed(lambda: write_store(ds, f"{tmp}/s.zarr"))
        tr, _ = timed(lambda: xr.open_zarr(f"{tmp}/s.zarr")["P"].values)
        to, _ = timed(lambda: open_stats(f"{tmp}/s.zarr"))
    N, K = ts.n, ts.n + 2
    X = np.random.default_rng(0).random((N, K))
    tg, G = timed(lambda: X @ X.T)
    te, _ = timed(lambda: np.linalg.eigh(G))
    T = windows.shape[1]

    # the calibrated kernel's passes (float32, as calibrate_kernel runs them, in the job's batches): one layer's W
    # through one batch of windows and through two, for the cost per pair weight apart from each pass's own (a batch
    # of one window timed 3x faster per pair than the job's batches of 8 at GPT-2 small's shape: its arrays fit the
    # caches), on the job's device (timed on the CPU where the job ran on an H200: 264 s priced, 18 s taken)
    W = torch.rand(ds.sizes["head"], N, K, dtype=torch.float32).to(device)
    W = W / W.sum(-1, keepdim=True)

    def one_pass(w):
        return timed(lambda: corpus_pass(W, window_batches([w], ts, batch_size=B, device=device)))[0]

    one, two = windows[:B], windows[:2 * B]  # (the calibration's windows: at least two batches)
    one_pass(one)  # warm-up
    small, big = one_pass(one), one_pass(two)
    pairs = ds.sizes["head"] * T * T * len(one)  # one batch's
    per_pair = max(big - small, 0.0) / max((len(two) - len(one)) * ds.sizes["head"] * T * T, 1)
    # an iteration's own work beside its pass (the update of U in float64, the residuals): two iterations and the
    # final residual's pass are three passes
    t_cal = timed(lambda: calibrate(W, W, window_batches([one], ts, batch_size=B, device=device), iterations=2,
                                     dtype=torch.float32))[0]
    return {"store_open_s": to, "store_write_s_per_cell": tw / cells, "store_read_s_per_cell": tr / cells,
            "eigh_s_per_head": te + tg, "flop_s": tg / (2.0 * N * N * K),
            "calibration_s_per_pair": per_pair, "calibration_pass_s": max(small - per_pair * pairs, 0.0),
            "calibration_update_s": max(t_cal - 3 * small, 0.0) / 2}


def time_jlens(adapter, windows, T: int, config: dict) -> float:
    """Seconds of one J-lens position at T/2 (its prefix's forward, then d backward passes through the token, a call
    of :func:`jlens_rows` of them at a time): one call's and two calls' rows timed, the faster of two runs each (a run
    beside other work is only ever slower), the cost of all ``ceil(d / rows)`` calls their straight line's. A call is
    the unit: each has a cost of its own beside its rows' (a 16-bit model's weights widened once a call); timing 16
    and 64 rows inside one call of 64 measured a row's share only, and the line through two close points read 25 s
    or 354 s a position for Gemma-2-2B on a loaded machine."""
    from mfpipe.models.adapters.jacobian import position_jacobians

    chunk, d = int(config["jlens"]["grad_chunk"]), adapter.d_model
    rows = jlens_rows(adapter, config)
    few, more = rows, min(2 * rows, d)

    def position(n):
        return timed(lambda: position_jacobians(adapter, windows[:1], [T // 2], grad_chunk=chunk, rows=n))[0]

    position(few)  # warm-up
    t_few = min(position(few) for _ in range(2))
    if more == few:  # one call holds all d passes
        return t_few
    t_more = min(position(more) for _ in range(2))
    per_call = max(t_more - t_few, 0.0)
    return max(t_few - per_call, 0.0) + per_call * math.ceil(d / rows)


def jlens_batch(adapter, windows, T: int, config: dict, sums=None) -> None:
    """One batch of the J-lens job's positions (``jlens.batch_size``, else ``runtime.batch_size``, windows at T/2)
    with its check groups, through one chunk of backward passes, added to ``sums`` (:func:`jlens_sums`, made before
    the memory is measured: the job holds its sums once, counted by :func:`jlens_held_bytes`): the job's memory per
    batch beside them (the prefixes' cache, the graph, a chunk of backward passes) at a fraction of its time."""
    import torch

    from mfpipe.jlens.checks import N_GROUPS
    from mfpipe.models.adapters.jacobian import position_jacobians

    j = config["jlens"]
    bs = min(int(j.get("batch_size") or config["runtime"]["batch_size"]), len(windows))
    d, chunk = adapter.d_model, int(j["grad_chunk"])
    total, by, keep = sums if sums is not None else jlens_sums(adapter, config)
    position_jacobians(adapter, windows[:bs], [T // 2] * bs, grad_chunk=chunk, rows=min(chunk, d),
                       groups=torch.arange(bs) % N_GROUPS, group_rows=keep, n_groups=N_GROUPS, into=total,
                       into_groups=by)


def jlens_decode_batch(adapter, windows, T: int, config: dict) -> None:
    """One batch of the J-lens job's second phase, its decode agreement (:func:`mfpipe.jlens.agreement.decode_vectors`):
    a traced forward of ``jlens.batch_size`` windows (else ``runtime.batch_size``; the calibration's repeated where it
    has fewer) of T tokens (a batch is cut after its last sampled position: the largest near T) with the heads' reads
    and the residuals selected: that phase's memory, which the Jacobians' batch (:func:`jlens_batch`) does not hold."""
    import numpy as np
    import torch

    bs = int(config["jlens"].get("batch_size") or config["runtime"]["batch_size"])
    ids = torch.as_tensor(np.resize(np.asarray(windows)[:, :T], (bs, T)).astype(np.int64), device=adapter.device)
    adapter.run(ids, select=("reads", "resid_in"), on_layer=lambda cap: None, on_final=lambda h: None)


def jlens_sums(adapter, config: dict) -> tuple:
    """``(total, by_group, kept rows)``: the J-lens job's sums at the model's depth (the depth run's), as it holds
    them (:func:`mfpipe.models.adapters.jacobian.jacobian_sums`)."""
    import torch

    from mfpipe.jlens.checks import N_GROUPS
    from mfpipe.models.adapters.jacobian import jacobian_sums

    keep = torch.arange(min(int(config["jlens"]["check_rows"]), adapter.d_model))
    dt = getattr(torch, config["jlens"].get("sum_dtype", "float64"))
    return jacobian_sums(adapter, dtype=dt), jacobian_sums(adapter, n_groups=N_GROUPS, keep=keep, dtype=dt), keep


def jlens_rows(adapter, config: dict) -> int:
    """Backward passes the J-lens batches in one call (``jlens.grad_chunk``; a 16-bit model on a CPU at least
    :data:`~mfpipe.models.adapters.backward16.WIDE_ROWS`), at most ``d``."""
    from mfpipe.models.adapters.backward16 import WIDE_ROWS, applies

    chunk = int(config["jlens"]["grad_chunk"])
    return min(adapter.d_model, max(chunk, WIDE_ROWS) if applies(adapter.model) else chunk)


def jlens_cache_bytes(adapter, T: int, config: dict) -> float:
    """Bytes of a J-lens batch's prefix caches per layer: its windows' keys and values up to T/2."""
    import torch

    bs = int(config["jlens"].get("batch_size") or config["runtime"]["batch_size"])
    itemsize = torch.finfo(adapter.dtype).bits // 8
    return 2.0 * bs * (T // 2) * adapter.n_kv_heads * adapter.d_head * itemsize


def jlens_held_bytes(L: int, d: int, config: dict) -> float:
    """Bytes the J-lens job holds across its batches beside a batch's own (:func:`mfpipe.jlens.lens._jacobian_sums`):
    the sums ``[2, L+1, d, d]`` and the check groups' ``[G, 2, L+1, r, d]`` in ``jlens.sum_dtype``, and at its end the
    float32 ``J`` beside float64 sums (float32 sums are divided and kept as ``J``, no copy)."""
    from mfpipe.jlens.checks import N_GROUPS

    r = min(int(config["jlens"]["check_rows"]), d)
    wide = config["jlens"].get("sum_dtype", "float64") == "float64"
    return (8.0 if wide else 4.0) * 2 * (L + 1) * d * (d + N_GROUPS * r) + (4.0 * 2 * (L + 1) * d * d if wide else 0)


def time_jvp(adapter, windows, T: int, config: dict) -> tuple[float, float]:
    """(seconds of one position's own work, seconds per vector) of the J-lens decode through Jacobian-vector
    products (:mod:`mfpipe.jlens.jvp`) at T/2: 16 and 48 vectors inserted at layer 0 (the whole depth) timed after a
    warm-up, the faster of two runs each, their straight line; its own work is the prefix's forward and the check of
    the kept cache."""
    import torch

    from mfpipe.models.adapters.jvp import position_jvps

    chunk = int(config["jlens"].get("jvp_chunk") or 64)
    V = torch.randn(48, adapter.d_model, generator=torch.Generator().manual_seed(0)).to(adapter.device, adapter.dtype)

    def position(n):
        return timed(lambda: position_jvps(adapter, windows[:1], [T // 2], V[:n], [0] * n, "block", chunk=chunk))[0]

    position(16)  # warm-up
    t_few, t_more = min(position(16) for _ in range(2)), min(position(48) for _ in range(2))
    # on a tiny model the 32 vectors' difference can sit in the timing noise (<= 0): the whole run's cost per vector
    # bounds it from above then
    per = (t_more - t_few) / 32 if t_more > t_few else t_more / 48
    return max(t_few - 16 * per, 0.0), per


def time_fv(adapter, windows, config: dict) -> float:
    """Seconds per token of the function-vector job's forwards at the depth run: a batch of AIE's rows (``fv``'s
    batch, one few-shot prompt of ``n_shots`` exemplars repeated, each row's head read at the cue replaced; as
    :func:`mfpipe.experiments.fv.heads.aie` runs them), the faster of two after a warm-up. Short prompts in batches
    of the job's size, not a corpus window's batch (GPT-2 small: 0.76 of the bare forward's seconds per token). The
    prompt counts 4 tokens an exemplar: a rate per token (the price counts the model's own exemplars' tokens)."""
    import numpy as np
    import torch

    from mfpipe.experiments.fv.heads import last_logits

    f = config["fv"]
    B = int(f.get("batch_size") or config["runtime"]["batch_size"])
    P = min(1 + 4 * int(f["n_shots"]) + 2, windows.shape[1])
    ids = torch.as_tensor(np.tile(windows[0, :P], (B, 1)), device=adapter.device)
    rows, hd = torch.arange(B), torch.arange(B) % adapter.n_heads
    got: dict = {}

    def patch(layer, reads):  # (AIE's rows of one chunk sit in one or two layers)
        if layer != 0:
            return None
        out = reads.clone()
        out[rows.to(out.device), -1, hd.to(out.device)] = 0
        return out

    def call():
        adapter.run(ids, select=(), patch_reads=patch, on_final=lambda x: got.update(f=x))
        return torch.softmax(last_logits(adapter, got["f"]).float(), -1)

    with torch.no_grad():
        call()
        return min(timed(call)[0] for _ in range(2)) / ids.numel()


def time_training(model, windows, B: int, steps: int = 3) -> float:
    """Seconds per token of a training step (AdamW, the loss on every position) on the mini suite's pinned
    numerics, one thread, as its training job runs."""
    from mfpipe.workflow.numerics import TRAIN_THREADS, pinned

    with pinned(TRAIN_THREADS):
        return _steps(model, windows, B, steps)


def _steps(model, windows, B: int, steps: int) -> float:
    import torch

    model.train().requires_grad_(True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.as_tensor(windows[:B], device=next(model.parameters()).device)
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


def count_s_per_token(vocab: int = 50257, windows: int = 2048, T: int = 512) -> float:
    """Seconds per token of the corpus stage's type count (``tracked_types``, ``rank_frequency``): a shard written
    with the corpus stage's writer, read back with its checksum checked, its types counted."""
    import numpy as np

    from mfpipe.corpus.tracked import count_types
    from mfpipe.corpus.windows import Shard, read_shard, shard_fingerprint, write_shards

    rng = np.random.default_rng(0)
    shard = Shard(rng.integers(vocab, size=(windows, T), dtype=np.int32), np.zeros((windows, T), dtype=np.int32))

    def count(path):
        read = read_shard(path)  # (no fingerprint.json beside it here: the job's check of it timed apart)
        shard_fingerprint(read)
        return count_types([read.tokens], vocab)

    with tempfile.TemporaryDirectory() as tmp:
        path, = write_shards(shard, tmp, windows)
        t, _ = timed(lambda: count(path))
    return t / shard.tokens.size
