"""The function-vector experiment's Markdown beyond the two matrices: ``fv_details`` (the selections' stability, the
head lists' recovery, the protocol tests and tallies, the raw-magnitude control's sweep, the category analysis and
the per-prompt decode over every head) and ``fv_clean`` (MFA·r against the number of clean prompts), from
:func:`mfpipe.experiments.fv.tables.fv_tables`."""

from __future__ import annotations

import numpy as np
import pandas as pd

from mfpipe.experiments.fv.tables import NULLS, md_rows

__all__ = ["details_markdown", "clean_markdown"]


def _fmt_p(p) -> str:
    return "n/a" if p is None or not np.isfinite(p) else f"{p:.2g}"


def _selection_sections(tabs: dict) -> list[str]:
    lines = ["## Stability of the selections", "",
             "Heads shared by the MFA selections of each pair of splits; AIE∩MFA, raw-magnitude∩MFA and each head "
             "list's ∩MFA per split (min–max); the mean answer probability on the label-shuffled prompts AIE starts "
             "from (per split, min–max). AIE is computed per split, on the split's own extraction pairs.", ""]
    st = tabs["stability"]
    cols = ["task", "n_selected", "mfa_shared_across_splits", "aie_mfa_overlap", "raw_mfa_overlap"]
    cols += [c for c in st.columns if c.endswith("_mfa_overlap") and c not in cols]
    lines += md_rows(st[cols + ["p_answer_corrupted", "aie_heads", "mfa_heads_split0"]])
    lines += _section(tabs.get("recovery"), "Head lists recovered by the pipeline's own AIE",
                      "Per split: how many of the list's k heads AIE's top k holds (recovered), how many of AIE's top "
                      "five are the list's first five (top5; exact: the two sets equal), and the list's overlap with "
                      "the split's MFA selection.")
    lines += _section(tabs.get("conclusions"), "Stability over the prompt-sampling seeds",
                      "The comparisons of Tables fv-matrix-body (sum) and fv-matrix (per_head) at each seed: the best "
                      "of the four AIE/MFA pipelines, the seeds at which the raw-magnitude control falls below MFA·r "
                      "(its raw vectors; its r vectors), and at which MFA·r beats the random control.")
    return lines


def _section(df, title: str, text: str) -> list[str]:
    """A titled section with its explanation and ``df`` as a table; nothing where ``df`` is missing or empty."""
    if df is None or not len(df):
        return []
    return ["", f"## {title}", "", text, ""] + md_rows(df)


def _protocol_sections(tabs: dict) -> list[str]:
    p = tabs["protocol"]
    lines = ["", "## Does the injection protocol reorder the selections? (App. fv-validations)", "",
             f"Over the {p['n_cells']} paired task × split × selection × construction cells (AIE and MFA): per-head "
             f"injection {p['mean_per_head']:.3f} against summed {p['mean_sum']:.3f}, difference "
             f"{p['mean_difference']:+.3f} (Wilcoxon signed-rank p = {_fmt_p(p['wilcoxon_p'])}). The penalty of "
             f"summing: {p['penalty_AIE']:+.3f} on AIE's heads, {p['penalty_MFA']:+.3f} on MFA's (Mann-Whitney p = "
             f"{_fmt_p(p['mannwhitney_p'])}).", "",
             "The deviation against the raw construction, over the task × selection cells (AIE, MFA) of each "
             "protocol: cells where r ≥ raw, and where r is within the 0.02 tie margin or above.", ""]
    lines += md_rows(tabs["tally"].round(3))
    rb = tabs.get("raw_best")
    if rb is not None and len(rb):
        lines += ["", "## The raw-magnitude control at every setting", "",
                  "The control's transfer pooled over the splits at every cell (layer × scale) of the pipelines' "
                  "sweep grid, on the held-out pairs: its best cell, its worst, and its cell at the pipelines' "
                  "chosen setting.", ""]
        lines += md_rows(rb.round(3))
    return lines


