"""Fig. fv: zero-shot transfer per task for each selection × construction, with the zero-shot floor and the
few-shot ceiling, drawn from the transfer table; and the clean-prompt sweep's figure (MFA·r against the number of
clean prompts, AIE's reference lines) from its table (no model)."""

from __future__ import annotations

import numpy as np
import pandas as pd

__all__ = ["plot_transfer", "plot_clean_sweep"]

PIPES = [("AIE", "raw"), ("AIE", "r"), ("MFA", "raw"), ("MFA", "r"), ("raw-magnitude", "r"), ("random", "r")]


def plot_transfer(transfer: pd.DataFrame, path, *, title: str = "", protocol: str = "sum") -> None:
    """Grouped bars (one group per task) of pooled accuracy with Wilson intervals; dashes: zero-shot floor (grey)
    and few-shot ceiling (black)."""
    from mfpipe.workflow.plots import figure_paths, new_figure, save_figure

    tasks = list(dict.fromkeys(transfer["task"]))
    fig, axes = new_figure(1, w=max(4.0, 1.6 * len(tasks) + 2.5), h=3.2)
    ax = axes[0, 0]
    w = 0.8 / len(PIPES)
    colors = ["#4c72b0", "#8fa8d8", "#dd8452", "#f2b88c", "#999999", "#cccccc"]
    for k, (sel, cons) in enumerate(PIPES):
        acc, lo, hi = [], [], []
        for t in tasks:
            r = transfer[(transfer["task"] == t) & (transfer["protocol"] == protocol)
                         & (transfer["selection"] == sel) & (transfer["construction"] == cons)]
            a = float(r["accuracy"].iloc[0]) if len(r) else np.nan
            acc.append(a)
            lo.append(a - float(r["ci_lo"].iloc[0]) if len(r) else 0)
            hi.append(float(r["ci_hi"].iloc[0]) - a if len(r) else 0)
        x = np.arange(len(tasks)) - 0.4 + w * (k + 0.5)
        ax.bar(x, acc, w, yerr=[lo, hi], color=colors[k], label=f"{sel} · {cons}", capsize=2, linewidth=0)
    for prot, style in (("zero-shot", dict(color="0.5", ls="--")), ("few-shot", dict(color="k", ls=":"))):
        for i, t in enumerate(tasks):
            r = transfer[(transfer["task"] == t) & (transfer["protocol"] == prot)]
            if len(r):
                ax.hlines(float(r["accuracy"].iloc[0]), i - 0.45, i + 0.45, lw=1.2,
                          label=prot if i == 0 else None, **style)
    ax.set_xticks(np.arange(len(tasks)), tasks)
    ax.set_ylim(0, 1.02)
    ax.set_ylabel("held-out accuracy")
    ax.set_title(title or "function-vector transfer", fontsize=9)
    ax.legend(fontsize=6, ncol=2, frameon=False, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    save_figure(fig, *figure_paths(path))


def plot_clean_sweep(clean: pd.DataFrame, path, *, title: str = "") -> None:
    """One panel per task: MFA·r's pooled accuracy (Wilson intervals) against the number of clean prompts (log
    axis), a line per injection protocol; dashed: AIE·raw at every clean prompt, in the protocol's colour."""
    from mfpipe.workflow.plots import figure_paths, new_figure, save_figure

    tasks = list(dict.fromkeys(clean["task"]))
    fig, axes = new_figure(len(tasks), w=3.0, h=2.6)
    colors = {"sum": "#4c72b0", "per_head": "#dd8452"}
    for ax, task in zip(axes.flat, tasks):
        for prot, col in colors.items():
            g = clean[(clean["task"] == task) & (clean["protocol"] == prot)].sort_values("n_clean")
            if not len(g):
                continue
            x, y = g["n_clean"].to_numpy(float), g["accuracy"].to_numpy(float)
            ax.errorbar(x, y, yerr=[y - g["ci_lo"].to_numpy(float), g["ci_hi"].to_numpy(float) - y], color=col,
                        marker="o", ms=3, capsize=2, lw=1.2, label=f"MFA·r ({prot})")
            ax.hlines(float(g["AIE_raw"].iloc[0]), x.min(), x.max(), colors=col, linestyles="--", lw=1,
                      label=f"AIE·raw ({prot})")
        ax.set_xscale("log")
        ax.set_xticks(sorted(set(clean["n_clean"])), [str(n) for n in sorted(set(clean["n_clean"]))])
        ax.set_xticks([], minor=True)  # counts: ticks at the sweep's own, no log-axis minor labels between them
        ax.set_ylim(0, 1.02)
        ax.set_xlabel("clean prompts")
        ax.set_title(task, fontsize=9)
    axes.flat[0].set_ylabel("held-out accuracy")
    axes.flat[0].legend(fontsize=6, frameon=False)
    if title:
        fig.suptitle(title, fontsize=9)
    save_figure(fig, *figure_paths(path))
