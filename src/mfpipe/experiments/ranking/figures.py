"""Figures of the mean-field deviation (paper Sec. 6).

* :func:`exp3_figure` -- Sec. 6.1 Experiment 3, ``fig:e15-correlation``: the cross-head Spearman correlation of
  :mod:`mfpipe.experiments.ranking.exp3` against the training step.
* :func:`ccmf_scatter` -- Sec. 6.3 ``fig:ccmf-scatter``: every head on the M_cov / M_ctx plane.

The figures use the training-step axis, the window shade and the atomic writer of :mod:`mfpipe.workflow.plots`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from mfpipe.experiments.ranking.heads import ROLE_THRESHOLDS, head_roles
from mfpipe.workflow.plots import figure_paths, new_figure, read_table, save_figure, shade_window, step_axis

__all__ = ["exp3_figure", "SIGNIFICANCE", "ccmf_scatter"]

SIGNIFICANCE = 0.05  # points with p below this are drawn filled


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
    ax.set_ylabel(r"Spearman $\rho$($\bar S^{\ell h}$, induction score)")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    if title:
        ax.set_title(title)
    step_axis(ax, x, window)
    pdf, png = figure_paths(path_stem)
    save_figure(fig, pdf, png)
    return pdf, png


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
