#!/usr/bin/env python
"""Benchmark: the J-lens estimate (`mfpipe.jlens.lens.estimate_jlens`, rule `jlens`) with each backward pass through the
sampled token alone (its prefix held as the model's key/value cache, the default) against each window run whole
(`prefix_cache=False`, what the J-lens did before), on the same sampled positions, and how far the two estimates
are apart.

    PYTHONPATH=src python benchmarks/jlens.py --model gpt2-small-random --context-length 512 --positions 4 \
        --batch-size 4 --device cpu
    PYTHONPATH=src python benchmarks/jlens.py --model mini-gpt2-random --context-length 64 --positions 256 --batch-size 32

Both forms are timed alternately, ``--repeats`` times each; the script prints each time, the medians and their
ratio, and a cost estimate per position. Tokens are Zipf-distributed windows as in the corpus-pass benchmarks.

``--rows K`` times the first K of the d output dimensions only (K backward passes a position instead of d, through
``position_jacobians(..., rows=K)`` in the estimate's batches): whole windows at GPT-2 small's shape and T = 1024
take about half an hour a position on two CPU cores, so the issue-49 ratio is measured on a share of the passes.
Both forms do the same K passes; each also pays its forward (the cached form its prefix's), which weighs more
against K passes than against d, so the ratio at K understates the ratio at d:

    PYTHONPATH=src python benchmarks/jlens.py --model gpt2-small-random --context-length 1024 --positions 2 \
        --batch-size 2 --rows 64 --device cpu

``--decode N`` also times the J-lens decode through Jacobian-vector products (`mfpipe.jlens.jvp`, issue 58: what the
lenses run with ``jlens.decode: jvp``) of N vectors at the attention output of layers 0, 1, ... in turn, on the same
sampled positions, against the full J (the cached form: what ``jlens.decode: matrix`` reads), and how far ``J v``
of the two are apart (on the first K rows with ``--rows K``). The products cost one forward pass per vector and
position, the full J d backward passes per position: the ratio falls with N as ``d / (N x`` a product's cost in
backward passes``)``:

    PYTHONPATH=src python benchmarks/jlens.py --model gpt2-small-random --context-length 512 --positions 2 \
        --batch-size 2 --forms cached --decode 64 --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stats_pass import device_sync, setup_model, zipf_windows  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt2-small-random",
                    help="gpt2-small-random, mini-gpt2-random, or a checkpoint folder (e.g. a mini-suite step)")
    ap.add_argument("--context-length", type=int, default=512)
    ap.add_argument("--positions", type=int, default=4, help="sampled positions (the job's jlens.n_positions)")
    ap.add_argument("--windows", type=int, default=64, help="windows the positions are drawn from")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--grad-chunk", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--forms", nargs="+", choices=("cached", "whole"), default=["cached", "whole"],
                    help="the forms to time (whole windows take hours at GPT-2 small's shape on a CPU)")
    ap.add_argument("--rows", type=int, default=None, metavar="K",
                    help="time the first K output dimensions only (K backward passes a position instead of d)")
    ap.add_argument("--decode", type=int, default=0, metavar="N",
                    help="also time the decode of N vectors through Jacobian-vector products (jlens.decode: jvp)")
    ap.add_argument("--chunk", type=int, default=64, help="vectors per forward of the products (jlens.jvp_chunk)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--default-allocator", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    from mfpipe.jlens import lens as JL

    dev, _model, adapter, V, bos = setup_model(args)
    sync = device_sync(dev)
    windows, _ = zipf_windows(V, args.windows, args.context_length, bos, seed=0)
    print(f"model {args.model} ({adapter.model_type}, L={adapter.n_layers}, d={adapter.d_model}); device {dev}; "
          f"torch threads {torch.get_num_threads()}; T={args.context_length}, {args.positions} positions, batch "
          f"{args.batch_size}, grad_chunk {args.grad_chunk}")
    _, pos = JL.sample_positions(len(windows), args.context_length, args.positions, 0)
    print(f"sampled positions: mean {pos.mean():.0f}, max {pos.max()}")

    def estimate(prefix_cache: bool):
        sync()
        t0 = time.perf_counter()
        if args.rows:
            J = rows_only(adapter, windows, args, prefix_cache)
        else:
            J = JL.estimate_jlens(adapter, windows, n_positions=args.positions, seed=0, batch_size=args.batch_size,
                                  progress=False, grad_chunk=args.grad_chunk, prefix_cache=prefix_cache)["J"].values
        sync()
        return time.perf_counter() - t0, J

    times = {form: [] for form in args.forms}
    J = {}
    for _ in range(args.repeats):
        for form, flag in (("cached", True), ("whole", False)):
            if form not in times:
                continue
            t, J[form] = estimate(flag)
            times[form].append(t)
            print(f"  {form:7s} {t:8.2f} s")
    med = {k: statistics.median(v) for k, v in times.items()}
    if args.decode:
        decode(adapter, windows, args, J.get("cached"), med.get("cached"), sync)
    if len(med) < 2:
        (form, m), = med.items()
        print(f"median: {form} {m:.2f} s ({m / args.positions:.3f} s per position)")
        return
    print(f"median: prefix as a key/value cache {med['cached']:.2f} s, whole windows {med['whole']:.2f} s: "
          f"{med['whole'] / med['cached']:.1f}x faster ({med['cached'] / args.positions:.3f} s against "
          f"{med['whole'] / args.positions:.3f} s per position)")
    a, b = J["cached"][0], J["whole"][0]  # the block point, every layer
    if args.rows:
        a, b = a[..., : args.rows, :], b[..., : args.rows, :]
        print(f"({args.rows} of {adapter.d_model} output dimensions: each form's forward weighs more against "
              f"{args.rows} backward passes than against {adapter.d_model}, so the ratio at d is larger)")
    scale = float(np.abs(b).max())
    print(f"estimates apart by at most {float(np.abs(a - b).max()):.2e} (block point; largest entry {scale:.3g})")


def decode(adapter, windows, args, J, t_full, sync) -> None:
    """Time ``jvp_products`` of ``args.decode`` vectors (attention outputs of layers 0, 1, ... in turn) on the
    estimate's positions, ``args.repeats`` times; print its median, its ratio to the full J's and how far its J v is
    from the full J's J @ v (rows ``< args.rows`` where only those were estimated)."""
    from mfpipe.jlens.jvp import JLensSample, jvp_products

    n, L = args.decode, adapter.n_layers
    V = torch.randn(n, adapter.d_model, generator=torch.Generator().manual_seed(0))
    layers = np.arange(n) % L
    sample = JLensSample(windows, n_positions=args.positions, seed=0, batch_size=args.batch_size, chunk=args.chunk)
    times = []
    for _ in range(args.repeats):
        sync()
        t0 = time.perf_counter()
        Jv = jvp_products(adapter, sample, V, layers, "attn")
        sync()
        times.append(time.perf_counter() - t0)
        print(f"  jvp     {times[-1]:8.2f} s ({n} vectors)")
    med = statistics.median(times)
    line = f"median: decode of {n} vectors through Jacobian-vector products {med:.2f} s ({med / args.positions:.3f} s " \
           f"per position)"
    if t_full is not None:
        share = f" of {args.rows} rows" if args.rows else ""
        line += f"; the full J{share} (cached) {t_full:.2f} s: ratio full J / products {t_full / med:.2f}x"
    print(line)
    if J is not None:
        k = args.rows or adapter.d_model
        want = np.stack([J[1, l, :k] @ v for l, v in zip(layers, V.double().numpy())])
        got = Jv.cpu().numpy()[:, :k]
        print(f"products apart from the full J's J v by at most {float(np.abs(got - want).max()):.2e} "
              f"(largest entry {float(np.abs(want).max()):.3g})")


def rows_only(adapter, windows, args, prefix_cache: bool) -> np.ndarray:
    """The sum over the sampled positions of the first ``args.rows`` rows of each Jacobian block, in the estimate's
    batches (positions in order, ``args.batch_size`` at a time)."""
    from mfpipe.jlens import lens as JL
    from mfpipe.models.adapters.jacobian import position_jacobians

    win, pos = JL.sample_positions(len(windows), args.context_length, args.positions, 0)
    order = np.argsort(pos, kind="stable")
    total = 0.0
    for k in range(0, len(order), args.batch_size):
        sel = order[k: k + args.batch_size]
        total = total + position_jacobians(adapter, windows[win[sel]], torch.from_numpy(pos[sel]),
                                           grad_chunk=args.grad_chunk, prefix_cache=prefix_cache, rows=args.rows)
    return (total / len(pos)).numpy()


if __name__ == "__main__":
    main()
