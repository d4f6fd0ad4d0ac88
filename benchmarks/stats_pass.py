#!/usr/bin/env python
"""Benchmark: the statistics corpus pass against a bare forward pass, on the same batches, in one run.

Prints tokens/s of (a) the bare forward (the model body, eager attention, no LM head — the capture stops
before the final norm/LM head too), (b) the nnsight capture of the fields the pass reads, with no-op callbacks (tracing overhead
alone) and (c) the full statistics pass (capture + all reductions), their ratios to (a) (goal: stats ≤ 1.15×),
peak memory (process RSS after the bare forward and overall; CUDA peak on GPU) and the size on disk of the
partial these batches give (a compressed Zarr folder, written to a temporary folder unless --save-partial).

    PYTHONPATH=src python benchmarks/stats_pass.py --model gpt2-small-random --n-tracked 1000 --context-length 512 \
        --batch-size 4 --batches 6 --device cpu
    PYTHONPATH=src python benchmarks/stats_pass.py --model mini-gpt2-random --context-length 64 --batch-size 32
    python benchmarks/stats_pass.py --model results/minisuite/<name>/checkpoints/<step>

Tokens are Zipf-distributed over the vocabulary (about two thirds of positions tracked at N=1000, like
real text) unless ``--shard`` gives a corpus shard (.npz); the tracked set is the top-N types of the
benchmark tokens.
"""

from __future__ import annotations

import argparse
import gc
import resource
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import torch


def rss_mb() -> float:
    return psutil.Process().memory_info().rss / 2**20


def peak_rss_mb() -> float:
    """Peak resident memory of this process (MiB): VmHWM (reset by exec, unlike ru_maxrss, which a child process
    started by subprocess inherits from its parent); ru_maxrss where /proc is missing."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def zipf_windows(V: int, n_windows: int, T: int, bos: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """[BOS, t1 …] windows of Zipf-distributed tokens (exponent 1 over a seeded permutation of the vocabulary,
    about two thirds of positions in the top 1000 types, like real text) and that permutation (most probable first)."""
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, V + 1) ** 1.0
    p /= p.sum()
    perm = rng.permutation(V)
    toks = perm[rng.choice(V, size=(n_windows, T), p=p)]
    toks[:, 0] = bos
    return toks, perm


def benchmark_tracked(toks: np.ndarray, V: int, bos: int, n_tracked: int, ranked: np.ndarray | None = None):
    """The tracked set of the benchmark: the ``n_tracked`` most probable types of the Zipf law (``ranked``: a few
    batches do not show N distinct types at N = 4000), else the most frequent types of ``toks``."""
    from mfpipe.corpus.tracked import TrackedSet

    counts = np.bincount(toks[:, 1:].ravel(), minlength=V)
    counts[bos] = 0
    if ranked is None:
        order = np.lexsort((np.arange(V), -counts))
        ids_top = [int(i) for i in order[:n_tracked] if counts[i] > 0]
    else:
        ids_top = [int(i) for i in ranked if i != bos][:n_tracked]
    return TrackedSet(type_ids=np.asarray(ids_top), strings=[str(i) for i in ids_top], counts=counts[ids_top],
                      bos_id=int(bos), vocab_size=V)


def build_model(name: str, device: str):
    import transformers

    if name in ("gpt2-small-random", "mini-gpt2-random"):
        if name == "gpt2-small-random":
            cfg = transformers.GPT2Config()  # 12 layers, 12 heads, 768 wide, vocab 50257
        else:  # the shape of config/config.yaml's mini-gpt2 (2 layers, 128 wide, 8 heads, vocab 4096)
            cfg = transformers.GPT2Config(n_layer=2, n_embd=128, n_head=8, n_inner=64, vocab_size=4096, n_positions=64,
                                         bos_token_id=0, eos_token_id=0)
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(cfg)
        model.config._attn_implementation = "eager"
        model.eval().requires_grad_(False)
        return model.to(device)
    from mfpipe.models.loader import load_model

    p = Path(name)
    if not p.is_dir():
        sys.exit(f"--model: {name!r} is neither gpt2-small-random / mini-gpt2-random nor a checkpoint folder")
    return load_model({"name": p.name, "source": "local", "path": str(p)}, None, "float32", device)


def add_common_args(ap: argparse.ArgumentParser) -> None:
    """The flags every corpus-pass benchmark shares (model, N, T, batch, device, threads)."""
    ap.add_argument("--model", default="gpt2-small-random",
                    help="gpt2-small-random, mini-gpt2-random, or a checkpoint folder (e.g. a mini-suite step)")
    ap.add_argument("--n-tracked", type=int, default=1000)
    ap.add_argument("--context-length", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--batches", type=int, default=6,
                    help="timed batches (after one warm-up batch); a multiple of 3 puts each timed form in each place "
                         "of the rotating order equally often")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--default-allocator", action="store_true",
                    help="leave glibc's malloc at its defaults (by default the benchmark sets it as the workflow's jobs "
                         "do, mfpipe.workflow.heap.keep_freed_memory, before any form runs: every form, the bare forward "
                         "included, runs without paging freed activations back in batch after batch)")


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def interleaved_times(batches, forms, sync=lambda: None, after_warmup=None, faults: dict | None = None) -> dict:
    """Wall time of each form ``name -> fn(batch)`` summed over ``batches[1:]`` (``batches[0]`` is the warm-up), the
    forms run batch by batch on the same batch so that a slow spell of the machine hits them alike. Their order is
    rotated from batch to batch: in the fixed order (bare, capture, stats) the no-op capture read slower than the
    bare forward, while rotated over the same batches the two measured alike (benchmarks/HISTORY.md); a fixed order charges any such effect of a form's place to the same form every time. With a number of timed
    batches that is a multiple of the number of forms, each form runs in each place equally often. ``after_warmup()`` is called once the warm-up batch is done.
    ``faults``, where given, gets each form's minor page faults over the timed batches (the process's: a helper
    thread's count too)."""
    forms = list(forms.items())
    times = dict.fromkeys((name for name, _ in forms), 0.0)
    if faults is not None:
        faults.update(dict.fromkeys(times, 0))
    for i, batch in enumerate(batches):
        k = i % len(forms)
        for name, fn in forms[k:] + forms[:k]:
            sync()
            f0 = minor_faults()
            t0 = time.perf_counter()
            fn(batch)
            sync()
            if i > 0:
                times[name] += time.perf_counter() - t0
                if faults is not None:
                    faults[name] += minor_faults() - f0
        if i == 0 and after_warmup is not None:
            after_warmup()
    return times


