"""Where the heads of each behavioural role sit in the S̄ ranking (paper Sec. 6.3, "circuits straddle the ranking").

A lookup circuit pairs a writing head with a reading head: previous-token heads feed induction heads, duplicate-token
heads feed name movers. The paper finds the readers at the top of the mean-field deviation ranking and the writers
near the bottom. Per role, the ``top`` heads by the role's score, each with its rank and percentile in the S̄
ranking (:func:`mfpipe.experiments.ranking.heads.heads_table`):

* ``previous-token``  -- attention on position ``i - 1`` (column ``previous_token`` of the head scores,
  :mod:`mfpipe.experiments.ranking.head_scores`)
* ``induction``       -- the induction score (column ``induction``)
* ``duplicate-token`` -- attention on the query type's earlier occurrence on repeated random tokens
  (column ``duplicate_token``)
* ``BOS-sink``        -- mean attention on position 0 on the corpus: the kernel P's ``<bos>`` column averaged over
  the tracked query types weighted by their counts (:func:`bos_sink_scores`), i.e. over every tracked-query
  position of the statistics half
"""

from __future__ import annotations

import numpy as np
import pandas as pd

__all__ = ["ROLES", "bos_sink_scores", "role_ranks", "ROLE_COLUMNS"]

# role name -> column of the ranking table its heads are chosen by
ROLES: tuple[tuple[str, str], ...] = (("previous-token", "previous_token"), ("induction", "induction"),
                                      ("duplicate-token", "duplicate_token"), ("BOS-sink", "bos_sink_corpus"))
ROLE_COLUMNS = ["model", "revision", "role", "role_rank", "head_label", "layer", "head", "score", "rank",
                "percentile", "S_bar", "n_heads"]


def bos_sink_scores(P_bos, query_count) -> np.ndarray:
    """``[layer, head]`` mean attention on position 0 over tracked-query positions: ``P_bos`` ``[layer, head,
    query]`` (the kernel's ``<bos>`` column, NaN rows of unseen types ignored) averaged with weights ``query_count``
    ``[query]``."""
    P_bos = np.asarray(P_bos, dtype=np.float64)
    w = np.asarray(query_count, dtype=np.float64)
    w = np.where(np.isfinite(P_bos), w, 0.0)
    total = w.sum(axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(total > 0, (np.nan_to_num(P_bos) * w).sum(axis=-1) / total, np.nan)


def role_ranks(table: pd.DataFrame, top: int = 3) -> pd.DataFrame:
    """Per role (:data:`ROLES`), its ``top`` heads by the role's score (ties: the earlier head), each with its
    S̄ rank (1 = largest deviation), its percentile (``100 * rank / n_heads``: small = top of the ranking) and S̄.
    ``table``: the ranking (:func:`~mfpipe.experiments.ranking.heads.heads_table`, ``rank`` column) with the role
    columns; a role whose column is missing or all NaN is left out."""
    ranked = table[np.isfinite(table["S_bar"].to_numpy(float))]
    n = len(ranked)
    rows = []
    for role, col in ROLES:
        if col not in ranked or not np.isfinite(ranked[col].to_numpy(float)).any():
            continue
        by = ranked[np.isfinite(ranked[col].to_numpy(float))]
        by = by.sort_values([col, "layer", "head"], ascending=[False, True, True], kind="stable").head(int(top))
        for i, r in enumerate(by.itertuples(index=False), start=1):
            rows.append({"model": r.model, "revision": r.revision, "role": role, "role_rank": i,
                         "head_label": r.head_label, "layer": int(r.layer), "head": int(r.head),
                         "score": float(getattr(r, col)), "rank": int(r.rank), "percentile": 100.0 * r.rank / n,
                         "S_bar": float(r.S_bar), "n_heads": n})
    return pd.DataFrame(rows, columns=ROLE_COLUMNS)
