"""Rollout tables (paper Sec. 4, Table 1 and its kin; App. F): cross-layer summaries of the long score tables,
display labels in the paper's spelling, the claim check and the Markdown renderings. Pure pandas."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import pandas as pd

from mfpipe.experiments.rollout import metrics as M

#: Table 1 rows in paper order. ``context_free`` is no kernel: it is the model's own residual at position 1 of
#: ``[BOS, t]`` (:func:`mfpipe.experiments.rollout.algorithm.context_free_residuals`), scored like a rollout's prediction.
DEFAULT_KERNELS: tuple[str, ...] = ("mean_field", "context_free", "cooc", "meanq", "uniform", "rowshuffle", "P0only",
                                    "Pavg")
#: display names (paper spelling)
BASELINE_LABELS: dict[str, str] = {
    "mean_field": "Mean field",
    "context_free": "Context-free",
    "context_free_kernel": "Context-free kernel, mean-field start",
    "cooc": "cooc",
    "meanq": "meanq",
    "uniform": "uniform",
    "rowshuffle": "rowshuffle",
    "P0only": "P0only",
    "Pavg": "Pavg",
}


METRIC_LABELS: dict[str, str] = {
    "cosine": "centered cosine",
    "rsa": "RSA",
    "rel_error": "centered rel. error",
    "norm_ratio": "centered norm ratio",
}
_BETTER = {"cosine": "max", "rsa": "max", "rel_error": "min", "norm_ratio": "one"}
#: Sec. 4.3 estimators; (b) is labelled for what it computes (unconditional mu_t for E_s[vbar_t])
ESTIMATORS = {"a": "(a) exact attention, MLP at centroid",
              "b": "(b) + value map at centroid, unconditional value means mu_t",
              "b_pass2": "(b) + value map at centroid, covariance kept (E_s[vbar_t] from pass 2)",
              "c": "(c) full mean field"}


# ------------------------------------------------------------------------------------------- summaries
def layer_summary(df: pd.DataFrame, by: Sequence[str], counts: Sequence[str] = ()) -> pd.DataFrame:
    """Per group of ``by`` (those present in ``df``): ``n_layers`` (the depths with a finite score, those averaged), the maximum of each ``counts`` column present,
    then the cross-layer mean and standard error over layers of every metric (``<metric>``, ``<metric>_se``:
    SE = std(ddof=1)/sqrt(n_layers), NaN for one layer), from a long table ``metric, value`` by ``depth`` (or
    per-block ``layer``). Groups keep their order of first appearance."""
    by = [g for g in by if g in df.columns]
    key = "depth" if "depth" in df else "layer"
    rows = []
    for name, sub in df.groupby(by, sort=False):
        name = name if isinstance(name, tuple) else (name,)
        row = dict(zip(by, name))
        row["n_layers"] = int(sub.loc[np.isfinite(sub["value"]), key].nunique())  # averaged: the finite ones
        for k in counts:
            if k in sub:
                row[k] = int(sub[k].max())
        for m in M.METRICS:
            v = sub.loc[sub["metric"] == m].sort_values(key)["value"].to_numpy()
            row[m], row[f"{m}_se"] = M.cross_layer_summary(v)
        rows.append(row)
    return pd.DataFrame(rows)


def _ordered(values: Iterable[str], order: Sequence[str]) -> list[str]:
    vals = list(dict.fromkeys(values))
    return [v for v in order if v in vals] + [v for v in vals if v not in order]


def rollout_summary(df: pd.DataFrame, group: Sequence[str] = ("kernel", "pinned")) -> pd.DataFrame:
    """Table 1: per kernel (and pinning), the cross-layer mean and standard error over layers of every
    metric (:func:`layer_summary`), kernels in the paper's order."""
    out = layer_summary(df, group, counts=("n_types", "n_pinned"))
    if "kernel" in out:
        order = {k: i for i, k in enumerate(_ordered(out["kernel"], DEFAULT_KERNELS))}
        out = out.sort_values(["pinned", "kernel"] if "pinned" in out else ["kernel"],
                              key=lambda s: s.map(order) if s.name == "kernel" else s, kind="stable")
    return out.reset_index(drop=True)


def per_layer_summary(df: pd.DataFrame, by: str) -> pd.DataFrame:
    """Cross-layer mean and SE of each metric per value of ``by`` (e.g. ``estimator``)."""
    return layer_summary(df, [by])


def cross_corpus_summary(df: pd.DataFrame) -> pd.DataFrame:
    """Per (statistics corpus, evaluation corpus): cross-layer mean and SE of every metric."""
    return layer_summary(df, ["stats_corpus", "eval_corpus"], counts=("n_types",))