def split_batches(toks: np.ndarray, batch_size: int, n_batches: int, tracked) -> tuple[list[np.ndarray], float]:
    """The timed batches of ``toks`` and the share of their query positions (1..T-1) whose type is tracked."""
    batches = [toks[i * batch_size : (i + 1) * batch_size] for i in range(n_batches)]
    return batches, float(np.isin(toks[:, 1:], tracked.type_ids).mean())


def bare_peaks(bare, batch, dev, sync) -> tuple[float, float | None]:
    """Peak RSS (MiB) after the model and one bare forward of ``batch``, and on CUDA the bare forward's own peak of
    allocated device memory (MiB; None elsewhere), the device's peak counter reset afterwards."""
    import torch

    bare(batch)
    rss = peak_rss_mb()
    if dev.type != "cuda":
        return rss, None
    torch.cuda.reset_peak_memory_stats()
    bare(batch)
    sync()
    peak = torch.cuda.max_memory_allocated() / 2**20
    torch.cuda.reset_peak_memory_stats()
    return rss, peak


def device_sync(dev):
    """A function that waits for the device's queued work (a no-op on CPU), for timings that end where work does."""
    import torch

    return torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)


def setup_model(args):
    """(device, model, adapter, vocabulary size, BOS id) for :func:`add_common_args`' flags; sets torch's threads and
    (unless --default-allocator) the C allocator as the workflow's jobs do."""
    from mfpipe.models.adapters import get_adapter
    from mfpipe.workflow.heap import keep_freed_memory

    args.allocator = "glibc defaults" if args.default_allocator else (
        "keeps freed memory" if keep_freed_memory() else "defaults (not glibc)")

    if args.threads:
        torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    model = build_model(args.model, args.device)
    V = model.config.vocab_size
    bos = model.config.bos_token_id if model.config.bos_token_id is not None else V - 1
    return dev, model, get_adapter(model), V, bos


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap)
    ap.add_argument("--shard", default=None, help="a corpus shard .npz to take windows from")
    ap.add_argument("--no-partial", action="store_true", help="skip writing / reading the partial")
    ap.add_argument("--save-partial", default=None, help="write the partial (a .zarr folder) here (default: a temp folder)")
    ap.add_argument("--merge", type=int, default=0, metavar="K",
                    help="also merge K copies of the partial into a statistics store the way the workflow's merge does "
                         "(layer by layer), in a fresh process, and print its time and peak RSS")
    ap.add_argument("--full-shard-windows", type=int, default=0, metavar="W",
                    help="also estimate the partial of a full shard of W windows: its model-free counts measured on W "
                         "windows, its float sums synthetic (random float32 / float64 values on exactly the cells and "
                         "buckets those windows reach), written as a partial whose size on disk is printed")
    ap.add_argument("--shard-windows", type=int, default=0, metavar="W",
                    help="also print the ratio for one shard of W windows as the workflow's stats job runs it (the "
                         "presets: 1024 at T = 512; the default config: 4096 at T = 64): the timed batches' mean time "
                         "per batch times W / batch, plus the once-per-shard costs measured here, sums() and the "
                         "partial's write (the larger of this run's own write and the --full-shard-windows estimate's "
                         "when that has W windows, else this run's own, of a smaller partial; none with --no-partial), "
                         "against W / batch bare forwards")
    ap.add_argument("--mantissa-bits", type=int, default=None, metavar="K",
                    help="write the partials rounded to K mantissa bits (the workflow's stats.partial_mantissa_bits; "
                         "the presets use 11); default: exact")
    ap.add_argument("--breakdown", action="store_true",
                    help="also print where the statistics pass's own time goes (CPU time of the reducer's stages: the "
                         "model-free plan, per layer the kernel and the per-position sums, the final residual, the "
                         "kernel's once-per-batch add), per timed batch")
    ap.add_argument("--helper", choices=("auto", "on", "off"), default="auto",
                    help="the reducer's helper thread (pass 1 splits each large layer's reduction between two threads; auto: "
                         "on CPU with >= 2 torch threads, as in the workflow)")
    ap.add_argument("--engine", choices=("auto", "native", "torch"), default="auto",
                    help="pass 1's engine (Accumulator(engine=)): compiled loops on CPU (native, the default there) or torch ops")
    ap.add_argument("--job-rss", action="store_true",
                    help="also measure peak RSS as the workflow's jobs see it: the bare forward over these batches and "
                         "the stats job over them (mfpipe.stats.shards.accumulate_shard, sums() and, unless "
                         "--no-partial, the partial's write), each alone in a fresh process (the in-process peak above "
                         "follows bare, capture and stats forms that share one heap)")
    ap.add_argument("--merge-only", nargs="+", default=None, help=argparse.SUPPRESS)  # the --merge child process
    ap.add_argument("--rss-job", choices=("bare", "stats"), default=None, help=argparse.SUPPRESS)  # --job-rss child
    args = ap.parse_args(argv)
    if args.merge_only:
        return merge_only(args.merge_only)
    if args.rss_job:
        return rss_job(args)
    if args.shard and args.full_shard_windows:
        ap.error("--full-shard-windows samples Zipf windows over the benchmark's own vocabulary ranking: leave out --shard")
    # the jobs run before this process builds its own model and sums (at N = 4000 they would sit in memory twice)
    job_rss = job_rss_line(argv if argv is not None else sys.argv[1:]) if args.job_rss else None
    from mfpipe.stats.buckets import bucket_luts, window_buckets
    from mfpipe.stats.pass1 import HELPER_MIN_PROBS

    dev, model, adapter, V, bos = setup_model(args)
    B, nb = args.batch_size, args.batches + 1
    toks, tracked, perm, bos = benchmark_batches(args, V, bos)
    T = toks.shape[1]
    key_lut, query_lut, n, _ = bucket_luts(tracked)
    batches, cover = split_batches(toks, B, nb, tracked)
    sync = device_sync(dev)

    def bare(ids):
        with torch.no_grad():
            model.base_model(ids, use_cache=False)

    def noop(ids):  # the fields the statistics pass reads (acc.select, set below), no reduction
        adapter.run(ids, select=acc.select, on_layer=lambda c: None, on_final=lambda x: None)

    # baseline memory: model + one bare forward
    ids0 = torch.as_tensor(batches[0].astype(np.int64), device=dev)
    bare(ids0)
    gc.collect()
    rss_bare_peak = peak_rss_mb()
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        bare(ids0)
        sync()
        cuda_bare = torch.cuda.max_memory_allocated() / 2**20
        torch.cuda.reset_peak_memory_stats()

    acc = make_accumulator(args, adapter, n, T, dev)
    tensors = [t for obj in (acc, acc._totals) for v in vars(obj).values()  # the sums live in acc._totals
               for t in (v.values() if isinstance(v, dict) else [v])]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()  # views counted once
                for t in tensors if isinstance(t, torch.Tensor)}
    acc_mb = sum(storages.values()) / 2**20
    del tensors  # no reference may outlive `del acc` below (N = 4000: 11 GB of accumulators)

    stages = instrument(acc) if args.breakdown else None

    def stats(ids, chunk):
        kb, qt = window_buckets(chunk, key_lut, query_lut, n)
        acc.begin_batch(kb, qt)
        adapter.run(ids, select=acc.select, on_layer=acc.on_layer, on_final=acc.on_final)  # as the shard loop
        acc.end_batch()

    pairs = [(torch.as_tensor(chunk.astype(np.int64), device=dev), chunk) for chunk in batches]
    faults = {}
    times = interleaved_times(pairs, {"bare": lambda p: bare(p[0]), "capture": lambda p: noop(p[0]),
                                      "stats": lambda p: stats(*p)}, sync, faults=faults,
                              after_warmup=(lambda: stages.update(dict.fromkeys(stages, 0.0))) if stages is not None else None)
    sync()
    t0 = time.perf_counter()
    sums = acc.sums()
    t_sums = time.perf_counter() - t0
    times["stats"] += t_sums  # the final flush + copy to host belongs to the stats pass
    ntok = args.batches * B * T
    part_mb = sum(np.asarray(v).nbytes for v in sums.values()) / 2**20
    row = sums["P_sum"].sum(-1) / np.maximum(sums["query_count"], 1)[None, None, :]  # rows sum to (#batches)
    print(f"model {args.model} ({adapter.model_type}, L={adapter.n_layers}, H={adapter.n_heads}, d={adapter.d_model}); "
          f"device {dev}; torch threads {torch.get_num_threads()}; pass 1 engine {acc.engine}; C allocator {args.allocator}")
    print(f"N={n} tracked (position coverage {cover:.3f}), T={T}, batch {B}, {args.batches} timed batches = {ntok} tokens")
    for name in ("bare", "capture", "stats"):
        print(f"  {name:8s} {ntok / times[name]:10.1f} tok/s   ({times[name]:.2f} s, {times[name] / times['bare']:.3f}x bare; "
              f"{faults[name] / args.batches:.0f} minor page faults per batch)")
    print(f"  ratio stats / bare forward: {times['stats'] / times['bare']:.3f}  (issue 13 goals: <= 1.15 GPT-2 small N=1000 T=512, <= 1.5 mini models T=64)")
    print(f"  of which the once-per-shard sums(): {t_sums:.2f} s (value sums from the ln1(x) sums, device->host copy)")
    # the workflow runs a shard's hundreds of batches and then sums() and the write once: per batch, the steady state
    per_batch = {name: times[name] / args.batches for name in times}
    per_batch["stats"] -= t_sums / args.batches
    print(f"  per batch without the once-per-shard sums(): stats / bare forward {per_batch['stats'] / per_batch['bare']:.3f}")
    if stages is not None:
        per = {k: v / args.batches * 1e3 for k, v in stages.items()}
        wall = per.pop("wall")
        L, bare_ms = adapter.n_layers, times["bare"] / args.batches * 1e3
        print(f"  reducer CPU time per batch (ms; thread time of its threads, excludes the forward): plan {per['plan']:.1f}, "
              f"kernel {per['kernel']:.1f} ({per['kernel'] / L:.2f}/layer), per-position sums {per['positions']:.1f} "
              f"({per['positions'] / L:.2f}/layer), final residual {per['final']:.1f}, kernel add {per['flush']:.1f}; "
              f"total {sum(per.values()):.1f} = {sum(per.values()) / bare_ms:.3f} of a bare forward's wall time; "
              f"wall time in the reducer {wall:.1f} = {wall / bare_ms:.3f} "
              f"({'with' if acc._helper is not None and B * adapter.n_heads * T * T >= HELPER_MIN_PROBS else 'without'} "
              "the helper thread)")
    peak = peak_rss_mb()
    print(f"memory: accumulators {acc_mb:.0f} MiB on {dev}; sums in memory {part_mb:.0f} MiB; peak RSS bare forward "
          f"(model + bare forward) {rss_bare_peak:.0f} MiB, stats pass {peak:.0f} MiB (+{peak - rss_bare_peak:.0f} MiB, "
          "goal <= +1536)")
    if dev.type == "cuda":
        print(f"CUDA peak: bare forward {cuda_bare:.0f} MiB, stats pass {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB")
    if job_rss:
        print(job_rss)
    import shutil
    import tempfile

    from mfpipe.stats.partials import load_partial, partial_size, save_partial

    tmpdir = None
    if args.no_partial:
        print_shard_ratio(args, per_batch, t_sums, None, "not measured: --no-partial")
        print(f"check: max |row sum of P - 1| = {np.abs(row[:, :, sums['query_count'] > 0] - 1.0).max():.2e}")
        return
    if args.save_partial:
        ppath = Path(args.save_partial)
    else:
        tmpdir = tempfile.mkdtemp(prefix="stats-bench-")
        ppath = Path(tmpdir) / "shard-0.zarr"
    ok = np.abs(row[:, :, sums["query_count"] > 0] - 1.0).max()
    try:
        t0 = time.perf_counter()
        save_partial(ppath, sums, {"benchmark": True}, mantissa_bits=args.mantissa_bits)
        t_save = time.perf_counter() - t0
        peak_write = peak_rss_mb()  # the stats job's peak: it ends with this write (the estimate below is not the job)
        t_write, write_of = t_save, f"this run's partial of {args.batches + 1} batches, smaller than a full shard's"
        if args.full_shard_windows:
            t_full = full_shard_estimate(args, acc, toks, bos, V, perm, key_lut, query_lut, n, Path(ppath).parent)
            if args.full_shard_windows == args.shard_windows:
                # the job writes once, in a process that has not written before: this run's first write (imports,
                # compressor start-up) took twice the estimate's second one, so the larger of the two is counted
                t_write, write_of = max(t_save, t_full), "the larger of this run's first write and the full-shard estimate's"
        print_shard_ratio(args, per_batch, t_sums, t_write, write_of)
        del sums, acc  # the read-back below must not hold two copies (N = 4000: 9 GB each)
        gc.collect()
        t0 = time.perf_counter()
        load_partial(ppath)
        t_load = time.perf_counter() - t0
        print(f"partial: {partial_size(ppath) / 2**20:.1f} MiB on disk ({ppath.name}, compressed Zarr, "
              f"{bits_label(args.mantissa_bits)}), write {t_save:.1f} s, "
              f"read {t_load:.1f} s; peak RSS up to the write {peak_write:.0f} MiB (+{peak_write - rss_bare_peak:.0f} MiB over "
              f"the bare forward), after reading it back {peak_rss_mb():.0f} MiB")
        if args.merge:
            import subprocess

            out = subprocess.run([sys.executable, __file__, "--merge-only", *[str(ppath)] * args.merge], check=False,
                                 capture_output=True, text=True)
            print(out.stdout.strip() or out.stderr[-3000:])
    finally:
        if tmpdir:
            shutil.rmtree(tmpdir, ignore_errors=True)
    print(f"check: max |row sum of P - 1| = {ok:.2e}")


