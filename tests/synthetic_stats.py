"""A model-free statistics store for the kernel-dynamics and calibration tests: token windows, a tracked set, the
model-free counts from the statistics pass's own accumulator, and an attention kernel P generated from a known
per-key kernel U* through the renormalisation of eq:ahat (so E_s[Â(U*)] = P exactly)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from mfpipe.corpus.tracked import TrackedSet
from mfpipe.corpus.windows import Shard, write_shards
from mfpipe.experiments.substitution.calibration import corpus_pass, window_batches
from mfpipe.stats import Accumulator, finalize, write_store
from mfpipe.stats.buckets import bucket_luts, window_buckets

VOCAB, BOS, N_TRACKED, T = 40, 39, 10, 12


def windows(n_windows: int = 24, seed: int = 0, T: int = T) -> np.ndarray:
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, VOCAB + 1) ** 0.9
    toks = rng.choice(VOCAB, size=(n_windows, T), p=p / p.sum())
    toks[:, 0] = BOS
    return toks.astype(np.int32)


def tracked_set(tokens: np.ndarray, n: int = N_TRACKED, shift: int = 0) -> TrackedSet:
    counts = np.bincount(tokens[:, 1:].ravel(), minlength=VOCAB)
    counts[BOS] = 0
    order = np.lexsort((np.arange(VOCAB), -counts))[shift : shift + n]
    return TrackedSet(type_ids=order, strings=[f"tok{i}" for i in order], counts=counts[order], bos_id=BOS,
                      vocab_size=VOCAB)


def model_free_sums(tokens, tracked, L: int, H: int, d: int = 4, dh: int = 2) -> dict:
    key, query, n, _ = bucket_luts(tracked)
    acc = Accumulator(L, H, d, dh, n, tokens.shape[1])
    for b0 in range(0, tokens.shape[0], 8):
        kb, qt = window_buckets(tokens[b0 : b0 + 8], key, query, n)
        acc.begin_batch(kb, qt)
    return acc.sums()


def make_store(path, tokens, tracked, U_true, revision="step0", model="synth", corpus_fingerprint="c0ffee"):
    """Write a store whose P (per layer) is E_s[Â(U_true[l])] over ``tokens``; returns the path."""
    L, H = U_true.shape[:2]
    sums = model_free_sums(tokens, tracked, L, H)
    batches = window_batches(tokens, tracked, batch_size=8)
    qc = sums["query_count"].astype(np.float64)
    P = np.zeros(U_true.shape)
    for l in range(L):
        P[l] = np.nan_to_num(corpus_pass(torch.from_numpy(U_true[l]), batches).Q.numpy())
    sums["P_sum"] = P * qc[None, None, :, None]
    meta = {"model": model, "revision": revision, "half": "stats", "corpus_fingerprint": corpus_fingerprint}
    ds = finalize(sums, tracked, meta, dtype=np.float64)
    return write_store(ds, Path(path))


def write_corpus(root, tokens, tracked):
    """Shards of the statistics half and the tracked set as the corpus stage lays them out."""
    root = Path(root)
    doc = np.zeros_like(tokens)
    doc[:, 0] = -1
    shards = write_shards(Shard(tokens, doc), root / "shards" / "stats", shard_windows=10)
    tracked.save(root / "tracked.json")
    return shards, root / "tracked.json"


class NamedList(list):
    """Stand-in for Snakemake's input/output/params objects: a list whose named items are also attributes."""

    def __init__(self, *items, **named):
        super().__init__([*items, *named.values()])
        for k, v in named.items():
            setattr(self, k, v)


def run_job(package: str, rule: str, **sm):
    """Run the job function ``rule`` of ``mfpipe.<package>.jobs`` as workflow/scripts/job.py runs it
    (mfpipe.workflow.runner.run_job), with a stand-in ``snakemake`` object: its ``input`` gets the jobs module as
    its first code input, as a rule's ``code=job(package, rule)`` gives it. The runner pins the numerics for the rest of
    its process (mfpipe.workflow.numerics); here the test process gets its environment and oneDNN back, so that the
    processes later tests start compute as before."""
    import os
    from types import SimpleNamespace
    from unittest import mock

    import torch

    from mfpipe.workflow import runner

    module = Path(runner.__file__).resolve().parents[1].joinpath(*package.split("."), "jobs.py")
    sm["input"].code = [str(module)]
    onednn = torch.backends.mkldnn.enabled
    try:
        with mock.patch.dict(os.environ):
            runner.run_job(SimpleNamespace(threads=1, rule=rule, **sm))
    finally:
        torch.backends.mkldnn.enabled = onednn
