"""The function-vector tables (Tables fv-matrix-body / fv-matrix, the selection's stability, App. fv-gpt2's
category analysis), from the per-split results of :func:`mfpipe.experiments.fv.experiment.run_task`.

Accuracies pool the splits (``n`` = splits × held-out pairs, 120 at the paper's sizes) and carry Wilson 95%
binomial intervals. The tables are the first prompt-sampling seed's; where the experiment ran several
(:func:`~mfpipe.experiments.fv.experiment.run_seeds`), each accuracy also carries its mean and range over the seeds
(:func:`seed_spread`) and the comparisons the paper draws are counted over the seeds (:func:`conclusions_table`):
the Wilson interval covers the held-out pairs of one sampling, not the sampling itself."""

from __future__ import annotations

import numpy as np
import pandas as pd

__all__ = ["wilson", "transfer_table", "stability_table", "seed_spread", "conclusions_table", "fv_tables",
           "matrix_markdown", "details_markdown", "Z95"]

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


def transfer_table(transfer: pd.DataFrame) -> pd.DataFrame:
    """Per task × protocol × selection × construction, pooled over the splits: n, correct, accuracy and its
    interval, the share of top-1 answers in the task's category and among the answers seen in the prompts."""
    keys = ["task", "protocol", "selection", "construction"]
    g = transfer.groupby(keys, sort=False)
    t = g[["n", "correct", "in_category", "seen_answer"]].sum().reset_index()
    t["accuracy"] = t["correct"] / t["n"]
    ci = [wilson(int(k), int(n)) for k, n in zip(t["correct"], t["n"])]
    t["ci_lo"], t["ci_hi"] = [c[0] for c in ci], [c[1] for c in ci]
    t["category_rate"] = t["in_category"] / t["n"]
    t["seen_rate"] = t["seen_answer"] / t["n"]
    t["p_answer"] = g["p_answer"].mean().to_numpy()
    t["layer"] = g["layer"].first().to_numpy()
    t["scale"] = g["scale"].first().to_numpy()
    t["splits"] = g.size().to_numpy()
    return t


def _sets(heads: pd.DataFrame, sel: str) -> dict:
    out = {}
    for (task, split), g in heads.groupby(["task", "split"], sort=False):
        out[(task, split)] = set(zip(g.loc[g[f"sel_{sel}"], "layer"], g.loc[g[f"sel_{sel}"], "head"]))
    return out


def _span(xs) -> str:
    xs = list(xs)
    if not xs:
        return ""
    lo, hi = min(xs), max(xs)
    return f"{lo}" if lo == hi else f"{lo}–{hi}"


def stability_table(heads: pd.DataFrame) -> pd.DataFrame:
    """Per task: the selection size, the MFA selection's heads shared between each pair of splits, and the
    overlaps AIE∩MFA and raw-magnitude∩MFA per split (min–max over splits)."""
    mfa, aie, raw = _sets(heads, "MFA"), _sets(heads, "AIE"), _sets(heads, "raw-magnitude")
    rows = []
    for task in dict.fromkeys(heads["task"]):
        splits = sorted(s for t, s in mfa if t == task)
        k = len(mfa[(task, splits[0])])
        pairs = [len(mfa[(task, a)] & mfa[(task, b)]) for i, a in enumerate(splits) for b in splits[i + 1 :]]
        rows.append(dict(task=task, n_selected=k, mfa_shared_across_splits=_span(pairs),
                         aie_mfa_overlap=_span(len(aie[(task, s)] & mfa[(task, s)]) for s in splits),
                         raw_mfa_overlap=_span(len(raw[(task, s)] & mfa[(task, s)]) for s in splits),
                         aie_heads=" ".join(f"L{l}H{h}" for l, h in sorted(aie[(task, splits[0])])),
                         mfa_heads_split0=" ".join(f"L{l}H{h}" for l, h in sorted(mfa[(task, splits[0])]))))
    return pd.DataFrame(rows)