def instrument(acc) -> dict:
    """Wrap the reducer's stages with thread-CPU-time counters (a dict filled as batches run): ``plan``
    (begin_batch), ``kernel`` (the kernel sums of the layers' heads and their copy into the batch's sums), ``positions`` (the per-position sums, ln1(x)
    included), ``final`` (on_final), ``flush`` (end_batch: the batch's kernel sums into P), on whichever thread runs
    them (the reducer's own thread or its helper thread: their sum is the reducer's CPU cost); and ``wall``, the wall
    time spent in the reducer's callbacks (with the helper thread, less than the CPU time)."""
    import threading

    stages = {"plan": 0.0, "kernel": 0.0, "positions": 0.0, "final": 0.0, "flush": 0.0, "wall": 0.0}
    lock = threading.Lock()  # the reducer's two threads add to the same counters

    def timed(fn, name, wall=False):
        def run(*a, **k):
            t0, w0 = time.thread_time(), time.perf_counter()
            out = fn(*a, **k)
            with lock:
                stages[name] += time.thread_time() - t0
                if wall:
                    stages["wall"] += time.perf_counter() - w0
            return out
        return run

    def walled(fn):
        def run(*a, **k):
            w0 = time.perf_counter()
            out = fn(*a, **k)
            stages["wall"] += time.perf_counter() - w0
            return out
        return run

    eng = acc._engine  # mfpipe.stats.engine.Engine: the accumulator calls these through its instance attributes
    eng.kernel_heads = timed(eng.kernel_heads, "kernel")
    eng.kernel_flush = timed(eng.kernel_flush, "kernel")
    acc._position_sums = timed(acc._position_sums, "positions")
    acc.begin_batch = timed(acc.begin_batch, "plan", wall=True)
    acc.on_layer = walled(acc.on_layer)
    acc.on_final = timed(acc.on_final, "final", wall=True)
    acc.end_batch = timed(acc.end_batch, "flush", wall=True)
    return stages


