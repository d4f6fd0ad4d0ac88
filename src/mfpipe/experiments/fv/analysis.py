"""The function-vector experiment's checks of App. fv, computed from its per-split results (no model):

* :func:`recovery_table`: a given head list (e.g. Todd et al.'s ten GPT-J heads) against the pipeline's own AIE
  ranking of the same split: how many of the list the AIE top-``k`` holds (``k`` = the list's length), whether
  AIE's top five are the list's first five, and the list's overlap with the MFA selection;
* :func:`protocol_tests`: App. fv-validations' protocol check: per-head minus summed injection over the paired
  task × split × selection × construction cells (AIE and MFA), Wilcoxon signed-rank; the penalty's difference
  between the two selections, Mann-Whitney U;
* :func:`construction_tally`: "the deviation vector matches or beats the raw average in k of the cells", per
  protocol over the task × selection cells, exactly and within the paper's 0.02 tie margin;
* :func:`raw_magnitude_best`: the raw-magnitude control's best cell over the whole sweep grid, beside its cell at
  the pipelines' setting;
* :func:`clean_table`: MFA·r against the number of clean prompts, pooled over the splits, with the AIE pipelines'
  transfer (at every clean prompt) as the reference line.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

__all__ = ["TIE", "Z95", "wilson", "recovery_table", "protocol_tests", "construction_tally", "raw_magnitude_best", "clean_table"]

#: the paper's tie margin (Table fv-matrix: "Bold: best per task, ties within 0.02")
TIE = 0.02

Z95 = 1.959963984540054


def wilson(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of ``k`` successes in ``n`` trials (binomial, 95% at the default ``z``)."""
    if n <= 0:
        return float("nan"), float("nan")
    p = k / n
    c = (p + z * z / (2 * n)) / (1 + z * z / n)
    w = z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    lo, hi = (0.0 if k == 0 else max(0.0, c - w)), (1.0 if k == n else min(1.0, c + w))
    return float(lo), float(hi)


def _top(heads: pd.DataFrame, score: str, k: int) -> list[tuple[int, int]]:
    """The ``k`` heads of one split's rows with the largest ``score`` (ties: lower layer, then head), best first —
    the order of :func:`mfpipe.experiments.fv.heads.top_heads`."""
    g = heads.assign(_s=heads[score].astype(np.float32))  # the selection ranks the float32 scores
    g = g.sort_values(["_s", "layer", "head"], ascending=[False, True, True], kind="stable")
    return [(int(l), int(h)) for l, h in zip(g["layer"][:k], g["head"][:k])]


def recovery_table(heads: pd.DataFrame, lists: dict) -> pd.DataFrame:
    """Per head list, task and split: ``recovered`` = |AIE top-k ∩ list| (k = the list's length), ``top5`` = |AIE
    top-5 ∩ the list's first five|, ``top5_exact`` (the two five-sets equal), ``mfa_overlap`` = |MFA selection ∩
    list|. ``heads``: the per-head rows (task, split, layer, head, aie, sel_MFA); ``lists``: ``{(name, task):
    [(layer, head), ...]}`` in the list's order."""
    rows = []
    for (name, task), lst in lists.items():
        for split, g in heads[heads["task"] == task].groupby("split", sort=True):
            k = len(lst)
            aie = _top(g, "aie", k)
            mfa = set(zip(g.loc[g["sel_MFA"], "layer"].astype(int), g.loc[g["sel_MFA"], "head"].astype(int)))
            top5, first5 = set(aie[:5]), set(lst[:5])
            rows.append(dict(head_list=name, task=task, split=int(split), k=k, recovered=len(set(aie) & set(lst)),
                             top5=len(top5 & first5), top5_exact=top5 == first5, mfa_overlap=len(mfa & set(lst)),
                             aie_top=" ".join(f"L{l}H{h}" for l, h in aie)))
    return pd.DataFrame(rows, columns=["head_list", "task", "split", "k", "recovered", "top5", "top5_exact",
                                       "mfa_overlap", "aie_top"])


def _cells(transfer: pd.DataFrame, sels=("AIE", "MFA")) -> pd.DataFrame:
    """Per-split accuracies, one column per protocol, of the task × split × selection × construction cells."""
    t = transfer[transfer["selection"].isin(sels) & transfer["protocol"].isin(["sum", "per_head"])].copy()
    t["accuracy"] = t["correct"] / t["n"]
    return t.pivot_table(index=["task", "split", "selection", "construction"], columns="protocol",
                         values="accuracy").dropna().reset_index()


