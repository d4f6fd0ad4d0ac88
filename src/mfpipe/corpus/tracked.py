"""The tracked type set: the top-N token types by frequency on the `stats` half.

Bucket convention (shared by every statistic, see docs/conventions.md): tracked types are key
buckets ``0 … N-1`` in rank order, ``<bos>`` is bucket ``N`` (position 0 only) and ``<other>`` is
bucket ``N+1`` (positions ≥ 1 of an untracked type). Query types are tracked types only.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from mfpipe.workflow.io import atomic_write_text

BOS_LABEL = "<bos>"
OTHER_LABEL = "<other>"


@dataclass
class TrackedSet:
    type_ids: np.ndarray  # int64 [N], rank order (most frequent first)
    strings: list[str]
    counts: np.ndarray  # int64 [N], occurrences at positions >= 1 on the stats half
    bos_id: int
    vocab_size: int
    total_positions: int = 0  # positions >= 1 counted on the stats half
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.type_ids = np.asarray(self.type_ids, dtype=np.int64)
        self.counts = np.asarray(self.counts, dtype=np.int64)
        if len(self.strings) != len(self.type_ids) or len(self.counts) != len(self.type_ids):
            raise ValueError("tracked set: type_ids, strings and counts must have the same length")
        if self.bos_id in set(self.type_ids.tolist()):
            raise ValueError(f"tracked set contains the BOS id {self.bos_id}; BOS is never a tracked type")
        if len(np.unique(self.type_ids)) != len(self.type_ids):
            raise ValueError("tracked set: duplicate type ids")

    @property
    def n(self) -> int:
        return int(len(self.type_ids))

    @property
    def bos_bucket(self) -> int:
        return self.n

    @property
    def other_bucket(self) -> int:
        return self.n + 1

    @property
    def fingerprint(self) -> str:
        h = hashlib.sha256()
        h.update(np.asarray([self.bos_id, self.vocab_size], dtype=np.int64).tobytes())
        h.update(self.type_ids.tobytes())
        return h.hexdigest()[:16]

    @property
    def coverage(self) -> float:
        """Position coverage (App. F): share of positions >= 1 whose type is tracked."""
        if self.total_positions <= 0:
            return float("nan")
        return float(self.counts.sum()) / float(self.total_positions)

    def key_bucket_lut(self) -> np.ndarray:
        """token id -> key bucket for positions >= 1 (rank, or N+1 for untracked)."""
        lut = np.full(self.vocab_size, self.other_bucket, dtype=np.int64)
        lut[self.type_ids] = np.arange(self.n, dtype=np.int64)
        return lut

    def query_bucket_lut(self) -> np.ndarray:
        """token id -> query type index (rank), -1 where the type is not a query type."""
        lut = np.full(self.vocab_size, -1, dtype=np.int64)
        lut[self.type_ids] = np.arange(self.n, dtype=np.int64)
        return lut

    def key_labels(self) -> list[str]:
        return list(self.strings) + [BOS_LABEL, OTHER_LABEL]

    def to_dict(self) -> dict:
        return {
            "n": self.n,
            "bos_id": int(self.bos_id),
            "vocab_size": int(self.vocab_size),
            "total_positions": int(self.total_positions),
            "coverage": self.coverage,
            "fingerprint": self.fingerprint,
            "type_ids": self.type_ids.tolist(),
            "strings": list(self.strings),
            "counts": self.counts.tolist(),
            "meta": self.meta,
        }

    def save(self, path: str | Path) -> None:
        atomic_write_text(path, json.dumps(self.to_dict(), indent=1, ensure_ascii=False))

    @classmethod
    def load(cls, path: str | Path) -> "TrackedSet":
        path = Path(path)
        try:
            d = json.loads(path.read_text())
        except FileNotFoundError:
            raise FileNotFoundError(f"tracked type set {path} does not exist; run the corpus stage first") from None
        ts = cls(
            type_ids=np.asarray(d["type_ids"], dtype=np.int64),
            strings=list(d["strings"]),
            counts=np.asarray(d["counts"], dtype=np.int64),
            bos_id=int(d["bos_id"]),
            vocab_size=int(d["vocab_size"]),
            total_positions=int(d.get("total_positions", 0)),
            meta=dict(d.get("meta", {})),
        )
        if d.get("fingerprint") and d["fingerprint"] != ts.fingerprint:
            raise ValueError(f"tracked type set {path} is corrupt: its fingerprint does not match its ids")
        return ts


def count_types(token_arrays: Iterable[np.ndarray], vocab_size: int) -> np.ndarray:
    """Occurrence count of every type at positions >= 1 of `[n, T]` window arrays."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for tokens in token_arrays:
        body = np.asarray(tokens)[:, 1:].ravel()
        if body.size and (body.min() < 0 or body.max() >= vocab_size):
            raise ValueError(f"token id out of range for a vocabulary of {vocab_size}")
        counts += np.bincount(body, minlength=vocab_size).astype(np.int64)
    return counts


def select_tracked(
    counts: np.ndarray,
    n: int,
    bos_id: int,
    decode: "callable",
    exclude_ids: Sequence[int] = (),
    meta: dict | None = None,
) -> TrackedSet:
    """Top-`n` types by count (ties broken by smaller id), BOS and `exclude_ids` never tracked,
    types that never occur never tracked (so a small corpus may give fewer than `n`)."""
    counts = np.asarray(counts, dtype=np.int64)
    eligible = counts.copy()
    eligible[bos_id] = 0
    for i in exclude_ids:
        eligible[int(i)] = 0
    order = np.lexsort((np.arange(len(eligible)), -eligible))  # count desc, id asc
    chosen = [int(i) for i in order[:n] if eligible[i] > 0]
    ids = np.asarray(chosen, dtype=np.int64)
    return TrackedSet(
        type_ids=ids,
        strings=[decode(int(i)) for i in ids],
        counts=counts[ids],
        bos_id=int(bos_id),
        vocab_size=int(len(counts)),
        total_positions=int(counts.sum()),
        meta=dict(meta or {}),
    )


def coverage_table(tracked_paths: Sequence[str | Path], models: Sequence[str]):
    """App. F Table (position coverage): model, vocabulary, N, position coverage (a DataFrame)."""
    import pandas as pd

    rows = []
    for model, path in zip(models, tracked_paths):
        ts = TrackedSet.load(path)
        rows.append({"model": model, "corpus": ts.meta.get("corpus"), "vocabulary": ts.vocab_size,
                     "n_tracked": ts.n, "position_coverage": round(ts.coverage, 4)})
    return pd.DataFrame(rows)
