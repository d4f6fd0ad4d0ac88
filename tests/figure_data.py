"""What a figure drew, read back from its matplotlib artists, for the tests that compare a figure with the table it was
drawn from (the figure functions and jobs of every experiment): :func:`capture` keeps each figure at the shared writer
(``mfpipe.workflow.plots.save_figure``, which still writes the files), :func:`lines` / :func:`scatter` / :func:`bars`
/ :func:`image` return the data of its lines by label, point clouds by label, bar heights and heatmap cells, and
:func:`tick_values` an axis's ticks (a discrete axis has whole numbers only)."""

from __future__ import annotations

import sys

import numpy as np


def capture(monkeypatch) -> list:
    """The figures saved from now on, in order (each still written). ``save_figure`` is replaced in
    :mod:`mfpipe.workflow.plots` and in every loaded ``mfpipe`` module that imported it by name."""
    from mfpipe.workflow import plots

    figures = []
    real = plots.save_figure

    def keep(fig, pdf, png, dpi=150):
        figures.append(fig)
        real(fig, pdf, png, dpi=dpi)

    monkeypatch.setattr(plots, "save_figure", keep)
    for name, module in list(sys.modules.items()):
        if name.startswith("mfpipe.") and getattr(module, "save_figure", None) is real:
            monkeypatch.setattr(module, "save_figure", keep)
    return figures


def main_axes(fig) -> list:
    """The figure's panels (colour bars and insets left out), in the order drawn."""
    return [a for a in fig.axes if a.get_label() != "<colorbar>" and a.get_gid() != "window-inset"
            and not any(a is child for p in fig.axes for child in getattr(p, "child_axes", []))]


def lines(ax, data_only: bool = True) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``{label: (x, y)}`` of the lines drawn in data coordinates (reference lines, axhline / axvline, left out with
    ``data_only``); unlabelled lines under ``_line<i>``."""
    out = {}
    for i, ln in enumerate(ax.get_lines()):
        if data_only and ln.get_transform() != ax.transData:
            continue
        label = ln.get_label()
        key = label if label and not label.startswith("_child") else f"_line{i}"
        out[key] = (np.asarray(ln.get_xdata(), dtype=float), np.asarray(ln.get_ydata(), dtype=float))
    return out


def scatter(ax) -> dict[str, np.ndarray]:
    """``{label: offsets [n, 2]}`` of the point clouds (``scatter``)."""
    from matplotlib.collections import PathCollection

    return {c.get_label(): np.asarray(c.get_offsets(), dtype=float) for c in ax.collections
            if isinstance(c, PathCollection)}


def bars(ax) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``{label: (centres, heights)}`` of each bar container."""
    return {c.get_label(): (np.array([p.get_x() + p.get_width() / 2 for p in c.patches]),
                            np.array([p.get_height() for p in c.patches])) for c in ax.containers
            if hasattr(c, "patches")}


def image(ax) -> np.ndarray:
    """The cells of the one heatmap (``imshow``) of ``ax``."""
    (im,) = ax.get_images()
    return np.ma.filled(np.ma.asarray(im.get_array(), dtype=float), np.nan)


def tick_values(ax, axis: str = "x") -> np.ndarray:
    """The major tick positions inside the axis's limits."""
    a = ax.xaxis if axis == "x" else ax.yaxis
    lo, hi = sorted(ax.get_xlim() if axis == "x" else ax.get_ylim())
    v = np.asarray(a.get_majorticklocs(), dtype=float)
    return v[(v >= lo - 1e-9) & (v <= hi + 1e-9)]


def inset(ax):
    """The induction-window inset of a training-axis panel, or None."""
    found = [c for c in getattr(ax, "child_axes", []) if c.get_gid() == "window-inset"]
    return found[0] if found else None