def _decode_sections(tabs: dict, n_best: int) -> list[str]:
    lines = []
    rk = tabs["category"]
    if len(rk):
        pops = [c for c in rk.columns if c.startswith("median_rank_")]
        sizes = {c[len("n_"):]: int(rk[c].iloc[0]) for c in rk.columns if c.startswith("n_")}
        is_head = rk["vector"] == "head r"
        show = rk[~is_head | (rk["selections"].fillna("") != "") | (rk["head_order"] < n_best)]
        lines += ["", "## The vectors under the lenses (split 0)", "",
                  "Median vocabulary rank (0 = top) of four populations: answers seen in the extraction prompts, "
                  "held-out answers, answers of the task's category appearing nowhere among its drawn pairs "
                  "(out-of-task) and unrelated words (a fixed generic list); sizes "
                  + ", ".join(f"{k} {v}" for k, v in sizes.items()) + ". Rows: each pipeline's summed vector at its "
                  "injection layer, then each head's own component O_h r at its layer: the heads of the selections "
                  f"and the {n_best} best-decoding heads over all heads (head_order: the place among all heads by "
                  "the answers' median rank, seen and held-out together). J: the J-lens W_U J_ℓ; raw: the logit "
                  "lens. Every head's row is in ranks.csv.", ""]
        cols = ["task", "vector", "layer", "head", "lens", "selections", "head_order"] + pops
        lines += md_rows(show[[c for c in cols if c in show]].round(1))
    pr = tabs["prompt_ranks"]
    if len(pr):
        show = pr[(pr["selections"] != "") | (pr["head_order"] < n_best)]
        lines += ["", "## Per-prompt residuals decoded (App. fv-jlens)", "",
                  "Each clean prompt's residual O_h(z_{:,X} − ẑ_:), decoded at its head's layer: the rank of that "
                  f"prompt's own answer. The heads of the selections and the {n_best} best-decoding heads over all "
                  "heads (head_order, by the median rank).", ""]
        lines += md_rows(show.drop(columns=["layer", "head_index"], errors="ignore").round(2))
    return lines


def details_markdown(tabs: dict, model: str, revision: str, n_best: int = 5) -> str:
    """The selections' stability and recovery, the protocol tests, the category analysis (App. fv-gpt2) and the
    per-prompt decode (App. fv-jlens)."""
    t = tabs["transfer"]
    lines = [f"# Function vectors: {model} @ {revision}: stability, protocols, categories, lenses", "",
             "Null: " + "; ".join(NULLS.get(n, n) for n in tabs.get("null", ["mean_field"])) + ".", ""]
    lines += _selection_sections(tabs)
    lines += _protocol_sections(tabs)
    cat = t[t["protocol"].isin(["sum", "per_head", "zero-shot"])][
        ["task", "protocol", "selection", "construction", "accuracy", "category_rate", "seen_rate"]].round(3)
    lines += ["", "## Does the injected answer fall in the task's category?", "",
              "Top-1 answers: correct, in the task's answer category (any answer of the task), one of the answers "
              "seen in the extraction prompts.", ""]
    lines += md_rows(cat)
    lines += _decode_sections(tabs, n_best)
    jc = tabs.get("jlens_checks")
    if jc is not None and len(jc):
        lines += ["", "## The J-lens these decodes read", "",
                  "How far its estimate can be trusted: per insertion point and layer, the relative Frobenius "
                  "difference between the estimates of two disjoint halves of its positions (split_half_rel_diff), and "
                  "of the estimate from the first k positions against all of them (rel_diff_n<k>). The raw / J-lens "
                  "decode agreement by layer is in the J-lens job's own table (jlens_checks_<model>_<revision>).", ""]
        lines += md_rows(jc.drop(columns=["check_rows"], errors="ignore").round(4))
    return "\n".join(lines) + "\n"


def clean_markdown(clean: pd.DataFrame, model: str, revision: str) -> str:
    """MFA·r against the number of clean prompts (pooled over the splits, Wilson intervals), AIE's pipelines beside."""
    lines = [f"# Function vectors from few clean prompts: {model} @ {revision}", "",
             "MFA·r with the task deviation r and the MFA selection computed from the split's first n clean prompts "
             "only (n = 1: one behaviour-exhibiting prompt and the corpus null), injected at the split's chosen "
             "setting, on its held-out pairs; pooled over the splits, Wilson 95% intervals. AIE_raw (Todd et al.'s "
             "pipeline) and AIE_r: the AIE selection's transfer at every clean prompt (and its corrupted prompts), "
             "the reference line.", ""]
    if not len(clean):
        return "\n".join(lines + ["No clean-prompt sweep ran (fv.clean_sweep is empty)."]) + "\n"
    cols = ["task", "protocol", "n_clean", "n", "correct", "accuracy", "ci_lo", "ci_hi", "AIE_raw", "AIE_r"]
    lines += md_rows(clean[cols].round(3))
    return "\n".join(lines) + "\n"
