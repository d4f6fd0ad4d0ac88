"""Figures of the rollout stage, drawn only from its result tables (CSV; :mod:`mfpipe.experiments.rollout.tables`).

Each function takes the table (a path or a DataFrame) and an output stem or the two paths, and writes
the figure as PDF and PNG atomically (a temporary file in the target folder, then a rename). matplotlib is
used through :class:`matplotlib.figure.Figure` with the Agg canvas -- no pyplot, no global backend state.

* :func:`rollout_figure`         -- Figs 3-4 / ``fig:mf-vs-*-full``: the four metrics per depth, one line per kernel
* :func:`teacher_forced_figure`  -- ``fig:tf-attention``: centred cosine and norm ratio per block
* :func:`error_decomposition_figure` -- ``fig:error-decomp``: estimators (a)(b)(c) per block
* :func:`clustering_figure`      -- ``fig:clustering``: relative RMS, eta^2 / eta^2_z, value-map Jensen gap
* :func:`cross_corpus_figure`    -- ``fig:heat``: statistics corpus x evaluation corpus, cross-layer cosine
* :func:`divergence_figure`      -- App. llama: per-step amplification, curvature, centred magnitude, per-token tail

The plumbing every experiment's figures share (style, paths, the atomic writer) is :mod:`mfpipe.workflow.plots`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from mfpipe.experiments.rollout.tables import DEFAULT_KERNELS
from mfpipe.workflow.plots import figure_paths, integer_ticks, new_figure, plain_log_axis, read_table, save_figure

__all__ = [
    "save_figure",
    "rollout_figure",
    "teacher_forced_figure",
    "error_decomposition_figure",
    "clustering_figure",
    "cross_corpus_figure",
    "divergence_figure",
]

METRIC_LABELS = {
    "cosine": "centered cosine",
    "rsa": "RSA",
    "rel_error": "centered relative error",
    "norm_ratio": "centered norm ratio",
}
KERNEL_ORDER = DEFAULT_KERNELS  # Table 1 rows in the paper's order
KERNEL_LABELS = {"mean_field": "mean field", "context_free": "context-free",
                 "context_free_kernel": "context-free kernel, MF start"}
KERNEL_STYLE = {  # color, marker
    "mean_field": ("#000000", "o"),
    "context_free": ("#1f77b4", "s"),
    "cooc": ("#2ca02c", "^"),
    "meanq": ("#ff7f0e", "v"),
    "uniform": ("#9467bd", "D"),
    "rowshuffle": ("#d62728", "x"),
    "P0only": ("#8c564b", "P"),
    "Pavg": ("#e377c2", "*"),
}
ESTIMATOR_LABELS = {
    "a": "(a) exact attention, MLP at centroid",
    "b": r"(b) + value map at centroid, unconditional $\mu_t$",
    "c": "(c) full mean field",
}


def _x(df: pd.DataFrame, key: str, frac: bool):
    return (df["frac_depth"] if frac else df[key]).to_numpy()


def _xlabel(key: str, frac: bool) -> str:
    if frac:
        return "fractional depth"
    return "layer (residual depth)" if key == "depth" else "block (layer)"


def _style_axis(ax, metric: str, xkey: str, xvalues, frac: bool, ylabel_suffix: str = "") -> None:
    """The labels, title and grid every per-layer metric panel shares (integer ticks unless fractional depth)."""
    ax.set_xlabel(_xlabel(xkey, frac))
    ax.set_ylabel(METRIC_LABELS[metric] + ylabel_suffix)
    ax.set_title(METRIC_LABELS[metric])
    ax.grid(alpha=0.3)
    if not frac:
        integer_ticks(ax, "x", xvalues)


def rollout_figure(scores, out, png=None, title: str | None = None, frac: bool = False,
                   kernels: Sequence[str] | None = None) -> tuple[Path, Path]:
    """Four panels (centred cosine, RSA, centred relative error, centred norm ratio) against depth, one line
    per kernel (mean field bold; pinned variants dashed). ``scores``: the ``run_rollouts`` table."""
    df = read_table(scores)
    if "pinned" not in df:
        df["pinned"] = False
    df["pinned"] = df["pinned"].astype(str).str.lower().isin(("true", "1"))
    names = [k for k in KERNEL_ORDER if k in set(df["kernel"])] + sorted(set(df["kernel"]) - set(KERNEL_ORDER))
    if kernels is not None:
        names = [k for k in names if k in kernels]
    fig, axes = new_figure(2, 2)
    for ax, metric in zip(axes.flat, ("cosine", "rsa", "rel_error", "norm_ratio")):
        sub = df[df["metric"] == metric]
        for k in names:
            color, marker = KERNEL_STYLE.get(k, (None, "."))
            for pinned in (False, True):
                d = sub[(sub["kernel"] == k) & (sub["pinned"] == pinned)].sort_values("depth")
                if d.empty:
                    continue
                label = KERNEL_LABELS.get(k, k) + (" (pinned)" if pinned else "")
                ax.plot(_x(d, "depth", frac), d["value"], color=color, marker=marker, markersize=4,
                        linestyle="--" if pinned else "-", linewidth=2.2 if k == "mean_field" else 1.2,
                        label=label, zorder=3 if k == "mean_field" else 2)
        if metric == "norm_ratio":
            ax.axhline(1.0, color="gray", linestyle=":", linewidth=1)
        if metric == "rel_error":
            ax.axhline(0.0, color="gray", linestyle=":", linewidth=1)
        _style_axis(ax, metric, "depth", sub["depth"], frac)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=min(4, max(1, len(labels))), frameon=False)
    fig.suptitle(title or "Open-loop mean-field rollout vs alternative kernels (held-out centroids)")
    pdf, png = figure_paths(out, png)
    save_figure(fig, pdf, png)
    return pdf, png


def teacher_forced_figure(table, out, png=None, title: str | None = None, frac: bool = False) -> tuple[Path, Path]:
    """``fig:tf-attention``: centred cosine and centred norm ratio of the predicted attention-block output
    ``sum_h zhat`` vs the measured ``sum_h zbar`` per block (dotted: zero error)."""
    df = read_table(table)
    fig, axes = new_figure(2, 1)
    groups = [(None, df)] if "model" not in df or df["model"].nunique() == 1 else list(df.groupby("model"))
    for ax, metric, ideal in ((axes[0, 0], "cosine", 1.0), (axes[0, 1], "norm_ratio", 1.0)):
        for name, g in groups:
            d = g[g["metric"] == metric].sort_values("layer")
            ax.plot(_x(d, "layer", frac), d["value"], marker="o", linewidth=1.6, label=name or "mean field")
        ax.axhline(ideal, color="gray", linestyle=":", linewidth=1)
        _style_axis(ax, metric, "layer", df["layer"], frac)
    if len(groups) > 1:
        axes[0, 0].legend()
    fig.suptitle(title or r"Teacher-forced $\sum_h \hat z_s^{h}$ vs measured $\sum_h \bar z_s^{h}$")
    pdf, png = figure_paths(out, png)
    save_figure(fig, pdf, png)
    return pdf, png


def error_decomposition_figure(table, out, png=None, title: str | None = None, frac: bool = False
                               ) -> tuple[Path, Path]:
    """``fig:error-decomp``: the three nested per-block predictions of ``c^{l+1}`` from the true ``c^l``
    scored against the held-out ``c^{l+1}`` (centred cosine and centred relative error)."""
    df = read_table(table)
    fig, axes = new_figure(2, 1)
    colors = {"a": "#1b9e77", "b": "#d95f02", "c": "#7570b3"}
    for ax, metric in ((axes[0, 0], "cosine"), (axes[0, 1], "rel_error")):
        for est in ("a", "b", "c"):
            d = df[(df["estimator"] == est) & (df["metric"] == metric)].sort_values("layer")
            if d.empty:
                continue
            # the table says which value means its (b) used (pass 2's or the unconditional ones)
            own = d["label"].iloc[0] if "label" in d else None
            label = own if isinstance(own, str) else ESTIMATOR_LABELS[est]
            ax.plot(_x(d, "layer", frac), d["value"], marker="os^"["abc".index(est)], color=colors[est],
                    linewidth=1.6, label=label)
        ax.axhline(1.0 if metric == "cosine" else 0.0, color="gray", linestyle=":", linewidth=1)
        _style_axis(ax, metric, "layer", df["layer"], frac, ylabel_suffix=r" vs $c^{\ell+1}$")
    handles, labels = axes[0, 0].get_legend_handles_labels()  # one a row: the (b) label names its value means
    fig.legend(handles, labels, loc="outside lower center", ncol=1, frameon=False)
    fig.suptitle(title or "Per-layer error accounting (teacher-forced from the true centroids)")
    pdf, png = figure_paths(out, png)
    save_figure(fig, pdf, png)
    return pdf, png


def clustering_figure(table, out, png=None, title: str | None = None, frac: bool = False) -> tuple[Path, Path]:
    """``fig:clustering``: (A) relative RMS deviation of occurrences about their type centroid (median, IQR
    band over types); (B) eta^2 raw (gray) and per-dimension z-scored (blue); (C) the value-map Jensen gap
    of the attention-input norm, relative magnitude (green) and direction 1 - cos (purple), log scale."""
    df = read_table(table).sort_values("depth")
    x = _x(df, "depth", frac)
    fig, axes = new_figure(3, 1, w=3.4)
    ax = axes[0, 0]
    ax.fill_between(x, df["rel_rms_q25"], df["rel_rms_q75"], color="#1f77b4", alpha=0.25, label="IQR over types")
    ax.plot(x, df["rel_rms_median"], color="#1f77b4", marker="o", label="median")
    ax.set_ylabel(r"$\sqrt{E\|x-c_t\|^2}\,/\,\|c_t\|$")
    ax.set_title("(A) relative RMS deviation")
    ax.legend()
    ax = axes[0, 1]
    ax.plot(x, df["eta2"], color="gray", marker="o", label=r"$\eta^2$ (raw)")
    ax.plot(x, df["eta2_z"], color="#1f77b4", marker="s", label=r"$\eta^2_z$ (z-scored)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_ylabel("variance explained by type")
    ax.set_title(r"(B) $\eta^2$ and $\eta^2_z$")
    ax.legend()
    ax = axes[0, 2]
    j = df[np.isfinite(df["jensen_rel_median"])]
    xj = _x(j, "depth", frac)
    any_pos = False
    for k, color, label in (("rel", "#2ca02c", "relative magnitude"), ("dir", "#9467bd", r"direction $1-\cos$")):
        med = j[f"jensen_{k}_median"].to_numpy()
        ax.fill_between(xj, j[f"jensen_{k}_q25"], j[f"jensen_{k}_q75"], color=color, alpha=0.2)
        ax.plot(xj, med, color=color, marker="o", label=label)
        any_pos |= bool((med > 0).any())
    if any_pos:
        ax.set_yscale("symlog", linthresh=1e-6)
    ax.set_ylabel(r"$\ln_1$ Jensen gap")
    ax.set_title("(C) value-map Jensen gap")
    ax.legend()
    for a in axes.flat:
        a.set_xlabel(_xlabel("depth", frac))
        a.grid(alpha=0.3)
        if not frac:
            integer_ticks(a, "x", df["depth"])
    fig.suptitle(title or "Same-type occurrences and their type centroids")
    pdf, png = figure_paths(out, png)
    save_figure(fig, pdf, png)
    return pdf, png


def cross_corpus_figure(summary, out, png=None, title: str | None = None, metric: str = "cosine"
                        ) -> tuple[Path, Path]:
    """``fig:heat``: rows = corpus supplying the statistics, columns = corpus supplying the evaluation
    centroids, cell = cross-layer mean of ``metric``; diagonal cells in bold; a context-free row (the
    corpus-free baseline) last if present."""
    df = read_table(summary)
    cols = list(dict.fromkeys(df["eval_corpus"]))
    rows = [r for r in dict.fromkeys(df["stats_corpus"]) if r != "context-free"]
    rows += ["context-free"] if "context-free" in set(df["stats_corpus"]) else []
    idx = df.set_index(["stats_corpus", "eval_corpus"])[metric]
    M = np.array([[idx.get((r, c), np.nan) for c in cols] for r in rows], dtype=float)
    fig, axes = new_figure(1, 1, w=1.6 * len(cols) + 2.6, h=0.8 * len(rows) + 1.8)
    ax = axes[0, 0]
    cmap = "viridis" if metric in ("cosine", "rsa") else "viridis_r"
    im = ax.imshow(M, cmap=cmap, aspect="auto")
    lo, hi = np.nanmin(M), np.nanmax(M)
    for i, r in enumerate(rows):
        for j, c in enumerate(cols):
            if not np.isfinite(M[i, j]):
                continue
            light = (M[i, j] - lo) / (hi - lo + 1e-12) < 0.5
            if metric not in ("cosine", "rsa"):
                light = not light
            ax.text(j, i, f"{M[i, j]:.3f}", ha="center", va="center", color="white" if light else "black",
                    fontweight="bold" if r == c else "normal", fontstyle="italic" if r == "context-free" else "normal")
    ax.set_xticks(range(len(cols)), cols, rotation=20, ha="right")
    ax.set_yticks(range(len(rows)), rows)
    ax.set_xlabel("corpus of the evaluation centroids (held-out half)")
    ax.set_ylabel("corpus of the mean-field statistics")
    fig.colorbar(im, ax=ax, label=f"cross-layer mean {METRIC_LABELS.get(metric, metric)}")
    ax.set_title(title or "Mean-field rollout across corpora")
    pdf, png = figure_paths(out, png)
    save_figure(fig, pdf, png)
    return pdf, png


def curve_rows(scores, metric: str = "cosine") -> tuple[pd.DataFrame, pd.DataFrame]:
    """``fig:curves``'s two rows from the cross-corpus scores (long table of
    :func:`mfpipe.experiments.rollout.runs.cross_corpus`): (replication, generalization), each ``stats_corpus,
    eval_corpus, depth, frac_depth, value`` of ``metric``. Replication: the diagonal, statistics and evaluation on
    the same corpus. Generalization: every statistics corpus (and the context-free baseline) against the primary
    corpus's centroids, the primary being the first evaluation corpus of the table (the job writes it first)."""
    df = read_table(scores)
    df = df[df["metric"] == metric]
    cols = ["stats_corpus", "eval_corpus", "depth", "frac_depth", "value"]
    primary = df["eval_corpus"].iloc[0]
    rep = df[df["stats_corpus"] == df["eval_corpus"]][cols].reset_index(drop=True)
    gen = df[df["eval_corpus"] == primary][cols].reset_index(drop=True)
    return rep, gen


