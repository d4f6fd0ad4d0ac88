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

from mfpipe.experiments.fv import analysis as An
from mfpipe.experiments.fv.analysis import TIE, Z95, wilson

__all__ = ["wilson", "transfer_table", "stability_table", "seed_spread", "conclusions_table", "fv_tables",
           "matrix_markdown", "md_rows", "selection_order", "NULLS", "Z95"]

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
    # each split tunes its own injection setting: the settings of the splits in order ("6/7/6"), one value where
    # they agree; empty for the rows without an injection
    t["layer"] = [_settings(v, "d") for v in g["layer"].agg(list)]
    t["scale"] = [_settings(v, "g") for v in g["scale"].agg(list)]
    t["splits"] = g.size().to_numpy()
    return t


def _settings(values, fmt: str) -> str:
    vals = [v for v in values if np.isfinite(v) and v >= 0]
    if not vals:
        return ""
    txt = [format(int(v) if fmt == "d" else float(v), fmt) for v in vals]
    return txt[0] if len(set(txt)) == 1 else "/".join(txt)


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
    overlaps AIE∩MFA, raw-magnitude∩MFA and each head list's ∩MFA per split (min–max over splits)."""
    mfa, aie, raw = _sets(heads, "MFA"), _sets(heads, "AIE"), _sets(heads, "raw-magnitude")
    lists = {c[4:]: _sets(heads, c[4:]) for c in heads.columns
             if c.startswith("sel_") and c[4:] not in ("MFA", "AIE", "raw-magnitude", "random")}
    rows = []
    for task in dict.fromkeys(heads["task"]):
        splits = sorted(s for t, s in mfa if t == task)
        k = len(mfa[(task, splits[0])])
        pairs = [len(mfa[(task, a)] & mfa[(task, b)]) for i, a in enumerate(splits) for b in splits[i + 1 :]]
        rows.append(dict(task=task, n_selected=k, mfa_shared_across_splits=_span(pairs),
                         aie_mfa_overlap=_span(len(aie[(task, s)] & mfa[(task, s)]) for s in splits),
                         raw_mfa_overlap=_span(len(raw[(task, s)] & mfa[(task, s)]) for s in splits),
                         **{f"{n}_mfa_overlap": _span(len(v[(task, s)] & mfa[(task, s)]) for s in splits)
                            for n, v in lists.items() if v[(task, splits[0])]},
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


FIXED = ("AIE", "MFA", "raw-magnitude", "random")


def fv_tables(results: dict, infos: list[dict]) -> dict:
    """All tables from the concatenated per-task results (keys ``transfer``, ``heads``, ``sweep``, ``clean``,
    ``ranks``, ``prompt_ranks``; with a ``seed`` column where several seeds ran: the tables are the first seed's, the
    transfer table gains the spread over seeds) and the tasks' ``info`` dicts (their ``head_lists``)."""
    results = {k: (v if "seed" in v else v.assign(seed=0)) for k, v in results.items()}
    heads = results["heads"]
    results["heads"] = heads.assign(**{c: heads[c].fillna(False).astype(bool) for c in heads if c.startswith("sel_")})
    first = int(results["transfer"]["seed"].min())
    one = {k: v[v["seed"] == first].drop(columns="seed") for k, v in results.items()}
    t = transfer_table(one["transfer"]).merge(seed_spread(results["transfer"]), on=KEYS, how="left")
    st = stability_table(one["heads"])
    mine = [i for i in infos if i.get("seed", first) == first]
    pc = {i["task"]: _span(round(p, 4) for p in np.atleast_1d(i["p_corrupted"])) for i in mine}
    st["p_answer_corrupted"] = st["task"].map(pc)
    lists = {(name, i["task"]): _parse(h) for i in mine for name, h in i.get("head_lists", {}).items()}
    out = {"transfer": t, "stability": st, "category": one["ranks"], "prompt_ranks": one["prompt_ranks"],
           "sweep": one["sweep"], "conclusions": conclusions_table(results["transfer"]),
           "recovery": An.recovery_table(one["heads"], lists), "protocol": An.protocol_tests(one["transfer"]),
           "tally": An.construction_tally(t), "raw_best": An.raw_magnitude_best(one["sweep"]),
           "clean": An.clean_table(one["clean"], t) if len(one["clean"]) else pd.DataFrame(),
           "null": sorted({str(i.get("null", "mean_field")) for i in mine})}
    for prot in ("sum", "per_head"):
        out[f"matrix_{prot}"] = _wide(t, st, prot)
    return out


def _parse(names) -> list[tuple[int, int]]:
    return [(int(n[1:].split("H")[0]), int(n.split("H")[1])) for n in names]


def _cell(r) -> str:
    cell = f"{r['accuracy']:.2f} [{r['ci_lo']:.2f}, {r['ci_hi']:.2f}]"
    if r.get("n_seeds", 1) > 1:  # beside the first seed's interval: the mean and range over every seed
        cell += f" · {r['seed_mean']:.2f} ({r['seed_min']:.2f}–{r['seed_max']:.2f})"
    return cell


def selection_order(t: pd.DataFrame) -> list[str]:
    """The selections of a transfer table in table order: AIE, MFA, the head lists, the two controls."""
    lists = [s for s in dict.fromkeys(t["selection"]) if s not in FIXED and s != "none"]
    return ["AIE", "MFA", *lists, "raw-magnitude", "random"]


def _wide(t: pd.DataFrame, st: pd.DataFrame, protocol: str) -> pd.DataFrame:
    rows = []
    sels = selection_order(t)
    for task in dict.fromkeys(t["task"]):
        g = t[t["task"] == task]
        s = st[st["task"] == task].iloc[0]
        row = {"task": task, "AIE∩MFA": f"{s['aie_mfa_overlap']}/{s['n_selected']}"}
        for name in sels[2:-2]:
            ov = s.get(f"{name}_mfa_overlap")
            row[f"{name}∩MFA"] = f"{ov}/{s['n_selected']}" if isinstance(ov, str) else ""
        for sel in sels:
            for cons in ("raw", "r"):
                r = g[(g["protocol"] == protocol) & (g["selection"] == sel) & (g["construction"] == cons)]
                row[f"{sel} {cons}"] = _cell(r.iloc[0]) if len(r) else ""
        for prot in ("zero-shot", "few-shot"):
            r = g[g["protocol"] == prot]
            row[prot] = _cell(r.iloc[0]) if len(r) else ""
        p = g[g["protocol"] == protocol]
        row["layer"] = p["layer"].iloc[0] if len(p) and protocol == "sum" else ""
        row["scale"] = p["scale"].iloc[0] if len(p) else ""
        rows.append(row)
    return pd.DataFrame(rows)


def md_rows(df: pd.DataFrame) -> list[str]:
    """A DataFrame as Markdown table lines."""
    cols = list(df.columns)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for _, r in df.iterrows():
        lines.append("| " + " | ".join(str(r[c]) for c in cols) + " |")
    return lines


NULLS = {"mean_field": "the mean field ẑ_: = Σ_t P_:t μ_t of the statistics half (eq:taskresid)",
         "type_mean": "the measured mean write at the cue's positions in the statistics half (the paper's GPT-J null)"}


def matrix_markdown(transfer: pd.DataFrame, stability: pd.DataFrame, protocol: str, model: str, revision: str,
                    conclusions: pd.DataFrame | None = None, null=("mean_field",)) -> str:
    """Table fv-matrix-body (``protocol="sum"``) or fv-matrix (``"per_head"``) with the controls, the zero-shot
    floor and the few-shot ceiling; in bold, per task, every AIE / MFA / head-list pipeline within the paper's tie
    margin (0.02) of the best of them."""
    w = _wide(transfer, stability, protocol)
    pipes = [x for x in selection_order(transfer) if x not in ("raw-magnitude", "random")]
    for i, task in enumerate(w["task"]):
        g = transfer[(transfer["task"] == task) & (transfer["protocol"] == protocol)
                     & transfer["selection"].isin(pipes)]
        if len(g):
            best = g["accuracy"].max()
            for _, r in g[g["accuracy"] >= best - TIE - 1e-12].iterrows():
                col = f"{r['selection']} {r['construction']}"
                w.loc[w.index[i], col] = f"**{w.loc[w.index[i], col]}**"
    what = ("the selected heads' vectors summed (residual units) and added to the residual stream entering the "
            "injection layer at the final token" if protocol == "sum" else
            "each selected head's vector added to that head's read at the final token of its own layer")
    lines = [f"# Function vectors: {model} @ {revision} ({'Table fv-matrix-body' if protocol == 'sum' else 'Table fv-matrix'})",
             "",
             f"Zero-shot transfer (accuracy on held-out pairs, pooled over the splits, Wilson 95% intervals): {what}. "
             "Selection: AIE (Todd et al.'s causal mediation), MFA (‖O_h r‖, eq:taskresid), raw-magnitude (‖O_h z̄‖, "
             "nothing subtracted), random heads" + "".join(f", {n} (a given head list)" for n in
                                                          selection_order(transfer)[2:-2]) +
             "; construction: raw (the heads' clean means) or MFA r. Each split tunes its layer and scale by one sweep "
             "on its own extraction pairs, held for every method of the split (per split, 'a/b/c', where the splits "
             "differ). Bold: within 0.02 of the best AIE / MFA / head-list pipeline (the paper's tie margin). "
             "zero-shot: no injection; few-shot: the held-out queries after extraction exemplars. The null r is "
             "measured against: " + "; ".join(NULLS.get(n, n) for n in null) + ".", ""]
    n_seeds = int(transfer["n_seeds"].max()) if "n_seeds" in transfer and len(transfer) else 1
    if n_seeds > 1:
        lines[-1:-1] = ["", f"Each cell: the first seed's accuracy [interval] · the mean (min–max) over {n_seeds} "
                        "prompt-sampling seeds (each draws its own pairs, splits, prompts and random heads); bold by "
                        "the first seed."]
    lines += md_rows(w)
    if conclusions is not None and len(conclusions):
        c = conclusions[conclusions["protocol"] == protocol].drop(columns="protocol")
        lines += ["", f"## The comparisons over {n_seeds} seeds", "",
                  "Best of the four AIE/MFA pipelines at each seed; the seeds at which the raw-magnitude control "
                  "falls below MFA·r (its raw vectors, the paper's control; its r vectors, the selection alone), "
                  "and at which MFA·r beats the random control.", ""] + md_rows(c)
    return "\n".join(lines) + "\n"
