#!/usr/bin/env python
"""Benchmark: function-vector head selection, MFA against AIE (issue 29; paper Sec. 6.4, App. fv-validations).

MFA selection reads every head at the cue in ONE forward per clean prompt (:func:`mfpipe.experiments.fv.heads.
cue_reads`; the corpus null is a table lookup). AIE (Todd et al.) runs a patched forward per head per corrupted
prompt (:func:`~mfpipe.experiments.fv.heads.aie`, batched over heads). Both through the adapter's read/patch site,
on the same prompts (few-shot prompts of random tokens, ``--shots`` exemplars ``x : y \\n``; timing does not depend
on the tokens). Prints prompt-forwards and wall time of each (median of ``--repeats`` runs, interleaved) and their
ratios.

    PYTHONPATH=src python benchmarks/function_vectors.py --model gpt2-small-random --clean 20 --corrupted 10 \
        --shots 10 --batch-size 64 --device cpu
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
from stats_pass import build_model  # noqa: E402


def prompts(n, shots, V, bos, seed):
    from mfpipe.experiments.fv.prompts import FVPrompt

    rng = np.random.default_rng(seed)
    sep, nl = 25, 198  # any two ids: ":" and "\n" stand-ins
    out = []
    for _ in range(n):
        toks = [bos]
        for _ in range(shots):
            toks += [int(rng.integers(300, V)), sep, int(rng.integers(300, V)), nl]
        toks += [int(rng.integers(300, V)), sep]
        out.append(FVPrompt(np.asarray(toks, np.int64), int(rng.integers(300, V)), 0))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt2-small-random", help="gpt2-small-random or mini-gpt2-random")
    ap.add_argument("--clean", type=int, default=20, help="clean prompts (MFA: one forward each)")
    ap.add_argument("--corrupted", type=int, default=10, help="corrupted prompts (AIE: L*H+1 forwards each)")
    ap.add_argument("--shots", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    from mfpipe.experiments.fv.heads import aie, cue_reads, head_norms, out_slices, task_deviation, top_heads
    from mfpipe.models.adapters import get_adapter

    if args.threads:
        torch.set_num_threads(args.threads)
    model = build_model(args.model, args.device)
    ad = get_adapter(model)
    V = model.config.vocab_size
    bos = model.config.bos_token_id if model.config.bos_token_id is not None else V - 1
    L, H = ad.n_layers, ad.n_heads
    clean = prompts(args.clean, args.shots, V, bos, 0)
    bad = prompts(args.corrupted, args.shots, V, bos, 1)
    O = out_slices(ad)
    null = torch.zeros(L, H, ad.d_head)
    mean = cue_reads(ad, clean[:2], batch_size=args.batch_size).mean  # warm-up, and the mean AIE patches in
    aie(ad, bad[:1], mean, batch_size=args.batch_size)
    t_mfa, t_aie = [], []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        reads = cue_reads(ad, clean, batch_size=args.batch_size)
        top_heads(head_norms(task_deviation(reads.mean, null), O), 10)
        t_mfa.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        a, _, _ = aie(ad, bad, reads.mean, batch_size=args.batch_size)
        top_heads(a.float(), 10)
        t_aie.append(time.perf_counter() - t0)
    f_mfa, f_aie = len(clean), len(bad) * (L * H + 1)
    m_mfa, m_aie = statistics.median(t_mfa), statistics.median(t_aie)
    T = len(clean[0].tokens)
    print(f"model {args.model}: {L} layers x {H} heads, prompts of {T} tokens ({args.shots} shots), device "
          f"{args.device}, threads {torch.get_num_threads()}, batch {args.batch_size}, median of {args.repeats}")
    print(f"MFA selection: {f_mfa} prompt-forwards ({len(clean)} clean prompts, one each)   {m_mfa:.3f} s  "
          f"(runs: {', '.join(f'{t:.3f}' for t in t_mfa)})")
    print(f"AIE selection: {f_aie} prompt-forwards ({len(bad)} corrupted prompts x ({L}x{H} heads + 1))   "
          f"{m_aie:.3f} s  (runs: {', '.join(f'{t:.3f}' for t in t_aie)})")
    print(f"ratio AIE / MFA: forwards {f_aie / f_mfa:.1f}x, wall time {m_aie / m_mfa:.1f}x")


if __name__ == "__main__":
    main()
