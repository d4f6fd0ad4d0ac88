"""Figures and tables of the mean-field deviation (paper Sec. 6).

* :func:`induction_correlation` / :func:`exp3_rows` / :func:`exp3_table` / :func:`exp3_figure` -- Sec. 6.1 Experiment 3,
  ``fig:e15-correlation``: the cross-head Spearman correlation between the per-head deviation
  ``S_bar`` and the behavioural induction score (:mod:`mfpipe.experiments.ranking.head_scores`) at every training checkpoint.
* :func:`ccmf_scatter` -- Sec. 6.3 ``fig:ccmf-scatter``: every head on the M_cov / M_ctx plane.

The figures use the training-step axis, the window shade and the atomic writer of :mod:`mfpipe.workflow.plots`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from mfpipe.workflow.plots import figure_paths, new_figure, read_table, save_figure, shade_window, step_axis

__all__ = ["induction_correlation", "exp3_rows", "exp3_table", "exp3_figure", "EXP3_COLUMNS", "SIGNIFICANCE", "ccmf_scatter",
           "head_roles"]

EXP3_COLUMNS = ("model", "revision", "step", "spearman", "p_value", "n_heads")
SIGNIFICANCE = 0.05  # points with p below this are drawn filled


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


def exp3_figure(df, path_stem, window=None, title: str | None = None) -> tuple[Path, Path]:
    """``fig:e15-correlation``: the Spearman correlation against the training step (symlog, as the
    other training figures), p < :data:`SIGNIFICANCE` filled, others hollow, the induction-formation
    window ``(start, stop)`` shaded when given. ``df``: :func:`exp3_table` (or its CSV). Writes
    ``<stem>.pdf`` and ``<stem>.png``."""
    df = read_table(df).sort_values("step")
    if df["step"].isna().any():
        raise ValueError("the Exp. 3 figure needs a training step for every revision (revisions named step<k>)")
    fig, axes = new_figure(1, 1, w=4.6, h=3.2)
    ax = axes[0, 0]
    shade_window(ax, window)
    x, rho = df["step"].to_numpy(float), df["spearman"].to_numpy(float)
    significant = (df["p_value"].to_numpy(float) < SIGNIFICANCE)  # NaN p compares False: hollow
    ax.plot(x, rho, "-", color="#1f77b4", lw=1.4, zorder=2)
    ax.plot(x[significant], rho[significant], "o", color="#1f77b4", ms=5, zorder=3,
            label=f"p < {SIGNIFICANCE:g}", gid="significant")
    ax.plot(x[~significant], rho[~significant], "o", mfc="white", mec="#1f77b4", ms=5, zorder=3,
            label=f"p ≥ {SIGNIFICANCE:g}", gid="not-significant")
    ax.axhline(0.0, color="0.6", lw=0.8)
    step_axis(ax, x)
    ax.set_ylabel(r"Spearman $\rho$($\bar S^{\ell h}$, induction score)")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    if title:
        ax.set_title(title)
    pdf, png = figure_paths(path_stem)
    save_figure(fig, pdf, png)
    return pdf, png


# roles read off the behavioural scores (App. P tab:bottom thresholds: duplicate 0.10, prev-token 0.15, BOS-sink 0.35;
# induction: the usual 0.3 of the mini suite's induction curve)
ROLE_THRESHOLDS = (("induction", 0.3, "induction", "#d62728"), ("previous_token", 0.15, "previous-token", "#2ca02c"),
                   ("duplicate_token", 0.10, "duplicate-token", "#9467bd"), ("bos_sink", 0.35, "BOS-sink", "#7f7f7f"))


def head_roles(table: pd.DataFrame) -> pd.Series:
    """Each head's behavioural role from its scores (first threshold met, in the order of ROLE_THRESHOLDS), else ''."""
    role = pd.Series("", index=table.index)
    for col, thr, name, _ in reversed(ROLE_THRESHOLDS):
        if col in table:
            role = role.where(~(table[col].to_numpy(float) >= thr), name)
    return role


def ccmf_scatter(table, path_stem, top: int = 20, title: str | None = None) -> tuple[Path, Path]:
    """``fig:ccmf-scatter``: every head on the M_cov / M_ctx plane (eq:head-meters), the faint diagonal y = x
    (below: covariance-dominated), the ``top`` heads by S̄ labelled, heads coloured by their behavioural role
    (:func:`head_roles`). ``table``: :func:`mfpipe.experiments.ranking.heads.heads_table` (or its CSV)."""
    df = read_table(table)
    fig, axes = new_figure(1, 1, w=4.8, h=4.2)
    ax = axes[0, 0]
    roles = head_roles(df)
    x, y = df["M_cov"].to_numpy(float), df["M_ctx"].to_numpy(float)
    ax.scatter(x[roles == ""], y[roles == ""], s=14, color="#1f77b4", alpha=0.6, label="other", zorder=2)
    for _, _, name, color in ROLE_THRESHOLDS:
        sel = (roles == name).to_numpy()
        if sel.any():
            ax.scatter(x[sel], y[sel], s=30, color=color, label=name, zorder=3, edgecolor="black", lw=0.4)
    finite = np.isfinite(x) & np.isfinite(y)
    if finite.any():
        lo = float(min(x[finite].min(), y[finite].min(), 0.0))
        hi = float(max(x[finite].max(), y[finite].max()))
        ax.plot([lo, hi], [lo, hi], "--", color="0.7", lw=0.8, zorder=1)
    for _, r in df.sort_values("rank").head(top).iterrows():
        if np.isfinite(r["M_cov"]) and np.isfinite(r["M_ctx"]):
            ax.annotate(r["head_label"], (r["M_cov"], r["M_ctx"]), fontsize=6, xytext=(2, 2), textcoords="offset points")
    ax.set_xlabel(r"$M_{\mathrm{cov}}$ (covariance meter)")
    ax.set_ylabel(r"$M_{\mathrm{ctx}}$ (contextualization meter)")
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=7)
    if title:
        ax.set_title(title)
    pdf, png = figure_paths(path_stem)
    save_figure(fig, pdf, png)
    return pdf, png
