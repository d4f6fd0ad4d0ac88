"""The cross-model waypoint figure (fig:crossmodel): every model of a run on one axis of training tokens.

Top: L_model (solid, filled markers) and L_MF (dashed, hollow markers) per model, colour and marker shape both
naming the model, as the paper draws it; middle: ΔL; bottom: D_MF. Each model's induction window (in its own
tokens) is shaded in its colour, and shown again in a linear inset where the symlog axis crams the windows'
checkpoints into a sliver (:func:`mfpipe.workflow.plots.step_axis`). Revisions at step 0 sit at the axis' left edge
(symlog, linear up to the first checkpoint's tokens)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from mfpipe.experiments.crossmodel.compare import training_tokens
from mfpipe.workflow.plots import figure_paths, new_figure, read_table, save_figure, step_axis

__all__ = ["crossmodel_figure"]

COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf"]
MARKERS = ["o", "s", "^", "D", "v", "P", "X", "*"]


def crossmodel_figure(models: list[dict], out, png=None, title: str | None = None) -> tuple[Path, Path]:
    """``models``: one dict per model with ``name``, ``table`` (its substitution sweep table: a path or a
    DataFrame), ``tokens_per_step`` and ``window`` (its induction window in steps, or None). A model without
    tokens per step or without steps is left out (the caller logs it); at least one must remain."""
    fig, axes = new_figure(1, 3, w=5.6, h=2.3)
    top, mid, bottom = axes[0, 0], axes[1, 0], axes[2, 0]
    xs = []
    for i, m in enumerate(models):
        df = read_table(m["table"]).sort_values("step")
        x = np.asarray(training_tokens(list(df["step"]), m.get("tokens_per_step")), dtype=float)
        if not np.isfinite(x).all():
            raise ValueError(f"model {m['name']!r}: the cross-model figure needs tokens per step and a step per revision")
        xs.append(x)
        c, mk = COLORS[i % len(COLORS)], MARKERS[i % len(MARKERS)]
        top.plot(x, df["L_model"], "-", marker=mk, color=c, ms=3.5, label=f"{m['name']} $L_\\mathrm{{model}}$")
        top.plot(x, df["L_MF"], "--", marker=mk, color=c, ms=3.5, mfc="none", label=f"{m['name']} $L_\\mathrm{{MF}}$")
        mid.plot(x, df["delta_L"], "-", marker=mk, color=c, ms=3.5, label=m["name"])
        bottom.plot(x, df["D_MF"], "-", marker=mk, color=c, ms=3.5, label=m["name"])
        w = m.get("window")
        if w is not None:
            for ax in (top, mid, bottom):
                ax.axvspan(float(w[0]) * m["tokens_per_step"], float(w[1]) * m["tokens_per_step"], color=c,
                           alpha=0.15, lw=0, zorder=0)
    if not xs:
        raise ValueError("no model to plot")
    allx = np.concatenate(xs)
    first = allx[allx > 0].min() if (allx > 0).any() else 1.0
    top.set_ylabel("loss (nats)")
    top.legend(fontsize=6, ncol=2, loc="best")
    mid.axhline(0.0, color="0.6", lw=0.8)
    mid.set_ylabel(r"$\Delta L$ (nats)")
    bottom.set_ylabel(r"$D_\mathrm{MF}$")
    # the models' windows together, in tokens: one linear inset of them where the symlog axis crams their checkpoints
    spans = [(float(m["window"][0]) * m["tokens_per_step"], float(m["window"][1]) * m["tokens_per_step"])
             for m in models if m.get("window") is not None]
    window = (min(a for a, _ in spans), max(b for _, b in spans)) if spans else None
    for ax, label in ((top, ""), (mid, ""), (bottom, "training tokens (symlog; shaded: each model's induction window)")):
        step_axis(ax, allx, window, label=label, linthresh=float(first))
    if title:
        fig.suptitle(title)
    pdf, png = figure_paths(out, png)
    save_figure(fig, pdf, png)
    return pdf, png
