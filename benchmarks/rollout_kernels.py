#!/usr/bin/env python
"""Benchmark: every rollout kernel (Sec. 4.2) for N tracked types on the mini models -- kernel construction,
Alg. 1 and the four metrics per layer, as ``mfpipe.experiments.rollout.runs.run_rollouts`` does them. Goal: all kernels for
N = 1000 on the mini models in < 60 s on 2 cores.

    python benchmarks/rollout_kernels.py                      # both mini architectures, random weights, N=1000
    python benchmarks/rollout_kernels.py --n 1000 --threads 2 --arch gpt2
    python benchmarks/rollout_kernels.py --model results/minisuite/mini-gpt2/checkpoints/step2400 \
        --stats results/stats/mini-gpt2/step2400/stats.zarr --eval results/stats/mini-gpt2/step2400/eval.zarr

Without ``--stats/--eval`` the statistics stores are synthetic (random row-stochastic P, centroids, counts)
with the shapes of a real N-type store for the model, written with the real store writer; the timing does
not depend on their values. Without ``--model`` the model is built (random weights) from the mini-suite
entry of ``config/config.yaml`` -- the shape of the models ``snakemake --cores 2`` trains.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import yaml

REPO = Path(__file__).resolve().parents[1]


def mini_model(arch: str):
    from mfpipe.minisuite.model import build_model

    cfg = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    entry = next(m for m in cfg["minisuite"]["models"] if m["architecture"] == arch)
    entry = {k: v for k, v in entry.items() if k != "name"}
    torch.manual_seed(0)
    model = build_model(entry, vocab_size=int(cfg["minisuite"]["tokenizer"]["vocab_size"]), bos_id=0)
    model.eval().requires_grad_(False)
    return model, int(entry["context_length"])


def synthetic_store(model, adapter, n: int, T: int, half: str, path: Path, seed: int) -> Path:
    from mfpipe.corpus.tracked import TrackedSet
    from mfpipe.stats import finalize, write_store

    rng = np.random.default_rng(seed)
    L, H, d, dh = adapter.n_layers, adapter.n_heads, adapter.d_model, adapter.d_head
    K = n + 2
    V = model.config.vocab_size
    ids = np.random.default_rng(0).permutation(np.arange(1, V))[:n]  # one tracked set for both halves
    tracked = TrackedSet(type_ids=ids, strings=[f"t{i}" for i in ids], counts=np.full(n, 100), bos_id=0, vocab_size=V)
    qc = rng.integers(20, 2000, size=n)
    kc = np.concatenate([qc, [qc.sum() // T], [qc.sum() // 2]])
    P = rng.dirichlet(np.full(K, 0.3), size=(L, H, n))
    with torch.no_grad():
        emb = adapter.embed(torch.as_tensor(np.concatenate([ids, [0, 1]]))).double().numpy()  # [K, d]
    resid = emb[None] + rng.normal(scale=0.5, size=(L + 1, K, d))
    sums = {
        "n_windows": np.int64(kc[n]), "n_tokens": np.int64(kc[n] * T), "query_count": qc, "key_count": kc,
        "position_count": np.full(T, qc.sum() // T), "P_sum": P * qc[None, None, :, None],
        "nbar_sum": rng.integers(0, 50, size=(n, K)) * qc[:, None] // 10, "context_count": rng.integers(0, 100, (n, K)),
        "cooc": rng.integers(0, 30, size=(n, K)),
        "resid_sum": resid * kc[None, :, None], "resid_sq_sum": (resid**2 + 0.25) * kc[None, :, None],
        "attn_out_sum": rng.normal(size=(L, K, d)) * kc[None, :, None],
        "resid_mid_sum": resid[:L] * kc[None, :, None], "mlp_out_sum": rng.normal(size=(L, K, d)) * kc[None, :, None],
        "ln_in_sum": rng.normal(size=(L, K, d)) * kc[None, :, None],
        "value_sum": rng.normal(size=(L, H, K, dh)) * kc[None, None, :, None],
        "read_sum": rng.normal(size=(L, H, K, dh)) * kc[None, None, :, None],
    }
    meta = {"model": "bench", "revision": "r", "half": half, "corpus": "synthetic", "corpus_fingerprint": "syn",
            "model_type": adapter.model_type}
    return write_store(finalize(sums, tracked, meta), path)


def bench(arch: str | None, args) -> float:
    from mfpipe.experiments.rollout import runs as RO
    from mfpipe.models.adapters import get_adapter
    from mfpipe.models.loader import load_model
    from mfpipe.stats import halves as S

    t_all = time.perf_counter()
    if args.model:
        model = load_model({"name": "bench", "source": "local", "path": args.model}, None, "float32", "cpu")
        T = int(getattr(model.config, "n_positions", None) or model.config.max_position_embeddings)
    else:
        model, T = mini_model(arch)
    ad = get_adapter(model)
    with tempfile.TemporaryDirectory() as tmp:
        if args.stats:
            stats, evl = args.stats, args.eval
        else:
            stats = synthetic_store(model, ad, args.n, T, "stats", Path(tmp) / "stats.zarr", 1)
            evl = synthetic_store(model, ad, args.n, T, "eval", Path(tmp) / "eval.zarr", 2)
        t0 = time.perf_counter()
        st, ev = S.open_pair(stats, evl)
        setup = RO.prepare(ad, st, ev)
        print(f"{ad.model_type}: L={ad.n_layers} H={ad.n_heads} d={ad.d_model} N={st.n}  "
              f"setup (load P, b^l, start) {time.perf_counter() - t0:6.2f} s")
        total = time.perf_counter() - t0
        for k in args.kernels:
            t = time.perf_counter()
            RO.run_rollouts(model, ad, None, None, kernels=[k], seed=0, setup=setup, pin=args.pin)
            dt = time.perf_counter() - t
            total += dt
            print(f"  {k:<13} {dt:6.2f} s")
    print(f"  all kernels incl. setup: {total:.2f} s  (with model build and stores: {time.perf_counter() - t_all:.2f} s)")
    return total


def main() -> None:
    from mfpipe.experiments.rollout.tables import DEFAULT_KERNELS

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", choices=["gpt2", "gpt_neox", "both"], default="both")
    ap.add_argument("--n", type=int, default=1000, help="tracked types (synthetic stores)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kernels", nargs="+", default=list(DEFAULT_KERNELS))
    ap.add_argument("--pin", action="store_true", help="also the rogue-pinned rollouts")
    ap.add_argument("--model", help="an HF checkpoint folder instead of a random mini model")
    ap.add_argument("--stats", help="a real statistics store (stats half) instead of a synthetic one")
    ap.add_argument("--eval", help="the matching eval half")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    archs = [None] if args.model else (["gpt2", "gpt_neox"] if args.arch == "both" else [args.arch])
    worst = max(bench(a, args) for a in archs)
    print(f"slowest model: {worst:.2f} s for {len(args.kernels)} kernels ({'OK' if worst < 60 else 'over'} the 60 s goal)")


if __name__ == "__main__":
    main()