def protocol_tests(transfer: pd.DataFrame) -> dict:
    """Per-head against summed injection on the paired cells (AIE and MFA): ``n_cells``, the mean accuracies, the
    mean difference (per_head − sum), Wilcoxon signed-rank ``p``; the penalty of summing (sum − per_head) per
    selection and the Mann-Whitney ``p`` of AIE's against MFA's (NaN where a test has nothing to compare)."""
    from scipy import stats

    c = _cells(transfer)
    diff = (c["per_head"] - c["sum"]).to_numpy() if len(c) else np.zeros(0)
    out = dict(n_cells=int(len(c)), mean_per_head=float(c["per_head"].mean()) if len(c) else np.nan,
               mean_sum=float(c["sum"].mean()) if len(c) else np.nan,
               mean_difference=float(diff.mean()) if len(diff) else np.nan, wilcoxon_p=np.nan)
    if np.any(diff != 0):
        out["wilcoxon_p"] = float(stats.wilcoxon(diff).pvalue)
    pen = {s: -(c.loc[c["selection"] == s, "per_head"] - c.loc[c["selection"] == s, "sum"]).to_numpy()
           for s in ("AIE", "MFA")}
    for s, v in pen.items():
        out[f"penalty_{s}"] = float(v.mean()) if len(v) else np.nan
    out["mannwhitney_p"] = np.nan
    if len(pen["AIE"]) and len(pen["MFA"]) and np.ptp(np.concatenate([pen["AIE"], pen["MFA"]])) > 0:
        out["mannwhitney_p"] = float(stats.mannwhitneyu(pen["AIE"], pen["MFA"], alternative="two-sided").pvalue)
    return out


def construction_tally(table: pd.DataFrame, sels=("AIE", "MFA")) -> pd.DataFrame:
    """Per protocol: over the task × selection cells of the pooled ``table`` (:func:`~.tables.transfer_table`), in
    how many the r construction is at least the raw one, exactly and within :data:`TIE`."""
    rows = []
    for prot in ("sum", "per_head"):
        t = table[(table["protocol"] == prot) & table["selection"].isin(sels)]
        w = t.pivot_table(index=["task", "selection"], columns="construction", values="accuracy").dropna()
        d = (w["r"] - w["raw"]) if len(w) else pd.Series(dtype=float)
        rows.append(dict(protocol=prot, cells=int(len(d)), r_at_least_raw=int((d >= 0).sum()),
                         r_within_tie=int((d >= -TIE - 1e-12).sum()), mean_r_minus_raw=float(d.mean())
                         if len(d) else np.nan))
    return pd.DataFrame(rows)


def raw_magnitude_best(sweep: pd.DataFrame) -> pd.DataFrame:
    """Per task, protocol and construction: the raw-magnitude control pooled over the splits at each grid cell
    (layer, scale) on the held-out pairs -> its best cell (accuracy, layer, scale), how many cells, and its accuracy
    at the pipelines' chosen setting."""
    s = sweep[(sweep["pairs"] == "held-out") & (sweep["selection"] == "raw-magnitude")]
    rows = []
    for (task, prot, cons), g in s.groupby(["task", "protocol", "construction"], sort=False):
        cell = g.groupby(["layer", "scale"], as_index=False)[["correct", "n"]].sum()
        cell["accuracy"] = cell["correct"] / cell["n"]
        b = cell.sort_values(["accuracy", "scale", "layer"], ascending=[False, True, True], kind="stable").iloc[0]
        ch = g[g["chosen"]]
        rows.append(dict(task=task, protocol=prot, construction=cons, cells=int(len(cell)),
                         best_accuracy=float(b["accuracy"]), best_layer=int(b["layer"]), best_scale=float(b["scale"]),
                         worst_accuracy=float(cell["accuracy"].min()),
                         at_chosen=float(ch["correct"].sum() / ch["n"].sum()) if len(ch) else np.nan))
    return pd.DataFrame(rows)


def clean_table(clean: pd.DataFrame, table: pd.DataFrame) -> pd.DataFrame:
    """Per task, protocol and number of clean prompts: MFA·r pooled over the splits (n, correct, accuracy, Wilson
    interval) and the reference lines: AIE·raw (Todd et al.'s pipeline) and AIE·r from the pooled ``table``, at every
    clean prompt."""
    g = clean.groupby(["task", "protocol", "n_clean"], sort=False)
    t = g[["n", "correct"]].sum().reset_index()
    t["accuracy"] = t["correct"] / t["n"]
    ci = [wilson(int(k), int(n)) for k, n in zip(t["correct"], t["n"])]
    t["ci_lo"], t["ci_hi"] = [c[0] for c in ci], [c[1] for c in ci]
    t["splits"] = g.size().to_numpy()
    for cons in ("raw", "r"):
        ref = table[table["selection"] == "AIE"]
        ref = ref[ref["construction"] == cons].set_index(["task", "protocol"])["accuracy"]
        t[f"AIE_{cons}"] = [ref.get((a, b), np.nan) for a, b in zip(t["task"], t["protocol"])]
    return t
