#!/usr/bin/env python
"""Benchmark: the mean-field substitution forward against a bare forward, on the same batches, in one run.

Prints tokens/s and ratios to (a) the bare forward of the causal LM with its next-token loss, of
(b) the substitution forward (ẑ for every layer from the window's types + the forward with every head's read at
tracked query positions replaced, with its loss; goal <= 2x the bare forward, issue 10) and of (c) the whole
substitution job per batch (b + the clean forward that reads z for D_MF and L_model), and peak memory
(process RSS; CUDA peak on a GPU).

    python benchmarks/substitution.py --model gpt2-small-random --n-tracked 1000 --context-length 512 \
        --batch-size 4 --batches 4 --device cpu

The kernel W and the mean values are random (timing does not depend on their values); tokens Zipf-distributed,
the tracked set their top-N types (about two thirds of positions tracked at N = 1000).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stats_pass import add_common_args, bare_peaks, benchmark_tracked, device_sync, interleaved_times, peak_rss_mb, setup_model, split_batches, zipf_windows  # noqa: E402


def random_kernel(adapter, tracked, device):
    """A :class:`MeanFieldKernel` of random positive W and random μ for ``tracked`` on ``device`` (timing does not
    depend on their values; a dense positive W makes every tracked query a valid context: the most work)."""
    from mfpipe.meanfield.kernel import MeanFieldKernel
    from mfpipe.stats.buckets import bucket_luts

    key_lut, query_lut, n, _ = bucket_luts(tracked)
    L, H, dh = adapter.n_layers, adapter.n_heads, adapter.d_head
    g = torch.Generator().manual_seed(0)
    W = torch.rand(L, H, n, n + 2, generator=g) + 0.01
    mu = torch.randn(L, H, n + 2, dh, generator=g)
    return MeanFieldKernel(W, mu, key_lut, query_lut, n).to(device)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap)
    args = ap.parse_args(argv)
    from mfpipe.experiments.substitution.substitute import substitution_batch

    dev, model, adapter, V, bos = setup_model(args)
    B, T, nb = args.batch_size, args.context_length, args.batches + 1
    toks, perm = zipf_windows(V, nb * B, T, bos)
    tracked = benchmark_tracked(toks, V, bos, args.n_tracked, perm)
    kernel = random_kernel(adapter, tracked, dev)
    L, H, n = adapter.n_layers, adapter.n_heads, kernel.n
    batches, cover = split_batches(toks, B, nb, tracked)
    sync = device_sync(dev)

    def bare(chunk):  # the loss as transformers computes it (labels shifted, not the logits)
        ids = torch.as_tensor(chunk.astype(np.int64), device=dev)
        with torch.no_grad():
            lg = model(ids, use_cache=False).logits.float()
            targets = torch.nn.functional.pad(ids[:, 1:], (0, 1), value=-100)
            torch.nn.functional.cross_entropy(lg.view(-1, lg.shape[-1]), targets.reshape(-1))

    def substituted(chunk):  # ẑ + the patched forward with its loss
        kb, qt = kernel.buckets(chunk)
        zs, sub = kernel.zhat(kb, qt)
        sub = sub.to(dev)

        def patch(layer, reads):
            return torch.where(sub[:, :, None, None], zs[layer], reads)

        adapter.run(torch.as_tensor(chunk.astype(np.int64), device=dev), select=(), patch_reads=patch, loss=True)

    def job(chunk):  # what the workflow's substitution job does per batch
        substitution_batch(adapter, kernel, chunk)

    rss_bare, cuda_bare = bare_peaks(bare, batches[0], dev, sync)
    times = interleaved_times(batches, {"bare": bare, "substitution": substituted, "job": job}, sync)
    ntok = args.batches * B * T
    print(f"model {args.model} ({adapter.model_type}, L={L}, H={H}, d={adapter.d_model}); device {dev}; "
          f"torch threads {torch.get_num_threads()}")
    print(f"N={n} tracked (position coverage {cover:.3f}), T={T}, batch {B}, {args.batches} timed batches = {ntok} tokens")
    for name in times:
        print(f"  {name:12s} {ntok / times[name]:10.1f} tok/s   ({times[name]:.2f} s, {times[name] / times['bare']:.3f}x bare)")
    print(f"  ratio substitution forward / bare forward: {times['substitution'] / times['bare']:.3f}  (goal <= 2)")
    print(f"  ratio substitution job (clean + substituted forward) / bare forward: {times['job'] / times['bare']:.3f}"
          "  (goal <= 2.1, issue 31)")
    print(f"memory: peak RSS after model + bare forward {rss_bare:.0f} MiB, peak RSS overall {peak_rss_mb():.0f} MiB "
          f"(kernel W {kernel.W.numel() * kernel.W.element_size() / 2**20:.0f} MiB)")
    if dev.type == "cuda":
        print(f"CUDA peak: bare forward {cuda_bare:.0f} MiB, substitution {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