def make_accumulator(args, adapter, n: int, T: int, device, lazy_derived: bool = False):
    """Pass 1's reducer as the workflow builds it for ``adapter``, with this run's ``--engine`` / ``--helper``
    (``lazy_derived``: as the stats job builds it, its derived sums made a layer at a time as its partial is
    written)."""
    from mfpipe.stats.pass1 import Accumulator

    return Accumulator(adapter.n_layers, adapter.n_heads, adapter.d_model, adapter.d_head, n, T, device=device,
                       attn_input_norm=adapter.attn_input_norm, value_weights=adapter.value_weights,
                       attn_input_norm_form=adapter.attn_input_norm_form, attn_out_weights=adapter.attn_out_weights,
                       mlp_out_from_resid=adapter.mlp_out_from_resid,
                       helper_thread={"auto": None, "on": True, "off": False}[args.helper], engine=args.engine,
                       lazy_derived=lazy_derived)


def benchmark_batches(args, V: int, bos: int):
    """(windows [n, T], tracked set, perm or None, BOS id) of the benchmark: ``--batches`` + 1 batches from
    ``--shard`` (its BOS) or Zipf tokens (the same in every process: the generator is seeded)."""
    nb = args.batches + 1
    if args.shard:
        toks = np.load(args.shard)["tokens"][: nb * args.batch_size]
        if toks.shape[0] < nb * args.batch_size:
            sys.exit(f"--shard has {toks.shape[0]} windows, need {nb * args.batch_size}")
        perm = None
    else:
        toks, perm = zipf_windows(V, nb * args.batch_size, args.context_length, bos)
    bos = int(toks[0, 0]) if args.shard else bos
    return toks, benchmark_tracked(toks, V, bos, args.n_tracked, perm), perm, bos


