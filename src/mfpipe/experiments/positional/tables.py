"""The positional slice's tables: ``positional_<model>_<revision>`` (every head's posVar and, on ``W_pos`` models,
its code share and decode; the cluster's rows of "what is moved", the BOS gate, magnification and geometry),
``positional_classes_…`` (the type-class test), ``positional_repeated_…`` (natural against repeated text) and
``positional_ablation_…`` (the dereferencing ablation: arms, consumers, categories), CSV and Markdown; and the curves
the figure draws (no model)."""

from __future__ import annotations

import numpy as np
import pandas as pd

from mfpipe.experiments.positional import analysis as An
from mfpipe.experiments.positional import fits as F
from mfpipe.workflow.tables import to_markdown

__all__ = ["curves", "positional_markdown", "ablation_tables", "ablation_markdown", "classes_markdown",
           "repeated_markdown"]

ROTARY_NOTE = ("This model has no learned absolute position table (rotary positions): the readings that need W_pos "
               "(its share, the decode's relation to it, the BOS gate's R² on it, magnification) are NaN, not faked; "
               "posVar, the cluster, the BOS gate's own statistics, the geometry of the writes and the ablation "
               "(with S from the smooth position fit) apply.")


def curves(occ, O, W_pos, T: int, heads, cfg: dict, n_bins: int = 16) -> pd.DataFrame:
    """Per cluster head and position bin: the mean attention on BOS and the mean signed coefficient of the positional
    write on its leading singular axis (the axis's sign as the SVD gives it: a curve may come out mirrored; the
    table's Spearman columns give the sign of the trend)."""
    c = {**An.DEFAULTS, **cfg}
    keep = An.head_masks(occ, c["min_position"], c["max_other"])
    edges = np.linspace(int(c["min_position"]), T, n_bins + 1)
    rows = []
    for l, h in heads:
        m = keep[:, l, h]
        if m.sum() <= 12:
            continue
        p = np.asarray(occ.position[m])
        fit = An.positional_write(occ.delta[m, l, h], p, O[l, h], W_pos, T, c["min_position"],
                                  int(c["wpos_components"]))
        lead, a = fit @ F.principal(fit)[1][:, 0], np.asarray(occ.bos[m, l, h], float)
        b = np.clip(np.digitize(p, edges) - 1, 0, n_bins - 1)
        for k in np.unique(b):
            sel = b == k
            rows.append(dict(head=f"L{l}H{h}", position=float(p[sel].mean()), a_mean=float(a[sel].mean()),
                             lead_mean=float(lead[sel].mean()), n=int(sel.sum())))
    return pd.DataFrame(rows, columns=["head", "position", "a_mean", "lead_mean", "n"])


def positional_markdown(heads: pd.DataFrame, ctab: dict, S_share: float, S_dim: int, model: str, revision: str,
                        cfg: dict) -> str:
    """Every head's row, then the cluster's readings (items 3-6 of App. positional)."""
    c = {**An.DEFAULTS, **cfg}
    wpos = bool(heads["wpos"].any())
    lines = [f"# Positional transport: {model} @ {revision} (App. positional)", "",
             f"Per head, over query occurrences of the eval half (positions >= {c['min_position']}, at most "
             f"{c['max_other']} of the head's attention on untracked keys): Δ = z_sX − z̄_s (the statistics half's "
             "per-type mean read) in residual units; posVar: the share of Δ's variance about its mean explained by "
             "an intercept and {p̃, p̃², sin 2πkp̃, cos 2πkp̃, k = 1..4} (p̃ = p/T); wpos_share: the share that is a "
             f"linear image of W_pos[p] (its top {c['wpos_components']} principal components over the kept "
             "positions); decode_r2: ridge decode of p from Δ (5-fold), beside a position-shuffled baseline. "
             f"Positional cluster: posVar >= {c['posvar_threshold']} among the top {An.n_top(len(heads), c)} of the "
             f"model's {len(heads)} heads by S̄ (top_fraction {c['top_fraction']}, at least {c['min_top']}); "
             f"carriers: wpos_share >= {c['carrier_threshold']}.", ""]
    if not wpos:
        lines += [ROTARY_NOTE, ""]
    lines += [to_markdown(heads), ""]
    rows = ctab["rows"]
    lines += ["## The positional cluster", ""]
    if not len(rows):
        lines += ["No head passes the cluster rule on this model and revision.", ""]
        return "\n".join(lines)
    lines += ["Per cluster head: the attended-key offset (s.d., median); offset_share / wpos_share / both_share: Δ's "
              "variance explained by offset features (one-hot small offsets, coarse bins), by the code, by both "
              "(offset_increment: what offsets add to the code); the BOS gate: bos_mean, a_r2_on_wpos (a(p) on the "
              "code), a_share (Δ on a(p) alone), write_top1..3 (the positional write's variance on its leading "
              "singular directions), Spearman of a(p), of the write's norm and of its leading signed coefficient "
              "with p; magnification: in_code_pcs (the write's variance inside the top ten principal components of "
              "the centred code), pointwise_cos (|cos| of write and centred code, mean), rms_ratio (RMS write / RMS "
              "code).", "", to_markdown(rows), ""]
    ov = ctab["overlaps"]
    if len(ov):
        lines += [f"Geometry: pairwise mean cos² of the principal angles between the heads' {c['write_rank']}-"
                  "dimensional write subspaces (chance: the expectation for random subspaces in this width), and "
                  "the |cos| between their position-readout directions.", "", to_markdown(ov), ""]
    m = ctab["model"]
    lines += [f"The code's participation ratio (centred W_pos[{c['min_position']}:T]): {m['participation_ratio']:.2f}. "
              f"S (the ablation's subspace): the top {S_dim} principal directions of the carriers' positional writes, "
              f"holding {S_share:.3f} of their variance.", ""]
    return "\n".join(lines)


