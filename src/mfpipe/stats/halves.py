"""Statistics stores for an experiment: open them, pair a statistics half with an evaluation half, and refuse
what does not belong together (another model, revision, tracked set, context length or corpus) with a
:class:`~mfpipe.stats.api.ProvenanceError` that says what to do. Substitution, kernel dynamics and the
deviation pass pair stores the same way."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from mfpipe.stats.api import MeanFieldStats, ProvenanceError, check_provenance, open_stats

__all__ = ["open_checked_stats", "open_stats_half", "corpus_info", "open_pair", "check_model", "eval_types", "store_types", "ProvenanceError"]


def open_checked_stats(store, expect: Mapping[str, Any] | None) -> MeanFieldStats:
    """``store`` (a path or an opened :class:`MeanFieldStats`) checked against ``expect``."""
    if isinstance(store, MeanFieldStats):
        check_provenance(store.attrs, expect, store.path or "")
        return store
    return open_stats(store, expect=expect)


def corpus_info(shards_dir) -> dict:
    """The corpus stage's ``fingerprint.json`` of a shards folder (corpus fingerprint, halves, context length)."""
    import json
    from pathlib import Path

    path = Path(shards_dir) / "fingerprint.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} does not exist; rerun the corpus stage (corpus_shards)") from None


def open_stats_half(store, shards_dir, tracked, model: str, revision: str) -> tuple[MeanFieldStats, dict]:
    """The ``stats`` half's store of (``model``, ``revision``), refused unless it was computed with ``tracked`` on
    the corpus of ``shards_dir``; with that corpus's :func:`corpus_info`."""
    info = corpus_info(shards_dir)
    st = open_checked_stats(store, {"model": model, "revision": revision, "half": "stats",
                            "tracked_fingerprint": tracked.fingerprint, "corpus_fingerprint": info["fingerprint"]})
    return st, info


def _pair_expect(st: MeanFieldStats, half: str, same_corpus: bool = False) -> dict[str, Any]:
    a = st.attrs
    exp = {"half": half, "model": a.get("model"), "revision": a.get("revision"),
           "tracked_fingerprint": a.get("tracked_fingerprint"), "n_tracked": st.n,
           "context_length": a.get("context_length")}
    if same_corpus and a.get("corpus_fingerprint") is not None:
        exp["corpus_fingerprint"] = a["corpus_fingerprint"]
    return {k: v for k, v in exp.items() if v is not None}


def open_pair(stats_store, eval_store, *, model: str | None = None, revision: str | None = None,
              same_corpus: bool = True, reference: MeanFieldStats | None = None
              ) -> tuple[MeanFieldStats, MeanFieldStats]:
    """Open (statistics half, evaluation half) and refuse a mismatched pair (:class:`ProvenanceError`).

    The statistics store must be a ``stats`` half (of ``model`` @ ``revision`` when given); the evaluation
    store an ``eval`` half of the same model, revision, tracked set (fingerprint and N) and context length,
    and -- with ``same_corpus`` -- of the same corpus (fingerprint). ``reference`` (e.g. the primary corpus's
    statistics store) additionally pins model, revision, tracked set and context length of both."""
    exp: dict[str, Any] = {"half": "stats"}
    if model is not None:
        exp["model"] = model
    if revision is not None:
        exp["revision"] = revision
    if reference is not None:
        exp.update({k: v for k, v in _pair_expect(reference, "stats").items() if k != "half"})
    st = open_checked_stats(stats_store, exp)
    ev = open_checked_stats(eval_store, _pair_expect(st, "eval", same_corpus))
    return st, ev


def check_model(adapter, st: MeanFieldStats) -> None:
    """Refuse a statistics store computed for another architecture / shape than ``adapter``'s model."""
    a = st.attrs
    want = {"model_type": adapter.model_type, "n_layers": adapter.n_layers, "n_heads": adapter.n_heads,
            "d_model": adapter.d_model, "d_head": adapter.d_head}
    for k, v in want.items():
        if k in a and str(a[k]) != str(v):
            raise ProvenanceError(
                f"statistics store {st.path} was computed for {k}={a[k]!r}, but the model given has {k}={v!r}; "
                "it belongs to another model -- point to the right store or rerun the stats stage")
    if st.n_layers != adapter.n_layers or st.d_model != adapter.d_model:
        raise ProvenanceError(f"statistics store {st.path} has L={st.n_layers}, d={st.d_model}; the model has "
                              f"L={adapter.n_layers}, d={adapter.d_model}")


def eval_types(st: MeanFieldStats, ev: MeanFieldStats, min_count: int = 1) -> np.ndarray:
    """Indices (bucket ranks) of the tracked types scored: ``>= min_count`` occurrences in both halves."""
    m = max(int(min_count), 1)
    ok = (st.query_count().values >= m) & (ev.query_count().values >= m)
    return np.flatnonzero(ok)


def store_types(store: MeanFieldStats, min_count: int = 1) -> np.ndarray:
    """Tracked types of one store with ``>= min_count`` occurrences (descriptive diagnostics of one half)."""
    return np.flatnonzero(store.query_count().values >= max(int(min_count), 1))