def rss_job(args) -> None:
    """The --job-rss child: one form alone in this process, as a workflow job runs it; prints its peak RSS."""
    import shutil
    import tempfile

    dev, model, adapter, V, bos = setup_model(args)
    toks, tracked, _, _ = benchmark_batches(args, V, bos)
    if args.rss_job == "bare":
        with torch.no_grad():
            for i in range(0, toks.shape[0], args.batch_size):
                model.base_model(torch.as_tensor(toks[i : i + args.batch_size].astype(np.int64), device=dev),
                                 use_cache=False)
    else:
        from mfpipe.stats.partials import save_partial
        from mfpipe.stats.shards import accumulate_shard

        sums = accumulate_shard(model, adapter, toks, tracked, batch_size=args.batch_size, device=dev, progress=False,
                                reducer=lambda ad, n, T, device: make_accumulator(args, ad, n, T, device,
                                                                                  lazy_derived=not args.no_partial))
        if not args.no_partial:
            tmp = tempfile.mkdtemp(prefix="stats-bench-job-")
            try:
                save_partial(Path(tmp) / "shard-0.zarr", sums, {"benchmark": True}, mantissa_bits=args.mantissa_bits)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    print(f"peak_rss_mb={peak_rss_mb():.1f}")


def job_rss_line(argv: list[str]) -> str:
    """Run the bare forward and the stats job each in a fresh process (:func:`rss_job`); the line with their peak
    RSS."""
    import subprocess

    keep = [a for a in argv if a not in ("--job-rss", "--breakdown")]
    peaks = {}
    for form in ("bare", "stats"):
        out = subprocess.run([sys.executable, __file__, *keep, "--rss-job", form], check=False, capture_output=True,
                             text=True)
        lines = [ln for ln in out.stdout.splitlines() if ln.startswith("peak_rss_mb=")]
        if out.returncode or not lines:
            return f"job peak RSS: the {form} process failed (exit {out.returncode}):\n{out.stderr[-3000:]}"
        peaks[form] = float(lines[-1].split("=")[1])
    what = "sums() and the partial's write" if "--no-partial" not in keep else "sums(), no partial"
    return (f"job peak RSS, each form alone in a fresh process: bare forward {peaks['bare']:.0f} MiB, stats job "
            f"(accumulate_shard, {what}) {peaks['stats']:.0f} MiB (+{peaks['stats'] - peaks['bare']:.0f} MiB, "
            "goal <= +1536)")


