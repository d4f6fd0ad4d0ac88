"""Two readings of the lens survey (App. protocol, App. readings) beside the positional analysis: natural against
repeated text, and the type-class test behind the "month effect" (numpy / pandas; no model).

* :func:`repeated_table`: each head's mean per-occurrence deviation ``D`` on natural eval text and on the second copy
  of ``[c; c]`` chunks, against the same mean field; the rise (repeated − natural) and its rank over all heads
  (1 = the largest rise).
* :func:`class_test`: a class of query types (e.g. the twelve month names). At type level, per head, the class's
  median rank among the head's per-type deviations (the deviation store's ``D_type``, over the types pass 2 scored)
  and a one-sided Mann-Whitney p (class above the rest), Bonferroni over the heads (NaN types: not scored); at occurrence level, the class's
  per-occurrence deviations against every other occurrence's (mean difference, two-sided Mann-Whitney p).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

__all__ = ["repeated_table", "class_test"]


def repeated_table(D_natural, n_natural, D_repeated, n_repeated) -> pd.DataFrame:
    """Per head (``[L, H]`` arrays): mean D natural / repeated with their counts, the rise and its rank (1 = largest;
    heads without repeated occurrences last)."""
    D_natural, D_repeated = np.asarray(D_natural, float), np.asarray(D_repeated, float)
    L, H = D_natural.shape
    rise = D_repeated - D_natural
    flat = np.nan_to_num(rise.reshape(-1), nan=-np.inf)
    order = np.lexsort((np.arange(L * H), -flat))
    rank = np.empty(L * H, int)
    rank[order] = np.arange(1, L * H + 1)
    rows = [dict(layer=l, head=h, D_natural=D_natural[l, h], n_natural=int(np.asarray(n_natural)[l, h]),
                 D_repeated=D_repeated[l, h], n_repeated=int(np.asarray(n_repeated)[l, h]), rise=rise[l, h],
                 rise_rank=int(rank[l * H + h])) for l in range(L) for h in range(H)]
    return pd.DataFrame(rows)


def class_test(D_type, class_types, occ_D=None, occ_type=None, occ_keep=None, *, name: str = "class") -> pd.DataFrame:
    """The type-class test per head. ``D_type [L, H, N]`` per-type deviations (NaN: a type pass 2 did not score),
    ``class_types`` the class's query types (indices into N); occurrence level from ``occ_D [n, L, H]``, ``occ_type
    [n]`` and the heads' masks ``occ_keep [n, L, H]`` where given."""
    from scipy.stats import mannwhitneyu

    D_type = np.asarray(D_type, float)
    L, H, N = D_type.shape
    cls = np.zeros(N, bool)
    cls[np.asarray(class_types, dtype=np.int64)] = True
    rows = []
    for l in range(L):
        for h in range(H):
            d = D_type[l, h]
            ok = np.isfinite(d)
            inside, outside = d[ok & cls], d[ok & ~cls]
            rank = (-d[ok]).argsort(kind="stable").argsort() + 1  # 1 = the type with the largest deviation
            row = dict(layer=l, head=h, klass=name, n_types=int(ok.sum()), n_class_types=int(len(inside)),
                       median_rank=float(np.median(rank[cls[ok]])) if len(inside) else np.nan, p_type=np.nan)
            if len(inside) and len(outside):
                row["p_type"] = float(mannwhitneyu(inside, outside, alternative="greater").pvalue)
            if occ_D is not None:
                keep = np.asarray(occ_keep[:, l, h], bool) if occ_keep is not None else np.ones(len(occ_D), bool)
                inc = np.isin(np.asarray(occ_type), np.flatnonzero(cls))
                a, b = np.asarray(occ_D)[keep & inc, l, h], np.asarray(occ_D)[keep & ~inc, l, h]
                row.update(n_class_occurrences=int(len(a)), occurrence_difference=float(a.mean() - b.mean())
                           if len(a) and len(b) else np.nan, p_occurrence=float(mannwhitneyu(a, b).pvalue)
                           if len(a) and len(b) else np.nan)
            rows.append(row)
    out = pd.DataFrame(rows)
    out["p_type_bonferroni"] = np.minimum(out["p_type"] * len(out), 1.0)
    return out
