"""The per-head scores the explorer's grid colours by, and the heads' role labels: each a ``[layer, head]`` grid per
revision, read from the table or store that holds it (named in the score's ``source``), never recomputed, so the page
shows the tables' values.

Per revision of the sweep: S̄, D, M_cov, M_ctx and M_cov's share of D (pass 2's deviation store; M_cov + M_ctx = D),
the behavioural scores (``heads/<model>/<revision>/head_scores.csv``), each head's substitution deviation D_MF (Sec. 5,
``substitution_heads_<model>.csv``; per-head ΔL is not a quantity of the paper: the substitution replaces every head
at once, so its loss gap has no per-head split, and the grid shows each head's D_MF instead) and the kernel's spread
(``kernel_spread_<model>.csv``). At the rollout revisions: posVar and the W_pos share (``positional_*``), the
repeated-text rise (``positional_repeated_*``), the instance meter's copy rise (``icl_meter_heads_*``) and the
function-vector scores (``fv/<model>/<revision>/heads.csv``: Todd et al.'s AIE and the MFA norm ‖O_h r‖, each the mean
over the tasks, splits and seeds of the run)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pandas as pd

__all__ = ["SCORES", "grid", "model_scores", "head_roles", "read_deviation_grids", "fv_head_means"]

# key -> (label, description); the order is the menu's
SCORES = {
    "S_bar": ("S̄", "mean-field deviation S̄ (Sec. 6.1; the ranking's score)"),
    "D": ("D", "mean deviation D = M_cov + M_ctx (eq:mcov-mctx)"),
    "M_cov": ("M_cov", "covariance term of D"),
    "M_ctx": ("M_ctx", "contextualization term of D"),
    "M_cov_share": ("M_cov / D", "the covariance term's share of D"),
    "substitution_D": ("D_MF (substitution)", "the head's mean 1 − cos(z, ẑ) over the substituted positions (Sec. 5)"),
    "induction": ("induction", "behavioural induction score"),
    "previous_token": ("previous-token", "behavioural previous-token score"),
    "duplicate_token": ("duplicate-token", "behavioural duplicate-token score"),
    "bos_sink": ("BOS sink", "attention on the BOS position"),
    "spread": ("kernel spread", "spread of the head's kernel (App. N)"),
    "posvar": ("posVar", "positional variance of the head's deviation (App. positional)"),
    "wpos_share": ("W_pos share", "share of the deviation read from the position table W_pos"),
    "rise": ("repeated-text rise", "D on repeated text minus D on natural text (App. readings)"),
    "icl_rise": ("copy rise", "the instance meter's D on the second copy minus the first (Exp. 1)"),
    "fv_aie": ("FV AIE", "function vectors: Todd et al.'s average indirect effect (mean over tasks, splits, seeds)"),
    "fv_mfa": ("FV MFA ‖O_h r‖", "function vectors: the MFA score, the norm of the task deviation (eq:taskresid)"),
}


def grid(df: pd.DataFrame, column: str, n_layers: int, n_heads: int) -> np.ndarray:
    """``[n_layers, n_heads]`` float64 of ``df[column]`` by its ``layer`` and ``head`` columns; NaN where a head has
    no row."""
    out = np.full((n_layers, n_heads), np.nan)
    if column in df.columns and len(df):
        l, h = df["layer"].to_numpy(np.int64), df["head"].to_numpy(np.int64)
        ok = (l >= 0) & (l < n_layers) & (h >= 0) & (h < n_heads)
        out[l[ok], h[ok]] = pd.to_numeric(df[column], errors="coerce").to_numpy(np.float64)[ok]
    return out


def read_deviation_grids(path, expect: Mapping | None = None) -> dict[str, np.ndarray]:
    """S_bar, D, M_cov, M_ctx (``[layer, head]``) of a deviation store (its provenance checked against ``expect``)
    and M_cov's share of D."""
    from mfpipe.deviation.store import open_deviation

    ds = open_deviation(path, expect)
    out = {k: np.asarray(ds[k].transpose("layer", "head").values, dtype=np.float64) for k in ("S_bar", "D", "M_cov",
                                                                                         "M_ctx")}
    with np.errstate(divide="ignore", invalid="ignore"):
        out["M_cov_share"] = np.where(out["D"] != 0, out["M_cov"] / out["D"], np.nan)
    return out