def merge_only(paths: list[str]) -> None:
    """The workflow's merge (mfpipe.stats.merge.merge_half without the corpus checks): partials opened with the
    kernel sums on disk, merged by addition, P written one layer at a time (mfpipe.stats.store.write_stats)."""
    import shutil
    import tempfile

    from mfpipe.stats.partials import merge_sums, open_partial
    from mfpipe.stats.store import write_stats

    t0 = time.perf_counter()
    sums = merge_sums((open_partial(p)[0] for p in paths), names=paths)
    N = np.shape(sums["P_sum"])[2]
    tracked = {"key_lut": np.arange(N + 2), "query_lut": np.arange(N + 2), "n": N}
    tmp = tempfile.mkdtemp(prefix="stats-merge-bench-")
    try:
        write_stats(sums, tracked, {"benchmark": True}, Path(tmp) / "stats.zarr")
        dt = time.perf_counter() - t0
        size = sum(f.stat().st_size for f in Path(tmp).rglob("*") if f.is_file())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"merge of {len(paths)} partials into a store (layer by layer): {dt:.1f} s, store {size / 2**20:.0f} MiB, "
          f"peak RSS of the merge process {peak_rss_mb():.0f} MiB")


def bits_label(bits: int | None) -> str:
    return "exact" if bits is None else f"{bits} mantissa bits"


