"""Mean-field deviation and in-context learning (paper Sec. 6.1 Experiments 1 and 2, Sec. 6.2, App. O).

Experiment 2 (:func:`measure_prompts`, prompts from :mod:`mfpipe.experiments.prompts.sets`): per prompt, at its query
(the last position ``q``; context = the whole prompt), with the statistics half's kernel ``W`` and value means ``μ``
(:class:`~mfpipe.meanfield.kernel.MeanFieldKernel`):

* ``D_MF`` = mean over layers and heads of ``D = 1 − cos(z, ẑ)`` (eq:deviation), ``M_cov`` / ``M_ctx`` the same
  means of ``σ_cov D`` / ``σ_ctx D`` (eq:mcov-mctx; ``M_cov + M_ctx = D_MF``): :func:`mfpipe.meanfield.deviation.meters` on
  the model's own reads, residual-stream units, exactly as pass 2 computes them;
* ``delta_L`` = loss(target | every head at every substituted position of the prompt reads ẑ) − loss(target |
  model) (eq:excess-loss at the query), through the adapter's ``patch_reads`` site with
  :func:`~mfpipe.meanfield.kernel.mean_field_replacement`, as the substitution does;
* ``delta_L_perm`` = L_model(πX) − L_model(X): π a seeded random permutation of positions ``1..q-1`` (BOS first and
  the query last stay); ``dzhat_perm`` = max over layers and heads of ‖ẑ(πX) − ẑ(X)‖ / ‖ẑ(X)‖ at the query, in
  residual-stream units (through each head's output-projection gram);
* ``correct``: the model's top-1 prediction at the query is the target.

A prompt whose query has no valid Â row in some layer (an untracked or unseen type, :mod:`mfpipe.meanfield.ccmf`) is skipped
and counted per class. :func:`class_table` (Tables icl / icl-terms), :func:`separation_table` (Table icl-corr:
Hedges' g against the random control, Welch p) summarise the per-prompt table (Fig. icl: :func:`mfpipe.experiments.prompts.figures.icl_figure`).

Experiment 1 (the instance meter on ``[BOS; c; c]``) is :mod:`mfpipe.experiments.prompts.meter`; both use
:func:`~mfpipe.meanfield.forward.deviation_forward` (with :func:`~mfpipe.meanfield.forward.kernel_for`, core
functions re-exported here).

Everything inside a batch is vectorized over positions, heads and layers' outputs; loops run over batches.
"""

from __future__ import annotations

import logging
from collections import Counter

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F

from mfpipe.experiments.prompts.sets import CLASSES, Prompt, ordered_classes
from mfpipe.meanfield.forward import METERS, deviation_forward, kernel_for
from mfpipe.meanfield.kernel import MeanFieldKernel, mean_field_replacement

__all__ = ["queryable_types", "kernel_for", "deviation_forward", "measure_prompts", "class_table", "hedges_g",
           "separation_table", "separation_markdown", "class_markdown", "PROMPT_COLUMNS", "SEPARATION_METRICS"]

log = logging.getLogger(__name__)

PROMPT_COLUMNS = ["cls", "task", "prompt", "length", "query", "target", "D_MF", "M_cov", "M_ctx", "loss_model",
                  "loss_mf", "delta_L", "loss_perm", "delta_L_perm", "dzhat_perm", "correct", "degenerate"]
SEPARATION_METRICS = ("D_MF", "M_cov", "M_ctx", "delta_L_perm")


def queryable_types(kernel: MeanFieldKernel) -> np.ndarray:
    """Token ids of the tracked types whose W row is finite with positive mass in every layer and head (the pool
    induction prompts draw from: their queries have a mean field)."""
    ids = np.flatnonzero(kernel.query_lut >= 0)
    ok = np.ones(kernel.n, dtype=bool)
    for l in kernel.attention_layers or range(kernel.n_layers):  # a hybrid's other layers have no W (NaN)
        Wl = kernel.W[l]
        ok &= (torch.isfinite(Wl).all(-1) & (Wl.nan_to_num(0.0).sum(-1) > 0)).all(0).cpu().numpy()
    return ids[ok[kernel.query_lut[ids]]]


def _last_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross entropy (float64) of ``target [B]`` under the last position's logits of ``[B, T, V]``."""
    return F.cross_entropy(logits[:, -1].double(), target.to(logits.device), reduction="none")


def _permute_inner(tokens: np.ndarray, rng: np.random.Generator, permutation=None) -> np.ndarray:
    """``tokens`` with positions ``1..n-2`` permuted (BOS and the query stay)."""
    n = tokens.shape[0]
    inner = max(n - 2, 0)
    perm = rng.permutation(inner) if permutation is None else np.asarray(permutation(inner, rng))
    out = tokens.copy()
    out[1 : 1 + inner] = tokens[1 + perm]
    return out