def ablation_tables(res: dict, arms, categories: np.ndarray, L: int, H: int) -> dict:
    """From :func:`~mfpipe.experiments.positional.ablation.run_ablation`: ``arms`` (per arm: the mean loss increase;
    random draws: mean, s.d., min, max), ``categories`` (per arm and category of the predicted token: the mean
    increase and the token count) and ``consumers`` (per head: the L2 change of its attention rows)."""
    from mfpipe.experiments.positional.ablation import CATEGORIES

    base = res["base"]
    per = [float((x - base).mean()) for x in res["loss"]]
    out_rows, cat_rows = [], []
    names = [a[0] for a in arms]
    for name in dict.fromkeys(names):
        vals = [v for v, n in zip(per, names) if n == name]
        out_rows.append(dict(arm=name, draws=len(vals), loss_increase=float(np.mean(vals)),
                             sd=float(np.std(vals)) if len(vals) > 1 else np.nan, min=float(np.min(vals)),
                             max=float(np.max(vals)), base_loss=float(base.mean())))
        diff = np.mean([x - base for x, n in zip(res["loss"], names) if n == name], axis=0)
        for k, cat in enumerate(CATEGORIES):
            sel = categories == k
            cat_rows.append(dict(arm=name, category=cat, tokens=int(sel.sum()),
                                 loss_increase=float(diff[sel].mean()) if sel.any() else np.nan))
    arms_df = pd.DataFrame(out_rows)
    car = arms_df.set_index("arm")["loss_increase"]
    arms_df["specificity_vs_non_carriers"] = car.get("carriers", np.nan) / car.get("non-carriers", np.nan)
    arms_df["specificity_vs_random"] = car.get("carriers", np.nan) / car.get("random", np.nan)
    cons = pd.DataFrame([dict(layer=l, head=h, attention_change=float(res["consumers"][l, h]))
                         for l in range(L) for h in range(H)])
    return {"arms": arms_df, "categories": pd.DataFrame(cat_rows), "consumers": cons}


def ablation_markdown(tabs: dict, info: dict, model: str, revision: str) -> str:
    lines = [f"# Dereferencing the positional cluster: {model} @ {revision} (App. positional)", "",
             f"Mid-forward, S ({info['dim']} dimensions) projected out of the carriers' summed write "
             f"({info['carriers']}) at the output projection, on {info['windows']} eval windows; controls: the same "
             f"S out of the same layers' other heads ({info['non_carriers']}) and {info['n_random']} random "
             "orthonormal subspaces of S's dimension on the carriers (seeded: mean, s.d., min, max). Loss increase: "
             "mean next-token loss (nats) over the unablated forward's.", "", to_markdown(tabs["arms"]), "",
             "## By the category of the predicted token", "",
             "number: digits (a token inside a number); word-initial: a space, then a letter; continuation: a letter "
             "right after a token ending in a letter (a subword inside a word); punctuation; other.", "",
             to_markdown(tabs["categories"]), "", "## Consumers", "",
             "Per head: the mean L2 change of its attention row (per query) under the carriers' ablation.", "",
             to_markdown(tabs["consumers"].sort_values("attention_change", ascending=False, kind="stable")), ""]
    return "\n".join(lines)


def classes_markdown(table: pd.DataFrame, strings, model: str, revision: str) -> str:
    name = table["klass"].iloc[0] if len(table) else "class"
    return "\n".join([f"# Type-class test ({name}): {model} @ {revision} (App. readings)", "",
                      f"The class: {', '.join(map(str, strings))} ({int(table['n_class_types'].max()) if len(table) else 0}"
                      " tracked types pass 2 scored). Per head: the class's median rank among the head's per-type "
                      "deviations (1 = largest; pass 2's D by type, over the types with at least its min_occurrences "
                      "in every layer), one-sided Mann-Whitney p of class above the rest and its "
                      "Bonferroni correction over the heads; occurrence level: the class's per-occurrence deviations "
                      "against every other occurrence's (mean difference, two-sided p).", "",
                      to_markdown(table), ""])


def repeated_markdown(table: pd.DataFrame, info: dict, model: str, revision: str) -> str:
    return "\n".join([f"# Natural against repeated text: {model} @ {revision} (App. protocol, App. readings)", "",
                      f"Per head: the mean per-occurrence deviation D on natural eval text and on the second copy of "
                      f"{info['n_sequences']} [c; c] chunks (k = {info['k']}), against the same mean field; the rise "
                      "(repeated − natural) and its rank over all heads (1 = largest rise).", "",
                      to_markdown(table.sort_values("rise_rank", kind="stable")), ""])
