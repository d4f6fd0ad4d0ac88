"""Figures across training checkpoints (paper Sec. 5): drawn from the sweep tables of
:mod:`mfpipe.experiments.substitution.substitute` and the kernel-dynamics tables of :mod:`mfpipe.experiments.substitution.kernel_dynamics`.

* :func:`waypoint_figure` -- ``fig:mfgap``: L_model / L_MF, ΔL and D_MF across training checkpoints
* :func:`topn_figure`     -- ``fig:vocab-robustness``: the same for several tracked-set sizes N
* :func:`vocab_mfgap_figure` -- ``fig:vocab-mfgap``: fig:mfgap's panels once per tracked-set size N
* :func:`cka_figure`, :func:`spread_figure` -- the kernel's change across checkpoints (CKA, head spread)

Training steps go on a symmetric-log axis with the induction window shaded and, where the axis crams its checkpoints
into a sliver, shown again in a linear inset (:func:`mfpipe.workflow.plots.step_axis`,
:func:`mfpipe.workflow.plots.shade_window`); the helpers and the atomic writer are those of :mod:`mfpipe.workflow.plots`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from mfpipe.workflow.plots import figure_paths, new_figure, read_table, save_figure, shade_window, step_axis

__all__ = ["waypoint_figure", "topn_figure"]


def waypoint_figure(table, out, png=None, window=None, title: str | None = None) -> tuple[Path, Path]:
    """``fig:mfgap``: top, L_model and L_MF over training steps; bottom, ΔL (left axis) and D_MF (right axis);
    the induction window ``(start, stop)`` shaded. ``table``: :func:`mfpipe.experiments.substitution.substitute.sweep_table`."""
    df = read_table(table).sort_values("step")
    if df["step"].isna().any():
        raise ValueError("the waypoint figure needs a training step for every revision (revisions named step<k>)")
    fig, axes = new_figure(1, 2, w=5.2, h=2.6)
    top, bottom = axes[0, 0], axes[1, 0]
    x = df["step"].to_numpy(float)
    top.plot(x, df["L_model"], "-o", color="#1f77b4", ms=3, label=r"$L_\mathrm{model}$")
    top.plot(x, df["L_MF"], "-o", color="#d62728", ms=3, label=r"$L_\mathrm{MF}$")
    top.set_ylabel("next-token loss (nats)")
    shade_window(top, window)
    top.legend(loc="upper right")
    bottom.plot(x, df["delta_L"], "-o", color="#2ca02c", ms=3, label=r"$\Delta L$")
    bottom.axhline(0.0, color="0.6", lw=0.8)
    bottom.set_ylabel(r"$\Delta L$ (nats)", color="#2ca02c")
    right = bottom.twinx()
    right.plot(x, df["D_MF"], "-s", color="#9467bd", ms=3, label=r"$D_\mathrm{MF}$")
    right.set_ylabel(r"$D_\mathrm{MF}$", color="#9467bd")
    shade_window(bottom, window)
    for ax in (top, bottom):
        step_axis(ax, x, window)
    if title:
        fig.suptitle(title)
    pdf, png = figure_paths(out, png)
    save_figure(fig, pdf, png)
    return pdf, png


# ------------------------------------------------------------------------------ kernel dynamics (Sec. 5.3, App. N)
# cka_figure (fig:cka) and spread_figure (fig:spread); appended here without touching the module header
__all__ += ["cka_figure", "spread_figure"]


def cka_figure(matrix, adjacent, steps, out, png=None, window=None, title: str | None = None) -> tuple[Path, Path]:
    """``fig:cka`` for one model. Left: every-pair linear CKA of W over the checkpoints (``matrix [R, R]``, mean
    over heads). Right: adjacent-checkpoint CKA (``adjacent [R-1]``; pair (i, i+1) plotted at the later step
    ``steps[i+1]``) against the training step on a symlog axis (step 0 at 0), the induction window
    ``(start, stop)`` shaded when given."""
    M = np.asarray(matrix, dtype=float)
    adj = np.asarray(adjacent, dtype=float)
    steps = [int(s) for s in steps]
    R = len(steps)
    if M.shape != (R, R) or adj.shape != (max(R - 1, 0),):
        raise ValueError(f"cka_figure: matrix {M.shape}, adjacent {adj.shape} for {R} steps")
    fig, axes = new_figure(2, 1, w=4.2, h=3.6)
    ax = axes[0, 0]
    finite = M[np.isfinite(M)]
    lo = float(finite.min()) if finite.size else 0.0
    im = ax.imshow(M, cmap="viridis", vmin=min(lo, 0.999), vmax=1.0, origin="upper", interpolation="nearest")
    every = max(1, int(np.ceil(R / 10)))
    ticks = list(range(0, R, every))
    ax.set_xticks(ticks, [str(steps[i]) for i in ticks], rotation=60, ha="right")
    ax.set_yticks(ticks, [str(steps[i]) for i in ticks])
    ax.set_xlabel("checkpoint (step)")
    ax.set_ylabel("checkpoint (step)")
    ax.set_title("CKA of W, every pair of checkpoints")
    fig.colorbar(im, ax=ax, label="linear CKA (mean over heads)", shrink=0.85)
    ax = axes[0, 1]
    shade_window(ax, window)
    ax.plot(steps[1:], adj, color="#1f77b4", marker="o", markersize=4, linewidth=1.6, label="adjacent checkpoints")
    ax.axhline(1.0, color="gray", linestyle=":", linewidth=1)
    ax.set_ylabel("linear CKA with the previous checkpoint")
    ax.set_title("adjacent-checkpoint CKA")
    ax.grid(alpha=0.3)
    if window is not None:
        ax.legend(loc="lower left")
    step_axis(ax, steps, window)
    fig.suptitle(title or "How much the mean-field kernel W changes across training")
    pdf, png = figure_paths(out, png)
    save_figure(fig, pdf, png)
    return pdf, png


def spread_figure(spread, out, png=None, window=None, title: str | None = None) -> tuple[Path, Path]:
    """``fig:spread`` for one model from the row-spread table (columns ``step``, ``layer``, ``head``, ``spread``;
    a path or DataFrame). Plotted as fold-variation ``exp(spread)`` (1 = uniform attention over the types present)
    against the step on a symlog axis. Left: the mean over heads with the interquartile band across heads.
    Right: every head, coloured by layer. The induction window is shaded when given."""
    import matplotlib

    df = read_table(spread)
    df = df[np.isfinite(df["spread"])].copy()
    df["fold"] = np.exp(df["spread"].astype(float))
    steps = np.sort(df["step"].unique())
    g = df.groupby("step")["fold"]
    mean = g.mean().reindex(steps)
    q25, q75 = g.quantile(0.25).reindex(steps), g.quantile(0.75).reindex(steps)
    fig, axes = new_figure(2, 1, w=4.0, h=3.3)
    ax = axes[0, 0]
    shade_window(ax, window)
    ax.fill_between(steps, q25.to_numpy(), q75.to_numpy(), color="#1f77b4", alpha=0.25, lw=0, label="IQR over heads")
    ax.plot(steps, mean.to_numpy(), color="#1f77b4", marker="o", markersize=4, linewidth=1.8, label="mean over heads")
    ax.set_title("mean fold-variation")
    ax.legend(loc="best")
    ax = axes[0, 1]
    shade_window(ax, window)
    layers = sorted(df["layer"].unique())
    cmap = matplotlib.colormaps["viridis"]
    for layer in layers:
        color = cmap(0.0 if len(layers) == 1 else layers.index(layer) / (len(layers) - 1))
        for j, (head, d) in enumerate(df[df["layer"] == layer].groupby("head")):
            d = d.sort_values("step")
            ax.plot(d["step"].to_numpy(), d["fold"].to_numpy(), color=color, linewidth=0.9, alpha=0.8,
                    label=f"layer {layer}" if j == 0 else None, gid=f"L{layer}H{head}")
    ax.set_title("each head (colour: layer)")
    if len(layers) <= 12:
        ax.legend(loc="best", ncol=2 if len(layers) > 6 else 1, fontsize=7)
    for a in axes.flat:
        a.axhline(1.0, color="gray", linestyle=":", linewidth=1)
        a.set_ylabel(r"fold-variation $\exp(\mathrm{mean}_s\,\mathrm{std}_t \log W_{st})$")
        a.grid(alpha=0.3)
        step_axis(a, steps, window)
    fig.suptitle(title or "How evenly each head divides its attention across token types")
    pdf, png = figure_paths(out, png)
    save_figure(fig, pdf, png)
    return pdf, png


def topn_figure(table, out, png=None, window=None, title: str | None = None) -> tuple[Path, Path]:
    """App. M, ``fig:vocab-robustness``: per tracked-set size N, ΔL (left), ΔL normalised to its own final value
    (centre) and D_MF (right) across training. ``table``: :func:`mfpipe.experiments.substitution.substitute.topn_table`."""
    df = read_table(table)
    fig, axes = new_figure(3, 1, w=3.4, h=2.8)
    panels = (("delta_L", r"$\Delta L$ (nats)"), ("delta_L_normalised", r"$\Delta L$ / final $\Delta L$"),
              ("D_MF", r"$D_\mathrm{MF}$"))
    for ax, (col, label) in zip(axes[0], panels):
        for n, g in df.groupby("n_tracked", sort=True):
            g = g.sort_values("step")
            share = g["substituted_share"].iloc[-1]
            ax.plot(g["step"].to_numpy(float), g[col], "-o", ms=3, label=f"N = {n} ({100 * share:.0f}% substituted)")
        ax.set_ylabel(label)
        shade_window(ax, window)
    axes[0, 0].legend(loc="upper left")
    for ax in axes[0]:
        step_axis(ax, df["step"], window)
    if title:
        fig.suptitle(title)
    pdf, png = figure_paths(out, png)
    save_figure(fig, pdf, png)
    return pdf, png


# ------------------------------------------------------------------------------ App. M in fig:mfgap's layout
__all__ += ["vocab_mfgap_figure"]


def vocab_mfgap_figure(table, out, png=None, window=None, title: str | None = None) -> tuple[Path, Path]:
    """App. M, ``fig:vocab-mfgap``: :func:`waypoint_figure`'s panels once per tracked-set size N (columns, N
    ascending), shared axes so columns compare directly. Top: L_model (solid) and L_MF (dashed), the model's final
    loss dotted, each column titled with N and its substitution coverage; bottom: ΔL (left axis) and D_MF (right
    axis); the induction window shaded. ``table``: :func:`mfpipe.experiments.substitution.substitute.topn_table`."""
    df = read_table(table)
    if df["step"].isna().any():
        raise ValueError("the top-N waypoint figure needs a training step for every revision (revisions named step<k>)")
    arms = sorted(df["n_tracked"].unique())
    fig, axes = new_figure(len(arms), 2, w=3.6, h=2.6)
    loss = df[["L_model", "L_MF"]].to_numpy(float)
    lims = {"loss": (np.nanmin(loss), np.nanmax(loss)), "dL": (df["delta_L"].min(), df["delta_L"].max()),
            "D": (df["D_MF"].min(), df["D_MF"].max())}
    pad = lambda lo, hi: (lo - 0.05 * (hi - lo + 1e-12), hi + 0.05 * (hi - lo + 1e-12))  # noqa: E731
    for j, n in enumerate(arms):
        g = df[df["n_tracked"] == n].sort_values("step")
        x = g["step"].to_numpy(float)
        top, bottom = axes[0, j], axes[1, j]
        top.plot(x, g["L_model"], "-o", color="#1f77b4", ms=3, label=r"$L_\mathrm{model}$")
        top.plot(x, g["L_MF"], "--o", color="#d62728", ms=3, mfc="none", label=r"$L_\mathrm{MF}$")
        top.axhline(float(g["L_model"].iloc[-1]), ls=":", color="0.4", lw=0.9)
        top.set_ylim(*pad(*lims["loss"]))
        top.set_title(f"N = {n} ({100 * float(g['substituted_share'].iloc[-1]):.0f}% substituted)")
        bottom.plot(x, g["delta_L"], "-o", color="#2ca02c", ms=3, label=r"$\Delta L$")
        bottom.axhline(0.0, color="0.6", lw=0.8)
        bottom.set_ylim(*pad(*lims["dL"]))
        right = bottom.twinx()
        right.plot(x, g["D_MF"], "-s", color="#9467bd", ms=3, label=r"$D_\mathrm{MF}$")
        right.set_ylim(*pad(*lims["D"]))
        for ax in (top, bottom):
            shade_window(ax, window)
        if j == 0:
            top.set_ylabel("next-token loss (nats)")
            top.legend(loc="upper right")
            bottom.set_ylabel(r"$\Delta L$ (nats)", color="#2ca02c")
        if j == len(arms) - 1:
            right.set_ylabel(r"$D_\mathrm{MF}$", color="#9467bd")
        for ax in (top, bottom):
            step_axis(ax, x, window)
    if title:
        fig.suptitle(title)
    pdf, png = figure_paths(out, png)
    save_figure(fig, pdf, png)
    return pdf, png
