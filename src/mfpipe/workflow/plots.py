"""Figure plumbing shared by every experiment's figures: the house style, a figure without pyplot (the Agg canvas
of :class:`matplotlib.figure.Figure`, no global backend state), output paths, the atomic writer (a temporary sibling,
then a rename: an interrupted job leaves no figure Snakemake would take as done) and the training-step axis of
the figures across checkpoints. matplotlib is imported when a figure is made, not when this module is."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from mfpipe.workflow.io import atomic_file

__all__ = ["read_table", "new_figure", "figure_paths", "save_figure", "step_axis", "shade_window"]

plt_rc = {"font.size": 10, "axes.titlesize": 11, "axes.labelsize": 10, "legend.fontsize": 8,
          "xtick.labelsize": 9, "ytick.labelsize": 9}


def read_table(t) -> pd.DataFrame:
    return t.copy() if isinstance(t, pd.DataFrame) else pd.read_csv(t)


def new_figure(ncols: int, nrows: int = 1, w: float = 3.6, h: float = 3.0):
    import matplotlib
    from matplotlib.figure import Figure

    matplotlib.rcParams.update(plt_rc)
    fig = Figure(figsize=(w * ncols, h * nrows), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False)
    return fig, axes


def figure_paths(out, png=None) -> tuple[Path, Path]:
    """(pdf, png) from a stem (``results/figures/x``), a path with either suffix, or both paths."""
    if png is not None:
        return Path(out), Path(png)
    p = Path(out)
    # by name, not with_suffix: a stem may hold dots of its own (`rollout_llama-3.2-3b_main`)
    stem = p.parent / p.stem if p.suffix in (".pdf", ".png") else p
    return stem.parent / f"{stem.name}.pdf", stem.parent / f"{stem.name}.png"


def save_figure(fig, pdf: str | Path, png: str | Path, dpi: int = 150) -> None:
    """Write ``fig`` to ``pdf`` and ``png``, each atomically (temporary sibling, then rename)."""
    for path, kw in ((Path(pdf), {"metadata": {"CreationDate": None}}), (Path(png), {"dpi": dpi})):
        with atomic_file(path) as tmp:
            fig.savefig(tmp, format=path.suffix[1:], **kw)


def step_axis(ax, steps) -> None:
    """Training steps on a symmetric-log x axis (``linthresh = 1``: linear on [0, 1], logarithmic above), so step 0
    sits at 0 with the log-spaced checkpoints spread out; the plotted x values are the steps themselves."""
    ax.set_xscale("symlog", linthresh=1.0)
    ax.set_xlabel("training step (symlog)")
    s = np.asarray(steps, dtype=float)
    if s.size:
        ax.set_xlim(max(0.0, float(s.min())), float(s.max()) * 1.15 + 1)


def shade_window(ax, window) -> None:
    """The induction-formation window ``(start, stop)``, when known."""
    if window is not None:
        ax.axvspan(float(window[0]), float(window[1]), color="#ffb74d", alpha=0.3, lw=0, label="induction window",
                   zorder=0)
