"""Sec. 6.1 Experiment 3 (``fig:e15-correlation``): the cross-head Spearman correlation between the per-head
deviation ``S_bar`` (pass 2's deviation store) and the behavioural induction score
(:mod:`mfpipe.experiments.ranking.head_scores`) at every training checkpoint, as a table in training order (its figure:
:func:`mfpipe.experiments.ranking.figures.exp3_figure`); and the same correlation at one revision, for every model
(``tab:gemma``: models without a training sweep)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import pandas as pd

__all__ = ["induction_correlation", "exp3_rows", "exp3_table", "EXP3_COLUMNS", "single_revision_table", "SINGLE_COLUMNS"]

EXP3_COLUMNS = ("model", "revision", "step", "spearman", "p_value", "n_heads")


def _layer_head(a) -> np.ndarray:
    """A ``(layer, head)`` array as numpy; a DataArray is transposed to that order first, so two inputs
    stored in different dimension orders still pair the same heads."""
    if hasattr(a, "dims") and hasattr(a, "transpose"):
        if set(a.dims) != {"layer", "head"}:
            raise ValueError(f"expected dims (layer, head), got {a.dims}")
        a = a.transpose("layer", "head").values
    return np.asarray(a, dtype=np.float64)


def induction_correlation(S_bar, induction) -> tuple[float, float, int]:
    """Spearman rank correlation across heads of two ``[layer, head]`` arrays (DataArray or numpy):
    ``(rho, p, n_heads)``, ``n_heads`` the heads where both are finite (the others are ignored).
    ``rho`` and ``p`` are NaN when fewer than 3 heads remain or either input is constant over them
    (no ranking to correlate)."""
    from scipy.stats import spearmanr

    x, y = _layer_head(S_bar), _layer_head(induction)
    if x.shape != y.shape:
        raise ValueError(f"S_bar {x.shape} and induction {y.shape} cover different heads")
    keep = np.isfinite(x) & np.isfinite(y)
    x, y = x[keep], y[keep]
    n = int(keep.sum())
    if n < 3 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return float("nan"), float("nan"), n
    res = spearmanr(x, y)
    return float(res.statistic), float(res.pvalue), n


def exp3_rows(model: str, deviation: Sequence, heads: Sequence, revisions: Sequence, steps: Sequence) -> list[dict]:
    """The rows of :func:`exp3_table` for one model: per revision (with its training step, None where unknown) its
    deviation store's ``S_bar`` and its head scores' ``induction``, read from ``deviation`` and ``heads`` (one path
    each per revision, in the order of ``revisions``)."""
    from mfpipe.deviation.store import open_deviation
    from mfpipe.experiments.ranking.head_scores import open_head_scores

    deviation, heads = list(deviation), list(heads)
    revisions, steps = [str(r) for r in revisions], [None if s is None else int(s) for s in steps]
    if not len(deviation) == len(heads) == len(revisions) == len(steps):
        raise ValueError(f"{len(deviation)} deviation stores, {len(heads)} head-score tables, {len(revisions)} "
                         f"revisions and {len(steps)} steps: one of each per revision")
    rows = []
    for rev, step, dev_path, heads_path in zip(revisions, steps, deviation, heads):
        scores = open_head_scores(heads_path)
        if scores.attrs.get("revision") not in (None, rev):  # inputs listed out of revision order
            raise ValueError(f"{heads_path} holds revision {scores.attrs['revision']}, expected {rev}")
        dev = open_deviation(dev_path, {"model": str(model), "revision": rev})
        rows.append({"model": str(model), "revision": rev, "step": step, "S_bar": dev["S_bar"],
                     "induction": scores["induction"]})
    return rows


def exp3_table(rows: Iterable[Mapping]) -> pd.DataFrame:
    """One row per checkpoint, in training order (by ``step``; the given order where steps are unknown):
    columns :data:`EXP3_COLUMNS`. A row carries either ``spearman``, ``p_value``, ``n_heads`` or the two
    arrays ``S_bar`` and ``induction`` (then correlated with :func:`induction_correlation`)."""
    out = []
    for r in rows:
        r = dict(r)
        if "spearman" not in r:
            r["spearman"], r["p_value"], r["n_heads"] = induction_correlation(r.pop("S_bar"), r.pop("induction"))
        out.append({c: r.get(c) for c in EXP3_COLUMNS})
    df = pd.DataFrame(out, columns=list(EXP3_COLUMNS))
    if len(df) and df["step"].notna().all():
        df = df.sort_values("step", kind="stable").reset_index(drop=True)
        df["step"] = df["step"].astype(int)
    return df


SINGLE_COLUMNS = ("model", "revision", "spearman", "p_value", "n_heads")


def single_revision_table(table: pd.DataFrame) -> pd.DataFrame:
    """Exp. 3's correlation at one revision (``tab:gemma``'s rho, for a model without a training sweep): the
    Spearman correlation over heads of S̄ and the induction score, read from one ranking table
    (:func:`mfpipe.experiments.ranking.heads.heads_table`: columns ``S_bar``, ``induction``, ``model``,
    ``revision``), heads where either is NaN ignored. One row, columns :data:`SINGLE_COLUMNS`."""
    rho, p, n = induction_correlation(table["S_bar"].to_numpy(float), table["induction"].to_numpy(float))
    first = table.iloc[0] if len(table) else {}
    return pd.DataFrame([{"model": first.get("model"), "revision": first.get("revision"), "spearman": rho,
                          "p_value": p, "n_heads": n}], columns=list(SINGLE_COLUMNS))
