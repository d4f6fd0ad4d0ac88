"""Fig. positional: every head's posVar (layer x head), and for the cluster heads the attention on BOS a(p) and the
signed coefficient of the positional write on its leading axis against the query position, drawn from the tables
(no model)."""

from __future__ import annotations

import numpy as np
import pandas as pd

__all__ = ["plot_positional"]


def plot_positional(heads: pd.DataFrame, curves: pd.DataFrame, path, *, title: str = "") -> None:
    """Three panels: posVar heatmap (cluster heads outlined), a(p) and the leading coefficient per cluster head."""
    from matplotlib.patches import Rectangle

    from mfpipe.workflow.plots import figure_paths, integer_ticks, new_figure, save_figure

    fig, axes = new_figure(3, w=3.4, h=2.9)
    L, H = int(heads["layer"].max()) + 1, int(heads["head"].max()) + 1
    grid = np.full((L, H), np.nan)
    grid[heads["layer"].to_numpy(int), heads["head"].to_numpy(int)] = heads["posvar"].to_numpy(float)
    ax = axes[0, 0]
    im = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto")
    for r in heads[heads["cluster"]].itertuples():
        ax.add_patch(Rectangle((r.head - 0.5, r.layer - 0.5), 1, 1, fill=False, ec="red", lw=1.2))
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    integer_ticks(ax, "x", range(H))
    integer_ticks(ax, "y", range(L))
    ax.set_title("posVar (red: positional cluster)", fontsize=8)
    fig.colorbar(im, ax=ax, shrink=0.8)
    for ax, col, label in ((axes[0, 1], "a_mean", "attention on BOS a(p)"),
                           (axes[0, 2], "lead_mean", "leading coefficient of the positional write")):
        for head, g in curves.groupby("head", sort=False):
            ax.plot(g["position"], g[col], marker=".", ms=3, lw=1, label=head)
        ax.set_xlabel("query position p")
        integer_ticks(ax, "x")
        ax.set_title(label, fontsize=8)
        if len(curves):
            ax.legend(fontsize=6, frameon=False)
        else:
            ax.text(0.5, 0.5, "no positional cluster", ha="center", va="center", transform=ax.transAxes, fontsize=8)
    if title:
        fig.suptitle(title, fontsize=9)
    save_figure(fig, *figure_paths(path))
