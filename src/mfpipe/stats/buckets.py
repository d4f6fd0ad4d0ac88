"""Windows -> key buckets and query types, and the per-position counts of each key type in the causal prefix.

Definitions (docs/conventions.md). A window is ``[BOS, t1 … t(T-1)]``. Key buckets: tracked types ``0..N-1``
(frequency rank), ``<bos>`` = ``N`` (position 0 only), ``<other>`` = ``N+1`` (positions >= 1 of an untracked
type); ``K = N + 2``. Every position ``j >= 1`` whose type is tracked is a query (a *context*), its causal
prefix the positions ``0..j``; ``n_t(X_j)`` is the number of keys of bucket ``t`` in that prefix (paper App. A).

Two forms of ``n_t(X_j)``, one definition (tests tie them together): :func:`prefix_counts` (dense cumulative
counts ``[B, T, K]``, what the context-conditional kernel Â_stX of eq:w-def-appendix gathers W rows with)
and :func:`causal_pairs` (the (query, key <= query) pairs themselves: what the statistics pass sums over for
``nbar``, ``C`` and the attention kernel ``P``; the pass enumerates the same pairs, in the same order, from each
window's lower triangle, tests/test_stats_buckets.py). numpy at import (the merge and the
stores use the lookups without torch); the torch functions import it when called. Vectorized: no per-position Python loop.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from mfpipe.stats.errors import StatsError

PAIR_CHUNK = 1 << 22  # (query, key) pairs enumerated at once
COOC_WINDOW = 5  # ±w co-occurrence window of the `cooc` kernel (Sec. 4.2 footnote)


def bucket_luts(tracked) -> tuple[np.ndarray, np.ndarray, int, int | None]:
    """(key-bucket LUT, query LUT, N, bos_id) from a :class:`mfpipe.corpus.tracked.TrackedSet`, or from a mapping
    ``{"key_lut": ..., "query_lut": ..., "n": N, "bos_id": optional}`` (plain lookup tables, for tests)."""
    if isinstance(tracked, Mapping):
        key = np.asarray(tracked["key_lut"], dtype=np.int64)
        query = np.asarray(tracked["query_lut"], dtype=np.int64)
        n = int(tracked["n"])
        bos = tracked.get("bos_id")
    else:
        key = np.asarray(tracked.key_bucket_lut(), dtype=np.int64)
        query = np.asarray(tracked.query_bucket_lut(), dtype=np.int64)
        n = int(tracked.n)
        bos = getattr(tracked, "bos_id", None)
    if key.shape != query.shape:
        raise StatsError("key and query lookup tables must have the same length (the vocabulary size)")
    if key.size and (key.min() < 0 or key.max() > n + 1):
        raise StatsError(f"key lookup table has buckets outside 0..{n + 1}")
    return key, query, n, (None if bos is None else int(bos))


def window_buckets(tokens: np.ndarray, key_lut: np.ndarray, query_lut: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Key buckets ``[B,T]`` (position 0 -> ``<bos>`` = N) and query types ``[B,T]`` (-1: not a query)."""
    tokens = np.asarray(tokens)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= len(key_lut)):
        raise StatsError(f"token id outside the vocabulary of {len(key_lut)} of the tracked set")
    kb = key_lut[tokens]
    qt = query_lut[tokens]
    kb[:, 0] = n
    qt[:, 0] = -1
    return kb, qt


def prefix_counts(kb, n_buckets: int, dtype=None):
    """``[B, T, K]``: entry ``[b, j, t]`` is ``n_t(X_j)``, the number of positions ``0..j`` of window ``b`` whose
    key bucket is ``t`` (``kb [B, T]`` from :func:`window_buckets`). Memory ``B*T*K`` of ``dtype`` (int32:
    8 windows x T=512 x K=1002 is 16 MB; default int32)."""
    import torch

    dtype = torch.int32 if dtype is None else dtype
    kb = torch.as_tensor(kb, dtype=torch.int64)
    onehot = torch.zeros(*kb.shape, int(n_buckets), dtype=dtype, device=kb.device)
    onehot.scatter_(2, kb.unsqueeze(-1), 1)
    return onehot.cumsum(1, dtype=dtype)


def causal_pairs(qt, chunk: int | None = PAIR_CHUNK):
    """The (query j, key k <= j) pairs of a batch, in chunks of at most ``chunk`` pairs (one chunk: None).

    ``qt [B, T]`` query types (-1: not a query). Yields ``(bb, jj, kk)``: window, query position and key
    position of every pair, queries in row-major order and keys ``0..j`` for each. ``sum over pairs of
    [kb[bb, kk] == t]`` grouped by query is :func:`prefix_counts` at the query (tests/test_stats_reference)."""
    import torch

    qt = torch.as_tensor(qt, dtype=torch.int64)
    dev = qt.device
    bq, jq = torch.nonzero(qt >= 0, as_tuple=True)
    lengths = jq + 1
    ends = torch.cumsum(lengths, 0)
    total = int(ends[-1]) if ends.numel() else 0
    if not total:
        return
    step = total if chunk is None else int(chunk)
    bounds = []
    if step < total:
        marks = torch.arange(step, total, step, device=dev)
        bounds = torch.searchsorted(ends, marks, right=True).tolist()
    r0 = 0
    for r1 in bounds + [bq.numel()]:
        if r1 <= r0:
            continue
        ln = lengths[r0:r1]
        row = torch.repeat_interleave(torch.arange(r0, r1, device=dev), ln)
        offs = torch.cumsum(ln, 0) - ln
        kk = torch.arange(row.numel(), device=dev) - torch.repeat_interleave(offs, ln)
        yield bq[row], jq[row], kk
        r0 = r1


def n_pairs(qt) -> int:
    """Number of (query, key <= query) pairs of a batch: ``sum_j (j + 1)`` over its queries."""
    import torch

    qt = torch.as_tensor(qt)
    jq = torch.nonzero(qt >= 0, as_tuple=True)[1]
    return int((jq + 1).sum()) if jq.numel() else 0