def fv_head_means(path) -> pd.DataFrame:
    """Per head the mean AIE and MFA norm over every (task, split, seed) row of a function-vector heads table."""
    df = pd.read_csv(path)
    return df.groupby(["layer", "head"], as_index=False)[["aie", "mfa_norm"]].mean()


def _long(path, revisions) -> dict[str, pd.DataFrame]:
    """A long table with a ``revision`` column split by revision (only the revisions asked for)."""
    if path is None or not Path(path).is_file():
        return {}
    df = pd.read_csv(path)
    return {rev: g for rev, g in df.groupby("revision") if rev in revisions}


def model_scores(files: Mapping, revisions: list[str], n_layers: int, n_heads: int) -> dict[str, dict]:
    """``{score key: {revision: [layer][head] grid}}`` for every score of :data:`SCORES` with a source in ``files``
    (the explorer job's inputs: see :func:`mfpipe.explorer.rules.explorer_inputs`), and the source of each
    (``{score key: {revision: path}}``, under ``"_sources"``)."""
    out: dict[str, dict] = {k: {} for k in SCORES}
    src: dict[str, dict] = {k: {} for k in SCORES}
    L, H = n_layers, n_heads

    def put(key, rev, g, path):
        if np.isfinite(g).any():
            out[key][rev], src[key][rev] = g, str(path)

    for rev, path in files.get("deviation", {}).items():
        for k, g in read_deviation_grids(path, {"model": files["model"], "revision": rev}).items():
            put(k, rev, g, path)
    for rev, path in files.get("head_scores", {}).items():
        df = pd.read_csv(path)
        for k in ("induction", "previous_token", "duplicate_token", "bos_sink"):
            put(k, rev, grid(df, k, L, H), path)
    for key, name, col in (("substitution_D", "substitution_heads", "deviation"), ("spread", "kernel_spread", "spread")):
        for rev, df in _long(files.get(name), revisions).items():
            put(key, rev, grid(df, col, L, H), files[name])
    for key, name, col in (("posvar", "positional", "posvar"), ("wpos_share", "positional", "wpos_share"),
                           ("rise", "positional_repeated", "rise"), ("icl_rise", "icl_meter_heads", "rise")):
        for rev, path in files.get(name, {}).items():
            put(key, rev, grid(pd.read_csv(path), col, L, H), path)
    for rev, path in files.get("fv_heads", {}).items():
        m = fv_head_means(path)
        put("fv_aie", rev, grid(m, "aie", L, H), path)
        put("fv_mfa", rev, grid(m, "mfa_norm", L, H), path)
    out = {k: v for k, v in out.items() if v}
    out["_sources"] = {k: v for k, v in src.items() if v}
    return out


def head_roles(files: Mapping) -> dict[str, dict[str, list[str]]]:
    """``{revision: {"L1H3": [role, ...]}}`` at the rollout revisions: the ranking's role labels
    (``ranking_roles_*``: the top heads of each behavioural score), the positional cluster and carriers
    (``positional_*``) and the heads a function-vector selection chose (AIE or MFA, any task, split or seed)."""
    roles: dict[str, dict[str, list[str]]] = {}

    def add(rev, l, h, role):
        lst = roles.setdefault(rev, {}).setdefault(f"L{int(l)}H{int(h)}", [])
        if role not in lst:
            lst.append(role)

    for rev, path in files.get("ranking_roles", {}).items():
        for r in pd.read_csv(path).itertuples():
            add(rev, r.layer, r.head, f"{r.role} (#{int(r.role_rank)})")
    for rev, path in files.get("positional", {}).items():
        df = pd.read_csv(path)
        for col, role in (("cluster", "positional cluster"), ("carrier", "position carrier")):
            if col in df.columns:
                for r in df[df[col].astype(str).str.lower() == "true"].itertuples():
                    add(rev, r.layer, r.head, role)
    for rev, path in files.get("fv_heads", {}).items():
        df = pd.read_csv(path)
        for col, role in (("sel_AIE", "function-vector head (AIE)"), ("sel_MFA", "function-vector head (MFA)")):
            if col in df.columns:
                for (l, h), g in df[df[col].astype(str).str.lower() == "true"].groupby(["layer", "head"]):
                    add(rev, l, h, f"{role}: {', '.join(sorted(set(map(str, g['task']))))}")
    return roles
