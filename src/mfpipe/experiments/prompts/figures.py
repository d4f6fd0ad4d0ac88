"""Figures of the prompt experiments (paper Sec. 6.1-6.2, App. O), drawn by the figure rules from the tables the
forward-pass jobs wrote (no model, no torch): Fig. icl (per-prompt ΔL_perm against D_MF by class) and Fig. icl-meter
(loss and deviation along repeated chunks)."""

from __future__ import annotations

from mfpipe.experiments.prompts.sets import ordered_classes
from mfpipe.workflow.plots import figure_paths, integer_ticks, new_figure, read_table, save_figure

__all__ = ["icl_figure", "meter_figure"]


CLASS_STYLE = {"induction": ("#d62728", "o"), "few-shot": ("#ff7f0e", "s"), "natural": ("#1f77b4", "^"),
               "random": ("#7f7f7f", "x")}


def icl_figure(df, out, png=None, title: str | None = None):
    """Fig. icl: per-prompt ΔL_perm against D_MF, coloured by class, from the per-prompt table (a DataFrame or its
    CSV). Returns (pdf, png)."""
    df = read_table(df)
    pdf, png = figure_paths(out, png)
    fig, axes = new_figure(1, w=5.0, h=3.8)
    ax = axes[0, 0]
    for c in ordered_classes(df):
        s = df[df["cls"] == c]
        color, marker = CLASS_STYLE.get(c, (None, "o"))
        ax.scatter(s["D_MF"], s["delta_L_perm"], s=14, c=color, marker=marker, alpha=0.75, label=f"{c} (n={len(s)})")
    ax.axhline(0.0, color="k", lw=0.6, alpha=0.5)
    ax.set_xlabel(r"mean-field deviation $D_{\mathrm{MF}}$")
    ax.set_ylabel(r"$\Delta L_{\mathrm{perm}}$ (nats)")
    ax.grid(alpha=0.3)
    ax.legend(loc="best")
    if title:
        ax.set_title(title)
    save_figure(fig, pdf, png)
    return pdf, png


def meter_figure(curves, bins, summary, out, png=None,
                 title: str | None = None):
    """Fig. icl-meter: (left) loss and D_MF by position, the copy boundary dashed; (middle) the top-rising head's D
    by position; (right) in-context loss reduction binned by deviation rise (mean ± s.e.m.). Each table a DataFrame or
    its CSV. Returns (pdf, png)."""
    curves, bins, summary = read_table(curves), read_table(bins), read_table(summary)
    pdf, png = figure_paths(out, png)
    s = summary.iloc[0]
    kk = int(s["k"])
    fig, axes = new_figure(3, w=3.8, h=3.0)
    ax = axes[0, 0]
    c = curves[curves["position"] > 0]
    ax.plot(c["position"], c["loss"], color="#d62728", lw=1.0, label="next-token loss")
    ax.set_xlabel("query position")
    ax.set_ylabel("loss (nats)", color="#d62728")
    ax2 = ax.twinx()
    ax2.plot(c["position"], c["D_MF"], color="#1f77b4", lw=1.0, label=r"$D_{\mathrm{MF}}$")
    ax2.set_ylabel(r"$D_{\mathrm{MF}}$", color="#1f77b4")
    for a in (axes[0, 0], axes[0, 1]):
        a.axvline(kk + 0.5, color="k", ls="--", lw=0.8)
        a.grid(alpha=0.3)
        integer_ticks(a, "x")  # query positions
    ax = axes[0, 1]
    ax.plot(c["position"], c["top_head_D"], color="#2ca02c", lw=1.0)
    ax.set_xlabel("query position")
    ax.set_ylabel(f"$D$ of L{int(s['top_layer'])}H{int(s['top_head'])}")
    ax.set_title(f"top-rising head L{int(s['top_layer'])}H{int(s['top_head'])}")
    ax = axes[0, 2]
    ax.errorbar(bins["rise_mean"], bins["loss_reduction_mean"], yerr=bins["loss_reduction_sem"].fillna(0.0),
                fmt="o-", color="k", ms=3, lw=1.0, capsize=2)
    ax.axhline(0.0, color="k", lw=0.5, alpha=0.5)
    ax.set_xlabel(r"deviation rise $D_{\mathrm{MF}}(2) - D_{\mathrm{MF}}(1)$")
    ax.set_ylabel("in-context loss reduction (nats)")
    ax.set_title(rf"Spearman $\rho$ = {s['spearman_rho']:.2f} (n={int(s['n_pairs'])})")
    ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    save_figure(fig, pdf, png)
    return pdf, png