KEYS = ["task", "protocol", "selection", "construction"]


def seed_spread(transfer: pd.DataFrame) -> pd.DataFrame:
    """Per task × protocol × selection × construction: the pooled accuracy of each seed (``transfer`` of several
    seeds, its ``seed`` column) -> ``n_seeds``, ``seed_mean``, ``seed_min``, ``seed_max``."""
    acc = pd.concat([transfer_table(g).assign(seed=s) for s, g in transfer.groupby("seed", sort=True)],
                    ignore_index=True)
    g = acc.groupby(KEYS, sort=False)["accuracy"]
    return pd.DataFrame({"n_seeds": g.size(), "seed_mean": g.mean(), "seed_min": g.min(),
                         "seed_max": g.max()}).reset_index()


def _pipe(r) -> str:
    return f"{r['selection']}·{r['construction']}"


def conclusions_table(transfer: pd.DataFrame) -> pd.DataFrame:
    """How often the comparisons the paper draws hold over the seeds, per task and injection protocol: which of the
    four AIE/MFA pipelines transfers best (each seed's best, ties listed), whether the raw-magnitude control falls
    below MFA·r (with its raw vectors, the paper's control, and with r: the selection alone), and whether MFA·r beats
    the random control."""
    rows = []
    for (task, prot), g in transfer[transfer["protocol"].isin(["sum", "per_head"])].groupby(["task", "protocol"],
                                                                                          sort=False):
        best, raw_below, raw_r_below, beats_random = [], 0, 0, 0
        seeds = sorted(g["seed"].unique())
        for s in seeds:
            t = transfer_table(g[g["seed"] == s]).set_index(["selection", "construction"])["accuracy"]
            pipes = t[t.index.get_level_values(0).isin(["AIE", "MFA"])]
            best.append("+".join(f"{a}·{b}" for a, b in pipes[pipes >= pipes.max() - 1e-12].index))
            raw_below += bool(t.get(("raw-magnitude", "raw"), np.nan) < t.get(("MFA", "r"), np.nan))
            raw_r_below += bool(t.get(("raw-magnitude", "r"), np.nan) < t.get(("MFA", "r"), np.nan))
            beats_random += bool(t.get(("MFA", "r"), np.nan) > t.get(("random", "r"), np.nan))
        top = max(set(best), key=lambda b: (best.count(b), -best.index(b)))
        rows.append(dict(task=task, protocol=prot, n_seeds=len(seeds), best_by_seed=", ".join(best),
                         most_often_best=f"{top} ({best.count(top)}/{len(seeds)})",
                         raw_magnitude_below_MFA_r=f"{raw_below}/{len(seeds)}",
                         raw_magnitude_r_below_MFA_r=f"{raw_r_below}/{len(seeds)}",
                         MFA_r_above_random=f"{beats_random}/{len(seeds)}"))
    return pd.DataFrame(rows)


def fv_tables(results: dict, infos: list[dict]) -> dict:
    """All tables from the concatenated per-task results (keys ``transfer``, ``heads``, ``sweep``, ``ranks``,
    ``prompt_ranks``; with a ``seed`` column where several seeds ran: the tables are the first seed's, the transfer
    table gains the spread over seeds) and the tasks' ``info`` dicts."""
    results = {k: (v if "seed" in v else v.assign(seed=0)) for k, v in results.items()}
    first = int(results["transfer"]["seed"].min())
    one = {k: v[v["seed"] == first].drop(columns="seed") for k, v in results.items()}
    t = transfer_table(one["transfer"]).merge(seed_spread(results["transfer"]), on=KEYS, how="left")
    st = stability_table(one["heads"])
    pc = {i["task"]: i["p_corrupted"] for i in infos if i.get("seed", first) == first}
    st["p_answer_corrupted"] = st["task"].map(pc)
    out = {"transfer": t, "stability": st, "category": one["ranks"], "prompt_ranks": one["prompt_ranks"],
           "sweep": one["sweep"], "conclusions": conclusions_table(results["transfer"])}
    for prot in ("sum", "per_head"):
        out[f"matrix_{prot}"] = _wide(t, st, prot)
    return out