def full_shard_estimate(args, acc, toks, bos, V, perm, key_lut, query_lut, n, folder: Path) -> None:
    """Size on disk of the partial of a full shard (``--full-shard-windows`` windows): the model-free counts of that
    many Zipf windows (real), and every float sum synthetic at exactly the support those windows give (P_sum: random
    float32 of a realistic dynamic range in every (query type, key bucket) cell some pair reaches, per-position sums:
    random in every bucket that occurs), so that the compressor sees as many incompressible values as a real
    shard's partial holds."""
    from mfpipe.stats.buckets import window_buckets
    from mfpipe.stats.partials import partial_size, save_partial
    from mfpipe.stats.pass1 import Accumulator

    W, T, B = args.full_shard_windows, toks.shape[1], 16
    rng = np.random.default_rng(1)
    p = 1.0 / np.arange(1, V + 1) ** 1.0
    p /= p.sum()
    counts = Accumulator(1, 1, 1, 1, n, T)  # model-free counts only: begin_batch, never a layer
    for i in range(0, W, B):
        w = perm[rng.choice(V, size=(min(B, W - i), T), p=p)]
        w[:, 0] = bos
        kb, qt = window_buckets(w, key_lut, query_lut, n)
        counts.begin_batch(kb, qt)
    sums = acc.sums()
    fake = {k: np.asarray(v) for k, v in sums.items()}
    model_free = counts.sums()
    for k in ("n_windows", "n_tokens", "query_count", "key_count", "position_count", "nbar_sum", "context_count",
              "cooc"):
        fake[k] = model_free[k]
    N, K = n, n + 2
    support = fake["nbar_sum"] > 0
    L, H = fake["P_sum"].shape[:2]
    fake["P_sum"] = np.zeros((L, H, N, K), dtype=np.float32)
    # a real kernel sum's dynamic range: about what uniform attention would give (the cell's expected key count
    # over half the window), times a log-normal head-and-cell factor (1.4e-6 .. 1.4e6 over GPT-2's 12 layers at
    # N = 1000; a uniform [0, 1) fake has a 2-bit exponent and understates the compressed size by ~6 %)
    nb = fake["nbar_sum"][support].astype(np.float64) / (T / 2)
    for l in range(L):
        fake["P_sum"][l][:, support] = nb * np.exp(rng.normal(0.0, 1.5, size=(H, nb.size)))
    seen = fake["key_count"] > 0
    for k, v in sums.items():
        if k in fake and k not in ("P_sum",) and np.issubdtype(np.asarray(v).dtype, np.floating) and np.ndim(v) >= 3:
            a = np.zeros(np.shape(v), dtype=np.asarray(v).dtype)
            idx = [slice(None)] * a.ndim
            idx[-2] = seen  # the key axis of every per-position sum
            a[tuple(idx)] = rng.standard_normal(a[tuple(idx)].shape)
            fake[k] = a
    path = folder / "full-shard-estimate.zarr"
    t0 = time.perf_counter()
    save_partial(path, fake, {"benchmark": "synthetic full shard"}, mantissa_bits=args.mantissa_bits)
    t_write = time.perf_counter() - t0
    print(f"full-shard estimate ({W} windows x T={T}, {W * T} tokens): {support.mean():.3f} of the N x K kernel cells "
          f"reached, {seen.mean():.3f} of the buckets; synthetic partial {partial_size(path) / 2**20:.1f} MiB on disk "
          f"({bits_label(args.mantissa_bits)}), write {t_write:.1f} s")
    del fake
    return t_write


def print_shard_ratio(args, per_batch: dict, t_sums: float, t_write: float | None, write_of: str) -> None:
    """``--shard-windows``: the stats job's cost for one shard against the bare forwards of its batches (see the
    flag's help)."""
    W, B = args.shard_windows, args.batch_size
    if not W:
        return
    nb = W / B
    once = t_sums + (t_write or 0.0)
    ratio = (nb * per_batch["stats"] + once) / (nb * per_batch["bare"])
    write = f"the partial's write {t_write:.1f} s ({write_of})" if t_write is not None else f"the partial's write {write_of}"
    print(f"  one shard of {W} windows ({nb:.0f} batches): stats / bare forward {ratio:.3f} (per batch {per_batch['stats']:.3f} s "
          f"vs {per_batch['bare']:.3f} s, once per shard: sums() {t_sums:.2f} s, {write})")


if __name__ == "__main__":
    main()