def claim_check(summary: pd.DataFrame, reference: str = "mean_field", tol: float = 1e-9) -> dict[str, Any]:
    """Is the mean field best on both metrics of Table 1 (cross-layer centred cosine: highest; relative
    error: lowest) among the unpinned kernels? Per metric: the reference value, the best other kernel, the
    kernels tied with the reference (within ``tol``; e.g. ``P0only`` and ``Pavg`` ARE ``P`` when L = 1) and
    ``holds`` (no other kernel better, and at least one not tied); ``holds`` overall = both metrics."""
    s = summary[~summary["pinned"].astype(bool)] if "pinned" in summary else summary
    s = s.set_index("kernel")
    if reference not in s.index or len(s) < 2:
        return {"holds": None}
    out: dict[str, Any] = {}
    for m, sign in (("cosine", 1.0), ("rel_error", -1.0)):
        others = s.drop(index=reference)[m].dropna()
        ref = float(s.loc[reference, m])
        gain = sign * (ref - others)  # > 0: the mean field is better
        ties = sorted(gain.index[gain.abs() <= tol])
        rest = gain.drop(index=ties)
        best = (others.idxmax() if sign > 0 else others.idxmin()) if rest.empty else \
            (others.loc[rest.index].idxmax() if sign > 0 else others.loc[rest.index].idxmin())
        ok = bool((gain >= -tol).all() and not rest.empty and (rest > 0).all())
        out[m] = {"mean_field": ref, "best_baseline": best, "best_baseline_value": float(others.loc[best]),
                  "ties": ties, "holds": ok}
    out["holds"] = all(out[m]["holds"] for m in ("cosine", "rel_error"))
    return out


def _fmt(v: float, se: float | None = None, digits: int = 3) -> str:
    if v is None or not np.isfinite(v):
        return "–"
    s = f"{v:.{digits}f}"
    if se is not None and np.isfinite(se):
        s += f" ({se:.{digits}f})"
    return s


def summary_markdown(summary: pd.DataFrame, title: str | None = None) -> str:
    """Table 1 as Markdown: ``mean (SE over layers)`` per metric, the best value per metric in bold, then a
    one-line check of the paper's central claim."""
    s = summary.copy()
    best = {}
    base = s[~s["pinned"]] if "pinned" in s else s
    for m, b in _BETTER.items():
        col = base[m].dropna()
        if col.empty:
            continue
        best[m] = col.max() if b == "max" else col.min() if b == "min" else col.iloc[(col - 1).abs().argmin()]
    head = ["kernel"] + [METRIC_LABELS[m] for m in M.METRICS]
    lines = []
    if title:
        lines += [f"**{title}**", ""]
    lines += ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * len(M.METRICS)) + "|"]
    for _, r in s.iterrows():
        name = BASELINE_LABELS.get(r["kernel"], r["kernel"])
        if r.get("pinned", False):
            name += f" (pinned, {int(r['n_pinned'])} dims)" if "n_pinned" in r else " (pinned)"
        cells = []
        for m in M.METRICS:
            c = _fmt(r[m], r[f"{m}_se"])
            if not r.get("pinned", False) and m in best and np.isfinite(r[m]) and r[m] == best[m]:
                c = f"**{c}**"
            cells.append(c)
        lines.append("| " + " | ".join([name] + cells) + " |")
    n_layers = int(s["n_layers"].max()) if "n_layers" in s and len(s) else 0
    n_types = int(s["n_types"].max()) if "n_types" in s and len(s) else 0
    lines += ["", f"Cross-layer mean (standard error over {n_layers} layer(s)) of the rollout scored against the "
                  f"held-out centroids of {n_types} tracked types; best unpinned value per metric in bold "
                  "(norm ratio: closest to 1)."]
    chk = claim_check(summary)
    if chk.get("holds") is not None:
        parts = []
        for m in ("cosine", "rel_error"):
            c = chk[m]
            tie = f"; identical: {', '.join(c['ties'])}" if c["ties"] else ""
            parts.append(f"{METRIC_LABELS[m]} {c['mean_field']:.3f} vs best other kernel "
                         f"{BASELINE_LABELS.get(c['best_baseline'], c['best_baseline'])} "
                         f"{c['best_baseline_value']:.3f} ({'holds' if c['holds'] else 'does not hold'}{tie})")
        note = ""
        if any(chk[m]["ties"] for m in ("cosine", "rel_error")) and n_layers == 1:
            note = " With one layer P0only and Pavg are the mean field itself."
        lines += ["", f"Mean field strictly best on both metrics against every other kernel that differs from it: "
                      f"**{'yes' if chk['holds'] else 'no'}** — " + "; ".join(parts) + "." + note]
    return "\n".join(lines) + "\n"