def _cell(r) -> str:
    cell = f"{r['accuracy']:.2f} [{r['ci_lo']:.2f}, {r['ci_hi']:.2f}]"
    if r.get("n_seeds", 1) > 1:  # beside the first seed's interval: the mean and range over every seed
        cell += f" · {r['seed_mean']:.2f} ({r['seed_min']:.2f}–{r['seed_max']:.2f})"
    return cell


COLUMNS = [("AIE", "raw"), ("AIE", "r"), ("MFA", "raw"), ("MFA", "r"), ("raw-magnitude", "raw"),
           ("raw-magnitude", "r"), ("random", "raw"), ("random", "r")]


def _wide(t: pd.DataFrame, st: pd.DataFrame, protocol: str) -> pd.DataFrame:
    rows = []
    for task in dict.fromkeys(t["task"]):
        g = t[t["task"] == task]
        s = st[st["task"] == task].iloc[0]
        row = {"task": task, "AIE∩MFA": f"{s['aie_mfa_overlap']}/{s['n_selected']}"}
        for sel, cons in COLUMNS:
            r = g[(g["protocol"] == protocol) & (g["selection"] == sel) & (g["construction"] == cons)]
            row[f"{sel} {cons}"] = _cell(r.iloc[0]) if len(r) else ""
        for prot in ("zero-shot", "few-shot"):
            r = g[g["protocol"] == prot]
            row[prot] = _cell(r.iloc[0]) if len(r) else ""
        p = g[g["protocol"] == protocol]
        row["layer"] = int(p["layer"].iloc[0]) if len(p) and protocol == "sum" else ""
        row["scale"] = float(p["scale"].iloc[0]) if len(p) else ""
        rows.append(row)
    return pd.DataFrame(rows)


def _md(df: pd.DataFrame) -> list[str]:
    cols = list(df.columns)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for _, r in df.iterrows():
        lines.append("| " + " | ".join(str(r[c]) for c in cols) + " |")
    return lines


def matrix_markdown(transfer: pd.DataFrame, stability: pd.DataFrame, protocol: str, model: str, revision: str,
                    conclusions: pd.DataFrame | None = None) -> str:
    """Table fv-matrix-body (``protocol="sum"``) or fv-matrix (``"per_head"``) with the controls, the zero-shot
    floor and the few-shot ceiling; best of the four AIE/MFA pipelines per task in bold."""
    w = _wide(transfer, stability, protocol)
    for i, task in enumerate(w["task"]):
        g = transfer[(transfer["task"] == task) & (transfer["protocol"] == protocol)
                     & transfer["selection"].isin(["AIE", "MFA"])]
        if len(g):
            best = g["accuracy"].max()
            for _, r in g[g["accuracy"] >= best - 1e-12].iterrows():
                col = f"{r['selection']} {r['construction']}"
                w.loc[w.index[i], col] = f"**{w.loc[w.index[i], col]}**"
    what = ("the selected heads' vectors summed (residual units) and added to the residual stream entering the "
            "injection layer at the final token" if protocol == "sum" else
            "each selected head's vector added to that head's read at the final token of its own layer")
    lines = [f"# Function vectors: {model} @ {revision} ({'Table fv-matrix-body' if protocol == 'sum' else 'Table fv-matrix'})",
             "",
             f"Zero-shot transfer (accuracy on held-out pairs, pooled over the splits, Wilson 95% intervals): {what}. "
             "Selection: AIE (Todd et al.'s causal mediation), MFA (‖O_h r‖, eq:taskresid), raw-magnitude (‖O_h z̄‖, "
             "nothing subtracted), random heads; construction: raw (the heads' clean means) or MFA r. Layer and scale "
             "from one sweep on the extraction pairs, held for every method. Bold: best of the four AIE/MFA "
             "pipelines. zero-shot: no injection; few-shot: the held-out queries after extraction exemplars.", ""]
    n_seeds = int(transfer["n_seeds"].max()) if "n_seeds" in transfer and len(transfer) else 1
    if n_seeds > 1:
        lines[-1:-1] = ["", f"Each cell: the first seed's accuracy [interval] · the mean (min–max) over {n_seeds} "
                        "prompt-sampling seeds (each draws its own pairs, splits, prompts and random heads); bold by "
                        "the first seed."]
    lines += _md(w)
    if conclusions is not None and len(conclusions):
        c = conclusions[conclusions["protocol"] == protocol].drop(columns="protocol")
        lines += ["", f"## The comparisons over {n_seeds} seeds", "",
                  "Best of the four AIE/MFA pipelines at each seed; the seeds at which the raw-magnitude control "
                  "falls below MFA·r (its raw vectors, the paper's control; its r vectors, the selection alone), "
                  "and at which MFA·r beats the random control.", ""] + _md(c)
    return "\n".join(lines) + "\n"


