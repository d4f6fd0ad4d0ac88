"""Head ranking by mean-field deviation (paper Sec. 6.3, Tables ranking-cc and bottom, Fig. ccmf-scatter, App. P
split-half stability): every head of a deviation store (:mod:`mfpipe.deviation.shards`) with its corpus
deviation S̄ (eq:ddec), meters M_cov / M_ctx (eq:head-meters) and the behavioural scores measured without the mean
field (:mod:`mfpipe.experiments.ranking.head_scores`), ranked by S̄."""

from __future__ import annotations

import numpy as np
import pandas as pd

from mfpipe.experiments.ranking.head_scores import head_label

__all__ = ["heads_table", "merge_rises", "top_bottom", "split_half_stability", "head_roles", "HEAD_COLUMNS",
           "ROLE_THRESHOLDS"]

SCORES = ("induction", "previous_token", "duplicate_token", "bos_sink")
HEAD_COLUMNS = ["rank", "head_label", "layer", "layer_kind", "head", "S_bar", "M_cov", "M_ctx", "D", *SCORES,
                "S_bar_half0", "S_bar_half1", "model", "revision"]


def heads_table(dev, scores=None) -> pd.DataFrame:
    """One row per head, ranked by S̄ (rank 1 = largest deviation; heads without an S̄ last): S̄, the meters, the
    occurrence-mean D, each half's S̄ and, when ``scores`` (a head-scores Dataset) is given, the four behavioural
    scores. ``dev`` is a deviation store (xarray Dataset)."""
    L, H = dev.sizes["layer"], dev.sizes["head"]
    layer, head = np.meshgrid(np.arange(L), np.arange(H), indexing="ij")
    df = pd.DataFrame({"layer": layer.ravel(), "head": head.ravel()})
    df["head_label"] = [head_label(int(l), int(h)) for l, h in zip(df["layer"], df["head"])]
    # each layer's kind: attention, or a hybrid's other mixer, whose heads have no S̄ (NaN: ranked last, in no top)
    kinds = dev.coords["layer_kind"].values if "layer_kind" in dev.coords else np.full(L, "attention", dtype=object)
    df["layer_kind"] = np.asarray(kinds, dtype=object)[df["layer"].to_numpy()]
    for k in ("S_bar", "M_cov", "M_ctx", "D"):
        df[k] = np.asarray(dev[k].transpose("layer", "head").values).ravel()
    for i in (0, 1):
        df[f"S_bar_half{i}"] = np.asarray(dev["S_bar_half"].sel(half=i).transpose("layer", "head").values).ravel()
    for k in SCORES:
        if scores is not None:
            if (scores.sizes.get("layer"), scores.sizes.get("head")) != (L, H):
                raise ValueError(f"head scores have {scores.sizes.get('layer')} x {scores.sizes.get('head')} heads, the "
                                 f"deviation store {L} x {H}: they belong to different models")
            df[k] = np.asarray(scores[k].transpose("layer", "head").values).ravel()
        else:
            df[k] = np.nan
    df["model"], df["revision"] = dev.attrs.get("model"), dev.attrs.get("revision")
    df = df.sort_values(["S_bar", "layer", "head"], ascending=[False, True, True], na_position="last", kind="stable")
    df.insert(0, "rank", np.arange(1, len(df) + 1))
    return df[HEAD_COLUMNS].reset_index(drop=True)


def merge_rises(table: pd.DataFrame, rises: pd.DataFrame) -> pd.DataFrame:
    """``table`` (:func:`heads_table`) with each head's repeated-text rise and its rank over all heads (App. readings;
    the positional slice's ``positional_repeated`` table: ``layer``, ``head``, ``rise``, ``rise_rank``), in its
    order."""
    r = rises[["layer", "head", "rise", "rise_rank"]]
    if set(zip(r["layer"], r["head"])) != set(zip(table["layer"], table["head"])):
        raise ValueError(f"the repeated-text table has {len(r)} heads, the ranking {len(table)} (or other ones): it "
                         "belongs to another model; rerun its positional job")
    return table.merge(r, on=["layer", "head"], how="left", validate="one_to_one")


def top_bottom(table: pd.DataFrame, top: int = 20, bottom: int = 15) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Table ranking-cc (the ``top`` heads by S̄) and Table bottom (the ``bottom`` lowest, lowest first)."""
    ranked = table[np.isfinite(table["S_bar"])]
    low = ranked.sort_values(["S_bar", "layer", "head"], ascending=[True, True, True], kind="stable").head(bottom)
    return ranked.head(top).reset_index(drop=True), low.reset_index(drop=True)


def split_half_stability(table: pd.DataFrame, top: int = 20) -> dict:
    """App. P: the Spearman correlation of the two document-interleaved halves' S̄ over the heads, and how many of
    each half's top ``top`` heads they share."""
    from scipy.stats import spearmanr

    ok = np.isfinite(table["S_bar_half0"]) & np.isfinite(table["S_bar_half1"])
    a, b = table.loc[ok, "S_bar_half0"].to_numpy(), table.loc[ok, "S_bar_half1"].to_numpy()
    n = int(ok.sum())
    if n >= 3 and np.ptp(a) > 0 and np.ptp(b) > 0:
        rho, p = spearmanr(a, b)
    else:
        rho, p = np.nan, np.nan
    k = min(top, n)
    labels = table.loc[ok, "head_label"].to_numpy()
    top0 = set(labels[np.argsort(-a, kind="stable")[:k]])
    top1 = set(labels[np.argsort(-b, kind="stable")[:k]])
    return {"model": table["model"].iloc[0] if len(table) else None,
            "revision": table["revision"].iloc[0] if len(table) else None, "n_heads": n,
            "spearman": float(rho), "p_value": float(p), "top": k, "top_shared": len(top0 & top1)}


# roles read off the behavioural scores (App. P tab:bottom thresholds: duplicate 0.10, prev-token 0.15, BOS-sink 0.35;
# induction: the usual 0.3 of the mini suite's induction curve)
ROLE_THRESHOLDS = (("induction", 0.3, "induction", "#d62728"), ("previous_token", 0.15, "previous-token", "#2ca02c"),
                   ("duplicate_token", 0.10, "duplicate-token", "#9467bd"), ("bos_sink", 0.35, "BOS-sink", "#7f7f7f"))


def head_roles(table: pd.DataFrame) -> pd.Series:
    """Each head's behavioural role from its scores (first threshold met, in the order of ROLE_THRESHOLDS), else ''."""
    role = pd.Series("", index=table.index)
    for col, thr, name, _ in reversed(ROLE_THRESHOLDS):
        if col in table:
            role = role.where(~(table[col].to_numpy(float) >= thr), name)
    return role
