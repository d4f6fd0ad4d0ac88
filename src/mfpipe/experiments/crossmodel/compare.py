"""The cross-model comparison table: one row per model, from the tables the run already wrote.

* rollout (Alg. 1, at the model's rollout revision, unpinned): the mean-field kernel's cosine and relative error
  against held-out centroids, and the best ablated kernel by cosine with its cosine;
* substitution (Sec. 5): ΔL and D_MF at the sweep's last revision, and the peak of each with the revision and the
  training tokens where it falls;
* head ranking (Sec. 6): the ``top`` heads by S̄ with their roles;
* function vectors (Sec. 6.4), when the model has them: zero-shot accuracy without injection and the transfer of
  the AIE·raw and MFA·r pipelines (summed injection, mean over the tasks), and the best pipeline and task.

A model without one of the three tables gets NaN / empty cells there (a single-revision model has no sweep peak
worth the name: its peak is its only revision).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

__all__ = ["comparison_row", "comparison_table", "training_tokens"]


def training_tokens(steps, tokens_per_step) -> list[float]:
    """Training tokens of each revision: its step times the model's tokens per step (NaN where either is unknown)."""
    if tokens_per_step is None:
        return [np.nan for _ in steps]
    return [np.nan if s is None or pd.isna(s) else float(s) * float(tokens_per_step) for s in steps]


def comparison_row(model: str, substitution=None, rollout=None, ranking=None, tokens_per_step=None,
                   top: int = 3, fv=None) -> dict:
    """One model's row from its tables (DataFrames or CSV paths; None where the run has none)."""
    row: dict = {"model": model}
    if rollout is not None:
        r = pd.read_csv(rollout) if not isinstance(rollout, pd.DataFrame) else rollout
        r = r[~r["pinned"].astype(bool)] if "pinned" in r else r
        mf = r[r["kernel"] == "mean_field"]
        base = r[r["kernel"] != "mean_field"].sort_values("cosine", ascending=False)
        row.update(rollout_cosine=float(mf["cosine"].iloc[0]) if len(mf) else np.nan,
                   rollout_rel_error=float(mf["rel_error"].iloc[0]) if len(mf) else np.nan,
                   best_baseline=str(base["kernel"].iloc[0]) if len(base) else "",
                   best_baseline_cosine=float(base["cosine"].iloc[0]) if len(base) else np.nan)
    if substitution is not None:
        s = pd.read_csv(substitution) if not isinstance(substitution, pd.DataFrame) else substitution
        steps = [None if pd.isna(v) else v for v in s["step"]] if "step" in s else [None] * len(s)
        tok = training_tokens(steps, tokens_per_step)
        last = len(s) - 1
        peak_dl, peak_d = int(np.nanargmax(s["delta_L"].to_numpy(float))), int(np.nanargmax(s["D_MF"].to_numpy(float)))
        row.update(revision=str(s["revision"].iloc[last]), tokens=tok[last],
                   delta_L=float(s["delta_L"].iloc[last]), D_MF=float(s["D_MF"].iloc[last]),
                   delta_L_peak=float(s["delta_L"].iloc[peak_dl]), delta_L_peak_revision=str(s["revision"].iloc[peak_dl]),
                   delta_L_peak_tokens=tok[peak_dl],
                   D_MF_peak=float(s["D_MF"].iloc[peak_d]), D_MF_peak_revision=str(s["revision"].iloc[peak_d]),
                   D_MF_peak_tokens=tok[peak_d])
    if ranking is not None:
        h = pd.read_csv(ranking) if not isinstance(ranking, pd.DataFrame) else ranking
        h = h.sort_values("rank").head(int(top))
        row["top_heads"] = ", ".join(f"{lab} ({role})" if isinstance(role, str) and role else str(lab)
                                     for lab, role in zip(h["head_label"], h["role"]))
        row["top_S_bar"] = ", ".join(f"{v:.3f}" for v in h["S_bar"])
    if fv is not None:
        f = pd.read_csv(fv) if not isinstance(fv, pd.DataFrame) else fv
        s = f[f["protocol"] == "sum"]
        z = f[f["protocol"] == "zero-shot"]

        def mean_of(sel, cons):
            g = s[(s["selection"] == sel) & (s["construction"] == cons)]
            return float(g["accuracy"].mean()) if len(g) else np.nan

        pipes = s[s["selection"].isin(["AIE", "MFA"])]
        row.update(fv_tasks=int(f["task"].nunique()), fv_zero_shot=float(z["accuracy"].mean()) if len(z) else np.nan,
                   fv_AIE_raw=mean_of("AIE", "raw"), fv_MFA_r=mean_of("MFA", "r"))
        if len(pipes):
            b = pipes.sort_values("accuracy", ascending=False, kind="stable").iloc[0]
            row["fv_best"] = (f"{b['selection']}·{b['construction']} {b['accuracy']:.2f} "
                              f"[{b['ci_lo']:.2f}, {b['ci_hi']:.2f}] on {b['task']}")
    return row


def comparison_table(rows: list[dict]) -> pd.DataFrame:
    """The rows of :func:`comparison_row`, one per model, in the run's model order."""
    cols = ["model", "rollout_cosine", "rollout_rel_error", "best_baseline", "best_baseline_cosine", "revision",
            "tokens", "delta_L", "D_MF", "delta_L_peak", "delta_L_peak_revision", "delta_L_peak_tokens", "D_MF_peak",
            "D_MF_peak_revision", "D_MF_peak_tokens", "top_heads", "top_S_bar", "fv_tasks", "fv_zero_shot", "fv_AIE_raw",
            "fv_MFA_r", "fv_best"]
    df = pd.DataFrame(rows)
    return df.reindex(columns=[c for c in cols if c in df.columns] + [c for c in df.columns if c not in cols])