def details_markdown(tabs: dict, model: str, revision: str) -> str:
    """The selection's stability, the category analysis (App. fv-gpt2) and the per-prompt decode (App. fv-jlens)."""
    t = tabs["transfer"]
    lines = [f"# Function vectors: {model} @ {revision}: stability, categories, lenses", "",
             "## Stability of the selections", "",
             "Heads shared by the MFA selections of each pair of splits; AIE∩MFA and raw-magnitude∩MFA per split "
             "(min–max); the mean answer probability on the label-shuffled prompts AIE starts from.", ""]
    lines += _md(tabs["stability"][["task", "n_selected", "mfa_shared_across_splits", "aie_mfa_overlap",
                                    "raw_mfa_overlap", "p_answer_corrupted", "aie_heads", "mfa_heads_split0"]]
                 .round(4))
    conc = tabs.get("conclusions")
    if conc is not None and len(conc):
        lines += ["", "## Stability over the prompt-sampling seeds", "",
                  "The comparisons of Tables fv-matrix-body (sum) and fv-matrix (per_head) at each seed: the best of "
                  "the four AIE/MFA pipelines, the seeds at which the raw-magnitude control falls below MFA·r (its raw "
                  "vectors; its r vectors), and at which MFA·r beats the random control.", ""]
        lines += _md(conc)
    cat = t[t["protocol"].isin(["sum", "per_head", "zero-shot"])][
        ["task", "protocol", "selection", "construction", "accuracy", "category_rate", "seen_rate"]].round(3)
    lines += ["", "## Does the injected answer fall in the task's category?", "",
              "Top-1 answers: correct, in the task's answer category (any answer of the task), one of the answers "
              "seen in the extraction prompts.", ""]
    lines += _md(cat)
    rk = tabs["category"]
    if len(rk):
        cols = ["task", "vector", "layer", "point", "lens"] + [c for c in rk.columns if c.startswith("median_rank_")]
        lines += ["", "## The vectors under the lenses (split 0)", "",
                  "Median vocabulary rank (0 = top) of the extraction answers (seen), the held-out answers, answers of "
                  "the task in neither set (out-of-task) and unrelated tokens, decoding each summed vector at the "
                  "injection layer and each MFA head's own component O_h r at its layer; J: the J-lens W_U J_ℓ, raw: "
                  "the logit lens.", ""]
        lines += _md(rk[cols].round(1))
    pr = tabs["prompt_ranks"]
    if len(pr):
        lines += ["", "## Per-prompt residuals decoded (App. fv-jlens)", "",
                  "Each clean prompt's residual O_h(z_{:,X} − ẑ_:) of the top MFA heads, decoded; rank of that "
                  "prompt's own answer.", ""]
        lines += _md(pr.round(2))
    return "\n".join(lines) + "\n"