def error_decomposition_markdown(ed: pd.DataFrame, tag: str) -> str:
    """The per-layer and cross-layer tables of :func:`error_decomposition_table`, estimators by label."""
    # the labels the table carries ((b) says which value means it used), else the default ones
    labels = dict(ESTIMATORS, **dict(zip(ed["estimator"], ed["label"]))) if "label" in ed else ESTIMATORS
    wide = long_to_wide(ed, "layer", by="estimator")
    wide["estimator"] = wide["estimator"].map(labels)
    md = wide_markdown(wide, "estimator", ["layer", "cosine", "rsa", "rel_error", "norm_ratio"],
                       title=f"Per-layer error accounting, estimators (a)(b)(c) vs held-out c^(l+1): {tag}")
    summ = per_layer_summary(ed, "estimator")
    summ["estimator"] = summ["estimator"].map(labels)
    md += "\n" + wide_markdown(summ, "estimator", ["cosine", "cosine_se", "rel_error", "rel_error_se"],
                               title="Cross-layer mean (SE over layers)")
    b = ("(b) uses the type-conditional value means E_s[vbar_t] of pass 2 (the paper's (b)): the value-query "
         "covariance is kept." if labels.get("b") == ESTIMATORS["b_pass2"] else
         "(b) uses the unconditional value means mu_t in place of the paper's E_s[vbar_t] (no pass-2 store), so it "
         "also assumes value-query independence.")
    md += f"\nInputs (P, c^l, zbar, mu) from the statistics half; truth c^(l+1) from the evaluation half. {b}\n"
    return md


def matrix_markdown(summary: pd.DataFrame, metric: str = "cosine", title: str | None = None) -> str:
    """The App. G matrix (rows: statistics corpus, columns: evaluation corpus) of one metric, diagonal bold."""
    cols = list(dict.fromkeys(summary["eval_corpus"]))
    rows = list(dict.fromkeys(summary["stats_corpus"]))
    rows = [r for r in rows if r != "context-free"] + [r for r in rows if r == "context-free"]
    idx = summary.set_index(["stats_corpus", "eval_corpus"])
    lines = [f"**{title}**", ""] if title else []
    lines += ["| statistics \\ eval | " + " | ".join(cols) + " |", "|---|" + "|".join("---:" for _ in cols) + "|"]
    for r in rows:
        cells = []
        for c in cols:
            if (r, c) not in idx.index:
                cells.append("–")
                continue
            v = idx.loc[(r, c)]
            s = _fmt(v[metric], v[f"{metric}_se"])
            cells.append(f"**{s}**" if r == c else (f"*{s}*" if r == "context-free" else s))
        lines.append(f"| {r} | " + " | ".join(cells) + " |")
    lines += ["", f"Cross-layer mean (SE over layers) of the {METRIC_LABELS.get(metric, metric)}: mean-field "
                  "rollout with the row corpus's statistics scored against the column corpus's held-out centroids; "
                  "diagonal in bold; *context-free*: the corpus-free baseline."]
    return "\n".join(lines) + "\n"


def wide_markdown(df: pd.DataFrame, index: str, columns: Sequence[str], title: str | None = None,
                  digits: int = 3) -> str:
    """A simple Markdown table of ``df[[index, *columns]]`` (floats to ``digits``); a hybrid's ``layer_kind`` follows
    its ``layer`` (which layers have no attention reading)."""
    columns = list(columns)
    if "layer_kind" in df and "layer_kind" not in columns and "layer" in (index, *columns):
        columns.insert(columns.index("layer") + 1 if "layer" in columns else 0, "layer_kind")
    lines = [f"**{title}**", ""] if title else []
    lines += ["| " + " | ".join([index, *columns]) + " |", "|" + "|".join("---" for _ in range(len(columns) + 1)) + "|"]
    for _, r in df.iterrows():
        cells = [str(r[index])]
        for c in columns:
            v = r[c]
            cells.append(_fmt(float(v), digits=digits) if isinstance(v, (float, np.floating)) else str(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def long_to_wide(df: pd.DataFrame, key: str, by: str | None = None) -> pd.DataFrame:
    """``metric``/``value`` long rows -> one column per metric (``by`` columns kept, and a hybrid's ``layer_kind``
    with its rows of no reading: all NaN, which the pivot alone would drop)."""
    idx = [c for c in (by, key, "layer_kind" if "layer_kind" in df else None, "frac_depth") if c]
    w = df.pivot_table(index=idx, columns="metric", values="value", sort=False).reset_index()
    w = df[idx].drop_duplicates().merge(w, on=idx, how="left")  # every row, in the table's order
    w.columns.name = None
    return w[[*idx, *[m for m in M.METRICS if m in w.columns]]]