def measure_prompts(adapter, kernel: MeanFieldKernel, prompts: list[Prompt], *, batch_size: int = 8, seed: int = 0,
                    permutation=None, progress: bool = False, desc: str = "icl prompts"
                    ) -> tuple[pd.DataFrame, dict[str, int]]:
    """Per prompt (module docstring): a DataFrame with :data:`PROMPT_COLUMNS` (``prompt`` = index into
    ``prompts``) and the per-class count of skipped prompts (query without a valid Â row).

    Prompts of one length run as a batch (``batch_size`` at most). Three forwards per batch: clean (with the
    pass-2 reads), substituted (ẑ written at every substituted position) and permuted (clean). ``permutation``
    (tests): ``(n_inner, rng) -> index array`` instead of ``rng.permutation``; prompt ``i`` uses the generator
    ``default_rng((seed, i))``, so batching does not change the result."""
    from tqdm.auto import tqdm

    k = kernel_for(kernel, adapter)
    grams = k.grams(adapter)
    dev = k.device
    attention = list(k.attention_layers or range(k.n_layers))  # a hybrid's other layers: no heads, NaN meters
    by_len: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        if len(p) < 2:
            raise ValueError(f"prompt {i} ({p.cls}) has {len(p)} token(s); a prompt is [BOS, ..., query]")
        by_len.setdefault(len(p), []).append(i)
    chunks = [idx[j : j + int(batch_size)] for _, idx in sorted(by_len.items())
              for j in range(0, len(idx), int(batch_size))]
    rows, skipped = [], Counter()
    for chunk in tqdm(chunks, desc=desc, disable=not progress, mininterval=2.0, dynamic_ncols=True):
        toks = np.stack([prompts[i].tokens for i in chunk])
        kb, qt = k.buckets(toks)
        zh, sub = k.zhat(kb, qt)
        keep = sub[:, -1].cpu().numpy()
        for i in np.asarray(chunk)[~keep]:
            skipped[prompts[i].cls] += 1
        if not keep.any():
            continue
        chunk = [i for i, o in zip(chunk, keep) if o]
        kc, kd = torch.from_numpy(keep), torch.from_numpy(keep).to(dev)
        toks, kb, qt, sub = toks[keep], kb[kc], qt[kc], sub.to(dev)[kd]
        zh = [z[kd] for z in zh]
        ids = torch.from_numpy(toks)
        target = torch.as_tensor([prompts[i].target for i in chunk], dtype=torch.long)
        m, valid, clean = deviation_forward(adapter, k, ids, kb, qt, logits=True)
        loss_model = _last_loss(clean.logits, target).cpu()
        correct = (clean.logits[:, -1].argmax(-1).cpu() == target).numpy()
        del clean
        patched = adapter.run(ids, select=(), logits=True,
                              patch_reads=lambda layer, reads: mean_field_replacement(layer, reads, zh[layer], sub))
        loss_mf = _last_loss(patched.logits, target).cpu()
        del patched
        ptoks = np.stack([_permute_inner(prompts[i].tokens, np.random.default_rng((int(seed), int(i))), permutation)
                          for i in chunk])
        perm = adapter.run(torch.from_numpy(ptoks), select=(), logits=True)
        loss_perm = _last_loss(perm.logits, target).cpu()
        del perm
        zh2, sub2 = k.zhat(*k.buckets(ptoks))
        if not bool(sub2[:, -1].all()):
            raise RuntimeError("a permuted prompt lost its valid query: ẑ's validity must not depend on the order")
        zq, zq2 = torch.stack([z[:, -1] for z in zh], 1).double(), torch.stack([z[:, -1] for z in zh2], 1).double()
        G = grams.to(torch.float64)  # [L, H, dh, dh]
        num = torch.einsum("blhd,lhde,blhe->blh", zq2 - zq, G, zq2 - zq)
        den = torch.einsum("blhd,lhde,blhe->blh", zq, G, zq)
        dz = (num.clamp_min(0).sqrt() / den.clamp_min(1e-30).sqrt()).amax((1, 2)).cpu().numpy()
        q = {key: m[key][:, -1][:, attention].mean((1, 2)).cpu().numpy() for key in METERS}  # attention layers
        deg = m["degenerate"][:, -1].sum((1, 2)).cpu().numpy()
        for b, i in enumerate(chunk):
            p = prompts[i]
            rows.append({"cls": p.cls, "task": p.task, "prompt": int(i), "length": len(p), "query": p.query,
                         "target": p.target, "D_MF": q["D"][b], "M_cov": q["M_cov"][b], "M_ctx": q["M_ctx"][b],
                         "loss_model": float(loss_model[b]), "loss_mf": float(loss_mf[b]),
                         "delta_L": float(loss_mf[b] - loss_model[b]), "loss_perm": float(loss_perm[b]),
                         "delta_L_perm": float(loss_perm[b] - loss_model[b]), "dzhat_perm": float(dz[b]),
                         "correct": bool(correct[b]), "degenerate": int(deg[b])})
    for cls, c in sorted(skipped.items()):
        log.info("skipped %d %s prompt(s): the query has no valid mean-field row", c, cls)
    df = pd.DataFrame(rows, columns=PROMPT_COLUMNS).sort_values("prompt", kind="stable").reset_index(drop=True)
    return df, dict(skipped)


