"""One head card per head and revision (issue 61 item 3): the head's kernel W restricted to its top query and key
types, with P, n̄ and C beside it (the statistics store of that revision: W = P / n̄ on the C ≥ min_count support,
:meth:`mfpipe.stats.api.MeanFieldStats.W`), and its top-deviation contexts from the lenses' table (text, the query
marked, the head's attention on every token of the excerpt, D, M_cov, M_ctx, the raw and J-lens decodes of the
deviation vector), where the run mined them (the rollout revisions; ``prompts.lenses`` chooses the heads).

Type strings and context text stay strings in the card's JSON: the page puts them in as text, never as markup."""

from __future__ import annotations

import json
from collections.abc import Mapping

import numpy as np
import pandas as pd

__all__ = ["KernelCards", "kernel_block", "context_cards", "TOP_TYPES"]

TOP_TYPES = 12  # query and key types the kernel heatmap shows (explorer.top_types)


def _finite(a) -> list:
    """A float array as nested lists with None for NaN (JSON has no NaN)."""
    a = np.asarray(a, dtype=np.float64)
    return np.where(np.isfinite(a), a, None).tolist()


def kernel_block(W: np.ndarray, P: np.ndarray, nbar: np.ndarray, C: np.ndarray, query_count: np.ndarray,
                 query_labels, key_labels, k: int = TOP_TYPES) -> dict:
    """The heatmap of one head's kernel: the ``k`` most frequent query types with a defined row (W's rows are NaN for
    types with no query) and the ``k`` key buckets with the largest mean P over those rows (BOS and ``<other>``
    included when they are among them), keys in bucket order. ``W``, ``P`` ``[N, K]`` of the head; ``nbar``, ``C``
    ``[N, K]``; ``query_count`` ``[N]``."""
    N = W.shape[0]
    has = np.isfinite(W).all(axis=1) & (np.asarray(query_count[:N]) > 0)
    q = [int(i) for i in np.argsort(-np.where(has, query_count[:N], -1), kind="stable")[:k] if has[i]]
    if not q:
        return {"query": [], "key": [], "W": [], "P": [], "nbar": [], "C": []}
    mass = np.nan_to_num(P[q].mean(axis=0), nan=-1.0)
    keys = sorted(int(i) for i in np.argsort(-mass, kind="stable")[:k])
    sub = np.ix_(q, keys)
    return {"query": [str(query_labels[i]) for i in q], "key": [str(key_labels[i]) for i in keys],
            "query_index": q, "key_index": keys,
            "W": _finite(W[sub]), "P": _finite(P[sub]), "nbar": _finite(nbar[sub]),
            "C": np.asarray(C[sub], dtype=np.int64).tolist()}


class KernelCards:
    """The kernel heatmaps of every head of one revision, from its statistics store (opened once, a layer at a time)."""

    def __init__(self, path, expect: Mapping | None = None, k: int = TOP_TYPES):
        from mfpipe.stats.api import open_stats

        self.stats = open_stats(path, expect)
        self.k = k
        self.nbar = np.asarray(self.stats.nbar().values, dtype=np.float64)
        self.C = np.asarray(self.stats.context_count().values)
        self.qc = np.asarray(self.stats.query_count().values)
        self.min_count = int(self.stats.attrs.get("min_count", 20))
        self._layer, self._W, self._P = None, None, None

    def head(self, layer: int, head: int) -> dict:
        if self._layer != layer:
            P = self.stats.P(layer=layer)  # read once: W is P / nbar of it
            self._W = np.asarray(self.stats.W(layer=layer, P=P).transpose("head", "query", "key").values, np.float64)
            self._P = np.asarray(P.transpose("head", "query", "key").values, np.float64)
            self._layer = layer
        out = kernel_block(self._W[head], self._P[head], self.nbar, self.C, self.qc, self.stats.query_labels,
                           self.stats.key_labels, self.k)
        out["min_count"] = self.min_count
        return out


def _list(x):
    if isinstance(x, str):
        return json.loads(x) if x else []
    return [] if x is None or (isinstance(x, float) and np.isnan(x)) else list(x)


def _num(x):
    x = float(x)
    return x if np.isfinite(x) else None


def context_cards(lens: pd.DataFrame | None, layer: int, head: int) -> list[dict]:
    """The head's contexts from a lenses table (:func:`mfpipe.experiments.prompts.lenses.contexts_csv`), in the
    table's order (highest D first): the excerpt's tokens and the head's attention on each (``excerpt_tokens``,
    ``excerpt_attention``, the query at ``query_index``), the attention on BOS, the top keys, D, the recomputed D,
    M_cov, M_ctx, the next token and the decodes."""
    if lens is None or not len(lens):
        return []
    rows = lens[(lens["layer"] == layer) & (lens["head"] == head)]
    out = []
    for r in rows.to_dict("records"):
        toks = _list(r.get("excerpt_tokens"))
        c = {"rank": int(r["rank"]), "D": _num(r["D"]), "D_recomputed": _num(r["D_recomputed"]),
             "M_cov": _num(r["M_cov"]), "M_ctx": _num(r["M_ctx"]), "next_token": str(r.get("next_token") or ""),
             "left": str(r.get("left") or ""), "query": str(r.get("query") or ""), "right": str(r.get("right") or ""),
             "tokens": [str(t) for t in toks], "attention": [_num(a) for a in _list(r.get("excerpt_attention"))],
             "query_index": int(r["query_index"]) if "query_index" in r and pd.notna(r["query_index"]) else None,
             "bos_share": _num(r["bos_share"]) if "bos_share" in r else None,
             "shard": int(r["shard"]), "window": int(r["window"]), "position": int(r["position"]),
             "key_tokens": [str(t) for t in _list(r.get("key_tokens"))],
             "key_shares": [_num(a) for a in _list(r.get("key_shares"))],
             "decode": [[str(t), _num(p)] for t, p in zip(_list(r.get("decode_tokens")), _list(r.get("decode_probs")))]}
        if "jlens_tokens" in r:
            c["jlens"] = [[str(t), _num(p)] for t, p in zip(_list(r.get("jlens_tokens")), _list(r.get("jlens_probs")))]
        out.append(c)
    return out