def curves_figure(scores, out, png=None, title: str | None = None, metric: str = "cosine") -> tuple[Path, Path]:
    """``fig:curves``: per-layer rollout quality by fractional depth. Top: replication (statistics = evaluation
    corpus), one curve per corpus. Bottom: generalization (statistics from each corpus, evaluated against the
    primary corpus's centroids), the context-free baseline dashed."""
    rep, gen = curve_rows(scores, metric)
    primary = gen["eval_corpus"].iloc[0]
    fig, axes = new_figure(1, 2, w=4.6, h=2.8)
    for ax, df, label in ((axes[0, 0], rep, "replication (stats = eval corpus)"),
                          (axes[1, 0], gen, f"generalization (eval: {primary})")):
        for corpus, g in df.groupby("stats_corpus", sort=False):
            g = g.sort_values("frac_depth")
            base = corpus == "context-free"
            ax.plot(g["frac_depth"], g["value"], "--" if base else "-o", ms=3, color="0.4" if base else None,
                    label=f"stats: {corpus}")
        ax.set_title(label)
        ax.set_ylabel(METRIC_LABELS.get(metric, metric))
        ax.legend(fontsize=7)
    axes[1, 0].set_xlabel("fractional depth")
    fig.suptitle(title or "Per-layer rollout quality across corpora")
    pdf, png = figure_paths(out, png)
    save_figure(fig, pdf, png)
    return pdf, png


