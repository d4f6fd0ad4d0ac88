#!/usr/bin/env python
"""Benchmark: pass 2 (the deviation reducer, issue 11) against a bare forward pass, on the same batches, in one run.

Prints tokens/s and ratios to (a) the bare forward (the model body, eager attention, no LM head: the baseline of
benchmarks/stats_pass.py) of (b) the traced forward that captures what pass 2 reads (probabilities, values, reads)
with a no-op callback (tracing overhead alone) and (c) pass 2 itself: the shard loop
(:func:`mfpipe.stats.loop.run_reducer`) with the :class:`~mfpipe.deviation.pass2.DeviationAccumulator`, per
batch (goal: (c) <= 1.5x (a), issue 11); the once-per-shard copy of the sums to the host is timed and counted in
(c). Then peak memory (process RSS; CUDA peak on a GPU). The three are interleaved batch by batch. On CPU the
pass-2 reductions run as in the workflow (``--reducer-threads auto``: on the forward's threads where a layer's
attention is large, as at GPT-2 small's shape, else on one), the forwards on torch's setting (``--threads``).

    PYTHONPATH=src python benchmarks/deviation_pass.py --model gpt2-small-random --n-tracked 1000 --context-length 512 \
        --batch-size 4 --batches 4 --device cpu
    PYTHONPATH=src python benchmarks/deviation_pass.py --profile   # + torch.profiler table of one pass-2 batch

The kernel W and the mean values μ are random, as in benchmarks/substitution.py (timing does not depend on their
values; a dense positive W makes every tracked query a valid context, the most work a batch can give); tokens
Zipf-distributed, the tracked set their top-N types (about two thirds of positions tracked at N = 1000); every
window its own document, so the two halves alternate.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stats_pass import add_common_args, bare_peaks, benchmark_tracked, device_sync, interleaved_times, peak_rss_mb, setup_model, split_batches, zipf_windows  # noqa: E402
from substitution import random_kernel  # noqa: E402


class OneBatch:
    """Reducer for :func:`run_reducer` that feeds a long-lived accumulator: the shard loop runs one batch per
    call (so the three timings interleave) and the shard's single ``sums()`` is left to the end of the run."""

    def __init__(self, acc):
        self.acc = acc
        self.select = acc.select
        self.on_final = acc.on_final  # None: the forward stops after the last layer (Adapter.run)

    def __call__(self, adapter, n, T, device):  # the reducer factory of accumulate_shard
        return self

    def begin_batch(self, kb, qt):
        self.acc.begin_batch(kb, qt)

    def on_layer(self, cap):
        self.acc.on_layer(cap)

    def end_batch(self):
        self.acc.end_batch()

    def sums(self):
        return {}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap)
    ap.add_argument("--reducer-threads", default="auto",
                    help="torch threads of the pass-2 reductions on CPU (DeviationAccumulator's cpu_threads; default "
                         "auto as in the workflow: the forward's setting from THREADED_MIN_PROBS attention elements a "
                         "layer, else 1; 0: the forward's setting)")
    ap.add_argument("--engine", default="auto", choices=("auto", "native", "torch"),
                    help="the mixed weights' engine (DeviationAccumulator's engine; auto: the compiled loop on CPU)")
    ap.add_argument("--profile", action="store_true",
                    help="after the timing, profile one more pass-2 batch (torch.profiler) and print its top ops")
    args = ap.parse_args(argv)
    from mfpipe.deviation.pass2 import DeviationAccumulator, window_halves
    from mfpipe.meanfield.deviation import layer_grams
    from mfpipe.stats.loop import run_reducer

    dev, model, adapter, V, bos = setup_model(args)
    B, T, nb = args.batch_size, args.context_length, args.batches + 1 + int(args.profile)
    toks, perm = zipf_windows(V, nb * B, T, bos)
    tracked = benchmark_tracked(toks, V, bos, args.n_tracked, perm)
    L, H = adapter.n_layers, adapter.n_heads
    # as deviation_shard does: the kernel on the model's device (whole when it fits), grams, halves of the shard
    kernel = random_kernel(adapter, tracked, dev)
    n = kernel.n
    doc_ids = np.repeat(np.arange(nb * B)[:, None], T, axis=1)  # one document per window
    acc = DeviationAccumulator(kernel.W, kernel.mu, layer_grams(adapter), n, T, window_halves(doc_ids), dev,
                               cpu_threads="auto" if args.reducer_threads == "auto" else (int(args.reducer_threads) or None),
                               engine=args.engine)
    shim = OneBatch(acc)
    batches, cover = split_batches(toks, B, nb, tracked)
    sync = device_sync(dev)

    def bare(chunk):
        with torch.no_grad():
            model.base_model(torch.as_tensor(chunk.astype(np.int64), device=dev), use_cache=False)

    def capture(chunk):
        adapter.run(torch.as_tensor(chunk.astype(np.int64), device=dev), select=acc.select, on_layer=lambda c: None)

    def pass2(chunk):
        with torch.no_grad():
            run_reducer(model, adapter, chunk, tracked, shim, batch_size=B, device=dev, progress=False)

    rss_bare, cuda_bare = bare_peaks(bare, batches[0], dev, sync)
    times = interleaved_times(batches[: args.batches + 1], {"bare": bare, "capture": capture, "pass2": pass2}, sync)
    t0 = time.perf_counter()
    sums = acc.sums()
    t_sums = time.perf_counter() - t0
    acc.close()  # its helper thread (the shim leaves the accumulator open from batch to batch)
    times["pass2"] += t_sums
    ntok = args.batches * B * T
    print(f"model {args.model} ({adapter.model_type}, L={L}, H={H}, d={adapter.d_model}); device {dev}; "
          f"torch threads {torch.get_num_threads()} (pass-2 reductions: {acc.cpu_threads or torch.get_num_threads()}, "
          f"engine {acc.engine}); "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')}")
    print(f"N={n} tracked (position coverage {cover:.3f}), T={T}, batch {B}, {args.batches} timed batches = {ntok} tokens")
    for name in times:
        print(f"  {name:8s} {ntok / times[name]:10.1f} tok/s   {1e6 * times[name] / ntok:8.1f} us/token   "
              f"({times[name]:.2f} s, {times[name] / times['bare']:.3f}x bare)")
    print(f"  ratio pass 2 / bare forward: {times['pass2'] / times['bare']:.3f}  (goal <= 1.2, issue 31)")
    print(f"  of which the once-per-shard device->host copy of the sums: {t_sums:.2f} s")
    print(f"memory: peak RSS after model + bare forward {rss_bare:.0f} MiB, peak RSS overall {peak_rss_mb():.0f} MiB "
          f"(kernel W {kernel.W.numel() * kernel.W.element_size() / 2**20:.0f} MiB)")
    if dev.type == "cuda":
        print(f"CUDA peak: bare forward {cuda_bare:.0f} MiB, pass 2 {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB")
    c = sums["count"].sum()
    print(f"check: {c} valid contexts x heads; mean D {sums['D_sum'].sum() / max(c * H, 1):.4f}, "
          f"max |M_cov + M_ctx - D| summed {np.abs(sums['M_cov_sum'] + sums['M_ctx_sum'] - sums['D_sum']).max():.2e}")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        with profile(activities=acts) as prof:
            pass2(batches[-1])
            sync()
        key = "self_cuda_time_total" if dev.type == "cuda" else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=key, row_limit=30))


if __name__ == "__main__":
    main()