# ------------------------------------------------------------------ class tables (Tables icl, icl-terms, icl-corr)
def class_table(df: pd.DataFrame, classes=CLASSES) -> pd.DataFrame:
    """Per class (paper order): n, the means of D_MF, M_cov, M_ctx, ΔL, ΔL_perm and the model's loss, the
    maximum Δẑ_perm, top-1 accuracy, and the skipped count where given (``df.attrs['skipped']``)."""
    skipped = df.attrs.get("skipped", {})
    rows = []
    for c in ordered_classes(df, classes):
        s = df[df["cls"] == c]
        rows.append({"class": c, "n": len(s), "D_MF": s["D_MF"].mean(), "M_cov": s["M_cov"].mean(),
                     "M_ctx": s["M_ctx"].mean(), "delta_L": s["delta_L"].mean(),
                     "delta_L_perm": s["delta_L_perm"].mean(), "dzhat_perm_max": s["dzhat_perm"].max(),
                     "accuracy": s["correct"].astype(float).mean(), "loss_model": s["loss_model"].mean(),
                     "skipped": int(skipped.get(c, 0))})
    return pd.DataFrame(rows)


def class_markdown(table: pd.DataFrame) -> str:
    """The class table as Markdown (3 decimals; Δẑ_perm, ~1e-7, in scientific notation)."""
    from mfpipe.workflow.tables import to_markdown

    t = table.copy()
    t["dzhat_perm_max"] = [f"{v:.1e}" for v in t["dzhat_perm_max"]]
    return to_markdown(t)


def hedges_g(x, y) -> float:
    """Hedges' g of ``x`` against ``y``: the standardized mean difference with the small-sample correction.

    d = (mean x − mean y) / s_p,  s_p² = ((n_x − 1) s_x² + (n_y − 1) s_y²) / (n_x + n_y − 2)  (s² with ddof = 1);
    g = J d,  J = 1 − 3 / (4 (n_x + n_y) − 9) = 1 − 3 / (4 df − 1) with df = n_x + n_y − 2 (Hedges 1981's
    approximation of Γ(df/2) / (√(df/2) Γ((df − 1)/2))). NaN with fewer than 2 values on a side or s_p = 0."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    nx, ny = x.size, y.size
    if nx < 2 or ny < 2:
        return float("nan")
    sp = np.sqrt(((nx - 1) * x.var(ddof=1) + (ny - 1) * y.var(ddof=1)) / (nx + ny - 2))
    if not sp > 0:
        return float("nan")
    return float((1.0 - 3.0 / (4.0 * (nx + ny) - 9.0)) * (x.mean() - y.mean()) / sp)


def separation_table(df: pd.DataFrame, control: str = "random", metrics=SEPARATION_METRICS, classes=CLASSES
                     ) -> pd.DataFrame:
    """Table icl-corr, long: per (metric, class other than ``control``) the class and control means, Hedges' g
    (:func:`hedges_g`) and the Welch t-test p-value (``scipy.stats.ttest_ind(equal_var=False)``)."""
    from scipy.stats import ttest_ind

    ctrl = df[df["cls"] == control]
    rows = []
    for metric in metrics:
        y = ctrl[metric].to_numpy(np.float64)
        for c in ordered_classes(df, classes):
            if c == control:
                continue
            x = df.loc[df["cls"] == c, metric].to_numpy(np.float64)
            p = float(ttest_ind(x, y, equal_var=False).pvalue) if x.size >= 2 and y.size >= 2 else float("nan")
            rows.append({"metric": metric, "class": c, "n": x.size, "n_control": y.size,
                         "mean": float(x.mean()) if x.size else float("nan"),
                         "mean_control": float(y.mean()) if y.size else float("nan"),
                         "g": hedges_g(x, y), "p_welch": p})
    return pd.DataFrame(rows)


def separation_markdown(sep: pd.DataFrame, control: str = "random") -> str:
    """Table icl-corr as in App. O: metric rows, class columns, ``g (p)``."""
    from mfpipe.workflow.tables import to_markdown

    classes = list(dict.fromkeys(sep["class"]))
    rows = []
    for metric, s in sep.groupby("metric", sort=False):
        row = {"metric": metric}
        for c in classes:
            r = s[s["class"] == c]
            row[f"{c} (n={int(r['n'].iloc[0])})" if len(r) else c] = (
                f"{r['g'].iloc[0]:+.2f} (p={r['p_welch'].iloc[0]:.2g})" if len(r) else "")
        rows.append(row)
    n_ctrl = int(sep["n_control"].iloc[0]) if len(sep) else 0
    return (f"Hedges' g against the {control} control (n={n_ctrl}), Welch p in parentheses\n\n"
            + to_markdown(pd.DataFrame(rows)))
