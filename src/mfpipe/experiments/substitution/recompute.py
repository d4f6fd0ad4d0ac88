"""The calibrated-kernel recomputation of App. B (``sec:U2M``, "Using an unbiased estimator of Â does not change key
results"): every body result that uses the context-conditional kernel, recomputed with the calibrated U of
Alg. ``alg:sinkhorn`` in place of ``W = P / nbar``, everything else held fixed, side by side with W in one table.

The two arms are the outputs of the same jobs run once with each kernel (pass 2's deviation store, the substitution
result, Exp. 1's meter summary, Exp. 2's class table; workflow/rules/substitution.smk). This module only compares
them (pure functions on the stores and tables; it imports no other experiment, it reads their CSV outputs):

* the head ranking (Sec. 6.3): heads ranked by S̄ as the ranking does (largest first, ties by layer then head, heads
  without an S̄ last); the Spearman correlation of U's S̄ with W's over the heads scored in both, the largest rank
  shift (and its head), the overlap of the two top-k sets, ``k = min(top, number of heads)``; the top head and its S̄;
* the substitution (Sec. 5): L_model, L_MF, ΔL, D_MF;
* Exp. 1 (the instance meter): the boundary rise of D_MF (copy 2 − copy 1), the top rising head and its rise, the
  Spearman correlation of the rise with the in-context loss reduction;
* Exp. 2 (the prompt classes): per class D_MF, M_cov, M_ctx, ΔL, ΔL_perm.

Rows of :data:`COLUMNS`: ``W`` and ``U`` the two values (for the comparisons of rankings, W's column holds what an
identical ranking gives: Spearman 1, shift 0, overlap k), ``difference`` = U − W and ``agree_sf``: the number of
significant figures (up to :data:`MAX_SF`; :func:`agree_sf`) to which the two agree, as the paper reads them
("unchanged to three significant figures"); ``W_head`` / ``U_head`` name the head of a head row.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pandas as pd

__all__ = ["COLUMNS", "MAX_SF", "open_substitution", "agree_sf", "head_ranks", "ranking_rows", "substitution_rows", "meter_rows",
           "class_rows", "recompute_table", "recompute_markdown"]

COLUMNS = ["model", "revision", "experiment", "quantity", "W", "U", "difference", "agree_sf", "W_head", "U_head"]
MAX_SF = 6
SUBSTITUTION_QUANTITIES = ("L_model", "L_MF", "delta_L", "D_MF")
CLASS_QUANTITIES = ("D_MF", "M_cov", "M_ctx", "delta_L", "delta_L_perm")


def _label(layer, head) -> str:
    return f"L{int(layer)}H{int(head)}"  # the paper's head name (as the ranking's head_label)


def open_substitution(path, expect: Mapping | None = None):
    """A substitution result (``substitution.zarr``), provenance-checked, as
    :func:`~mfpipe.experiments.substitution.substitute.open_result` opens it (without the substitution's torch)."""
    from mfpipe.stats.api import check_provenance
    from mfpipe.stats.store import open_zarr

    ds = open_zarr(path, "substitution result", "run its substitution job").load()
    check_provenance(ds.attrs, expect, path)
    return ds


def agree_sf(a: float, b: float, max_sf: int = MAX_SF) -> int:
    """The number of significant figures (0..``max_sf``) to which ``a`` and ``b`` agree: the largest n with
    ``|a - b|`` at most half a unit in the n-th significant figure of the larger of the two (so 0.2511 and 0.2495 agree
    to 2, as "0.25"; equal values: ``max_sf``; a NaN: 0 unless both are NaN)."""
    a, b = float(a), float(b)
    if np.isnan(a) or np.isnan(b):
        return max_sf if np.isnan(a) and np.isnan(b) else 0
    d = abs(a - b)
    if d == 0:
        return max_sf
    e = int(np.floor(np.log10(max(abs(a), abs(b)))))
    n = 0
    while n < max_sf and d <= 0.5 * 10.0 ** (e - n) * (1 + 1e-12):
        n += 1
    return n


def head_ranks(S_bar) -> np.ndarray:
    """Rank (1 = largest S̄) of every head of ``S_bar [L, H]``, as the ranking orders them: S̄ descending, ties by
    layer then head, heads without a finite S̄ last. Returns ``[L, H]`` int."""
    S = np.asarray(S_bar, dtype=np.float64)
    L, H = S.shape
    flat = S.ravel()
    key = np.where(np.isfinite(flat), -flat, np.inf)
    order = np.lexsort((np.arange(L * H), key))  # primary: -S̄ (NaN last); then layer-major index = (layer, head)
    ranks = np.empty(L * H, dtype=np.int64)
    ranks[order] = np.arange(1, L * H + 1)
    return ranks.reshape(L, H)


def ranking_rows(S_w, S_u, top: int = 20) -> list[dict]:
    """The head ranking under U against W: rows for the Spearman correlation of S̄ (heads finite in both), the largest
    rank shift and its head, the top-k overlap (``k = min(top, heads)``), the top head's S̄ and the mean S̄."""
    from scipy.stats import spearmanr

    S_w, S_u = np.asarray(S_w, dtype=np.float64), np.asarray(S_u, dtype=np.float64)
    if S_w.shape != S_u.shape:
        raise ValueError(f"the deviation stores have {S_w.shape} and {S_u.shape} heads: they are of different models")
    rw, ru = head_ranks(S_w), head_ranks(S_u)
    both = np.isfinite(S_w) & np.isfinite(S_u)
    rho = float(spearmanr(S_w[both], S_u[both])[0]) if both.sum() > 2 else float("nan")
    shift = np.abs(ru - rw)
    worst = np.unravel_index(int(np.argmax(shift)), shift.shape)  # first head (layer-major) with the largest shift
    k = min(int(top), S_w.size)
    overlap = int(((rw <= k) & (ru <= k)).sum())
    tw, tu = np.argwhere(rw == 1)[0], np.argwhere(ru == 1)[0]
    q = "ranking (Sec. 6.3)"
    return [
        {"experiment": q, "quantity": f"Spearman of S̄ (U vs W, {int(both.sum())} heads)", "W": 1.0, "U": rho},
        {"experiment": q, "quantity": "largest rank shift", "W": 0.0, "U": float(shift[worst]),
         "W_head": _label(*worst), "U_head": _label(*worst)},
        {"experiment": q, "quantity": f"top-{k} overlap", "W": float(k), "U": float(overlap)},
        {"experiment": q, "quantity": "top head S̄", "W": float(S_w[tuple(tw)]), "U": float(S_u[tuple(tu)]),
         "W_head": _label(*tw), "U_head": _label(*tu)},
        {"experiment": q, "quantity": "mean S̄ over heads", "W": float(np.nanmean(S_w)), "U": float(np.nanmean(S_u))},
    ]


def substitution_rows(w: Mapping, u: Mapping) -> list[dict]:
    """L_model, L_MF, ΔL and D_MF of the substitution result with each kernel (``w``, ``u``: mappings of those names,
    e.g. a substitution result Dataset or a sweep-table row)."""
    return [{"experiment": "substitution (Sec. 5)", "quantity": k, "W": float(np.asarray(w[k])),
             "U": float(np.asarray(u[k]))} for k in SUBSTITUTION_QUANTITIES]


def meter_rows(w: pd.DataFrame, u: pd.DataFrame) -> list[dict]:
    """Exp. 1 from the two one-row meter summaries (the icl_meter job's ``summary`` CSV): D_MF over each copy, the
    boundary rise, the top rising head and its rise, the Spearman correlation of rise and loss reduction."""
    a, b = w.iloc[0], u.iloc[0]
    q = "Exp. 1 (instance meter)"
    rise = lambda s: float(s["D_MF_copy2"]) - float(s["D_MF_copy1"])  # noqa: E731
    rows = [{"experiment": q, "quantity": f"D_MF {c.replace('_', ' ')}", "W": float(a[f"D_MF_{c}"]),
             "U": float(b[f"D_MF_{c}"])} for c in ("copy1", "copy2")]
    rows += [
        {"experiment": q, "quantity": "boundary rise of D_MF (copy 2 - copy 1)", "W": rise(a), "U": rise(b)},
        {"experiment": q, "quantity": "top rising head: rise", "W": float(a["top_head_rise"]),
         "U": float(b["top_head_rise"]), "W_head": _label(a["top_layer"], a["top_head"]),
         "U_head": _label(b["top_layer"], b["top_head"])},
        {"experiment": q, "quantity": "Spearman(rise, loss reduction)", "W": float(a["spearman_rho"]),
         "U": float(b["spearman_rho"])},
    ]
    return rows


def class_rows(w: pd.DataFrame, u: pd.DataFrame) -> list[dict]:
    """Exp. 2 from the two class tables (the icl_classes job's ``table`` CSV), class by class in W's order: D_MF,
    M_cov, M_ctx, ΔL, ΔL_perm. The classes and their prompt counts must agree (the prompts are the same)."""
    a, b = w.set_index("class"), u.set_index("class")
    if list(a.index) != list(b.index) or list(a["n"]) != list(b["n"]):
        raise ValueError(f"the class tables differ in their classes or prompt counts: {dict(a['n'])} vs {dict(b['n'])}")
    return [{"experiment": "Exp. 2 (prompt classes)", "quantity": f"{c}: {k}", "W": float(a.loc[c, k]),
             "U": float(b.loc[c, k])} for c in a.index for k in CLASS_QUANTITIES]


def recompute_table(rows: list[dict], model: str, revision: str) -> pd.DataFrame:
    """The side-by-side table of ``rows`` (from the functions above): :data:`COLUMNS`, with U − W and the agreeing
    significant figures filled in."""
    df = pd.DataFrame(rows)
    for c in ("W_head", "U_head"):
        if c not in df:
            df[c] = None
    df["W_head"] = df["W_head"].where(df["W_head"].notna(), "")
    df["U_head"] = df["U_head"].where(df["U_head"].notna(), "")
    df["difference"] = df["U"] - df["W"]
    df["agree_sf"] = [agree_sf(a, b) for a, b in zip(df["W"], df["U"])]
    df.insert(0, "revision", revision)
    df.insert(0, "model", model)
    return df[COLUMNS]


def recompute_markdown(df: pd.DataFrame, title: str | None = None) -> str:
    """The table as Markdown (4 significant figures; the difference in scientific notation)."""
    from mfpipe.workflow.tables import to_markdown

    t = df.drop(columns=["model", "revision"]).copy()
    t["W"] = [f"{v:.4g}" for v in t["W"]]
    t["U"] = [f"{v:.4g}" for v in t["U"]]
    t["difference"] = [f"{v:.2e}" for v in t["difference"]]
    head = f"### {title}\n\n" if title else ""
    return head + to_markdown(t)