__all__ += ["curve_rows", "curves_figure"]  # fig:curves (per-layer quality by fractional depth, App. G)


def divergence_figure(steps, curvature, tokens, magnitude, out, png=None, title: str | None = None
                      ) -> tuple[Path, Path]:
    """App. llama: (A) per-step amplification of the incoming error by the attention update, the MLP and the block;
    (B) the curvature test at the block of largest amplification, real and random error against alpha; (C) the
    predicted over the true centred magnitude by depth; (D) per-token amplification per block (median, 99th
    percentile, max). Drawn from the divergence tables only."""
    st = read_table(steps).sort_values("layer")
    cu, tk, mg = read_table(curvature), read_table(tokens).sort_values("layer"), read_table(magnitude)
    fig, axes = new_figure(4, 1, w=3.4)
    ax = axes[0, 0]
    for col, color, label in (("amp_attention", "#1f77b4", "attention update"), ("amp_mlp", "#d62728", "MLP"),
                              ("amp_block", "#000000", "block")):
        ax.plot(st["layer"], st[col], marker="o", color=color, label=label)
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.set_xlabel("block")
    integer_ticks(ax, "x", st["layer"])
    ax.set_ylabel(r"$\|e_{out}\|/\|e_{in}\|$")
    ax.set_title("(A) per-step amplification")
    ax.legend()
    ax = axes[0, 1]
    a = st["amp_block"].to_numpy(dtype=float)
    if np.isfinite(a).any():
        peak = int(st["layer"].iloc[int(np.nanargmax(a))])
        c = cu[cu["layer"] == peak].sort_values("alpha")
        ax.plot(c["alpha"], c["amp_real"], marker="o", color="#000000", label="real error")
        ax.plot(c["alpha"], c["amp_random"], marker="s", color="#ff7f0e", label="random, same norms")
        ax.set_xscale("log")
        alphas = sorted(set(c["alpha"].astype(float)))  # ticks at the scales tested, as plain numbers
        ax.set_xticks(alphas, [f"{a:g}" for a in alphas])
        ax.set_xticks([], minor=True)
        ax.set_title(f"(B) curvature test, block {peak}")
        ax.legend()
    ax.set_xlabel(r"$\alpha$")
    ax.set_ylabel("amplification")
    ax = axes[0, 2]
    ax.plot(mg["depth"], mg["ratio"], marker="o", color="#2ca02c")
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.set_xlabel("depth")
    integer_ticks(ax, "x", mg["depth"])
    ax.set_ylabel("predicted / true centred RMS")
    ax.set_title("(C) centred magnitude")
    ax = axes[0, 3]
    for col, style in (("median", "-o"), ("p99", "--s"), ("max", ":^")):
        ax.plot(tk["layer"], tk[col], style, color="#9467bd", label=col)
    ax.set_yscale("log")
    plain_log_axis(ax, "y", tk[["median", "p99", "max"]].to_numpy())
    ax.set_xlabel("block")
    integer_ticks(ax, "x", tk["layer"])
    ax.set_ylabel("per-token amplification")
    ax.set_title("(D) per-token tail")
    ax.legend()
    for x in axes.flat:
        x.grid(alpha=0.3)
    fig.suptitle(title or "Rollout divergence")
    pdf, png = figure_paths(out, png)
    save_figure(fig, pdf, png)
    return pdf, png
