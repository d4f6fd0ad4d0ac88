#!/usr/bin/env python
"""Benchmark: the mini suite's training on pinned numerics against the machine's own code paths (issue 42).

Trains the default config's mini model (``--model``: mini-gpt2 or mini-neox, its recipe from config/config.yaml,
no few-shot rows) for ``--steps`` steps, each run in a fresh process (the numerics are fixed when a process first
runs a kernel), interleaved over ``--repeats`` rounds: ``native-2`` (the machine's code paths, two threads: the
training before the pinning), ``native-1`` and ``pinned-1`` (:func:`mfpipe.workflow.numerics.pinned`, one thread:
the training now). Prints each mode's median seconds per step and its ratio to ``native-2``. The tokenizer is
trained once on the embedded corpus's train split (cached under ``--work``).

    PYTHONPATH=src python benchmarks/pinned_training.py --model mini-gpt2 --steps 60 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = {"native-2": ("native", 2), "native-1": ("native", 1), "pinned-1": ("pinned", 1)}

# one process = one run: time the optimization steps only (after 5 warm-up steps), not the imports or the setup
RUN = r"""
import json, os, sys, time
mode, threads, tok, texts, cfg = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], json.loads(sys.argv[5])
if mode == "pinned":
    from mfpipe.workflow.numerics import pin_env
    pin_env()
import torch
from mfpipe.minisuite import train as T
from mfpipe.minisuite.model import resolve_config
from mfpipe.workflow.numerics import numerics_info, pinned

texts = json.loads(open(texts).read())
c = resolve_config(cfg)
ctx = pinned(threads) if mode == "pinned" else None
if ctx is None:
    torch.set_num_threads(threads)
else:
    ctx.__enter__()
import tempfile
run = T._TrainingRun(c, tok, texts, __import__("pathlib").Path(tempfile.mkdtemp()), time.perf_counter(), None)
steps = int(os.environ["BENCH_STEPS"])
times = []
for step in range(1, steps + 6):  # the loop of _TrainingRun.optimize, without its checkpoints and probes
    t = time.perf_counter()
    rows, mask = run.sampler.sample(int(c["batch_size"]), step)
    for g in run.opt.param_groups:
        g["lr"] = T._lr_at(step, c)
    loss = T._lm_loss(run.model, torch.from_numpy(rows), torch.from_numpy(mask))
    run.opt.zero_grad(set_to_none=True)
    loss.backward()
    if c["grad_clip"]:
        torch.nn.utils.clip_grad_norm_(run.model.parameters(), float(c["grad_clip"]))
    run.opt.step()
    if step > 5:
        times.append(time.perf_counter() - t)
print(json.dumps({"s_per_step": sum(times) / len(times), "numerics": numerics_info()}))
__import__("shutil").rmtree(run.tmp, ignore_errors=True)
"""


def corpus(work: Path) -> tuple[Path, Path, dict]:
    import yaml

    from mfpipe.corpus.documents import load_documents, split_documents
    from mfpipe.minisuite.tokenizer import train_tokenizer

    ms = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())["minisuite"]
    tok, texts = work / "tokenizer", work / "texts.json"
    if not texts.exists():
        docs = load_documents(ms["corpus"])
        train = [d.text for d in split_documents(docs, int(ms["corpus"]["reserve_train_every"]))["train"]]
        texts.write_text(json.dumps(train))
        train_tokenizer(train, int(ms["tokenizer"]["vocab_size"]), int(ms["tokenizer"]["min_frequency"]), tok)
    return tok, texts, ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="mini-gpt2")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--work", default="/tmp/mfpipe-bench-training")
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    tok, texts, ms = corpus(work)
    cfg = dict(next(m for m in ms["models"] if m["name"] == args.model), fewshot_fraction=0.0)
    clean = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "OMP_NUM_THREADS",
                                                              "NPY_DISABLE_CPU_FEATURES", "OPENBLAS_CORETYPE",
                                                              "NUMBA_CPU_NAME", "MFPIPE_NUMERICS")}
    clean.update(PYTHONPATH=str(ROOT / "src"), BENCH_STEPS=str(args.steps))
    got: dict[str, list[float]] = {m: [] for m in MODES}
    for r in range(args.repeats):
        for name, (mode, threads) in MODES.items():
            p = subprocess.run([sys.executable, "-c", RUN, mode, str(threads), str(tok), str(texts), json.dumps(cfg)],
                               env=clean, capture_output=True, text=True)
            if p.returncode:
                raise SystemExit(f"{name} failed:\n{p.stderr[-3000:]}")
            rec = json.loads(p.stdout.strip().splitlines()[-1])
            got[name].append(rec["s_per_step"])
            print(f"round {r + 1} {name}: {rec['s_per_step']:.4f} s/step ({rec['numerics']['cpu_capability']}, "
                  f"MKL {rec['numerics']['mkl_branch']}, {rec['numerics']['threads']} threads)", flush=True)
    base = statistics.median(got["native-2"])
    print(f"\n{args.model}, {args.steps} steps, median of {args.repeats}:")
    for name, xs in got.items():
        m = statistics.median(xs)
        print(f"  {name:9s} {m:.4f} s/step  {m / base:.2f}x native-2")


if __name__ == "__main__":
    main()
