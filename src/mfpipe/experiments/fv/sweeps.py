"""The function-vector experiment's sweeps over injection settings and over the number of clean prompts, per split.

* :func:`tuning_sweep`: the layer / scale sweep that fixes each split's injection setting, on THAT split's
  extraction pairs (zero-shot prompts): the setting with the best accuracy averaged over the four AIE/MFA × raw/r
  pipelines (ties: the smaller scale, then the earlier layer), held for every method of the split. Each split tunes
  on its own extraction pairs, so no pair a split is scored on was used to tune it (the splits are independent
  permutations of one pool, so one split's extraction pairs are another's held-out pairs).
* :func:`raw_magnitude_sweep`: the raw-magnitude control (both constructions) at EVERY setting of the same grid,
  scored on the held-out pairs: the paper's reading of the control is "0.00 at every scale", so its best cell is
  reported, not only the cell the pipelines chose (scoring the control's own best cell on the held-out pairs favours
  the control: a conservative test of the claim that it fails).
* :func:`clean_sweep`: MFA·r against the number of clean prompts (the claim that the corpus null lets a function
  vector be extracted from as little as one behaviour-exhibiting prompt): the task deviation ``r`` and the MFA
  selection from the split's first ``n`` clean prompts only, injected at the split's chosen setting under both
  protocols, scored on its held-out pairs. At ``n`` = every clean prompt it is the main table's MFA·r cell.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from mfpipe.experiments.fv import heads as Hd
from mfpipe.experiments.fv import inject as Inj
from mfpipe.experiments.fv import prompts as Pr

__all__ = ["PIPES", "sweep_layers", "tuning_sweep", "raw_magnitude_sweep", "clean_sweep", "vectors"]

#: the four pipelines that choose the injection setting and that the category analysis decodes
PIPES = [(sel, cons) for sel in ("AIE", "MFA") for cons in ("raw", "r")]


def vectors(d: dict, cons: str):
    """The heads' vectors of construction ``cons`` in one split: the clean means (raw) or the task deviation (r)."""
    return d["zbar"] if cons == "raw" else d["r"]


def sweep_layers(adapter, c: dict) -> list[int]:
    L = adapter.n_layers
    layers = list(range(L)) if c["layers"] is None else [int(x) for x in c["layers"]]
    bad = [x for x in layers if not 0 <= x < L]
    if bad:
        raise ValueError(f"fv.layers {bad}: this model has layers 0..{L - 1}")
    return layers


def _grid(adapter, c: dict, d: dict, pipes) -> tuple[list, list]:
    """Every (protocol, layer, scale, selection, construction) of the grid for ``pipes`` -> (specs, injections)."""
    O = d["O"]
    specs, injs = [], []
    for layer in sweep_layers(adapter, c):
        for scale in c["sum_scales"]:
            for sel, cons in pipes:
                injs.append(Inj.sum_injection(vectors(d, cons), d["sel"][sel], O, layer, scale))
                specs.append(("sum", layer, float(scale), sel, cons))
    for scale in c["head_scales"]:
        for sel, cons in pipes:
            injs.append(Inj.per_head_injection(vectors(d, cons), d["sel"][sel], scale))
            specs.append(("per_head", -1, float(scale), sel, cons))
    return specs, injs


def _scored(adapter, task, prompts, specs, injs, c, progress, split: int, pairs: str) -> pd.DataFrame:
    ans = np.asarray([p.answer for p in prompts])
    top1, _ = Inj.evaluate(adapter, prompts, injs, batch_size=int(c["batch_size"]), progress=progress)
    df = pd.DataFrame(specs, columns=["protocol", "layer", "scale", "selection", "construction"])
    df.insert(0, "pairs", pairs)
    df.insert(0, "split", split)
    df.insert(0, "task", task.name)
    df["n"] = len(ans)
    df["correct"] = (top1 == ans[None, :]).sum(1)
    df["accuracy"] = df["correct"] / max(1, len(ans))
    return df


def tuning_sweep(adapter, task, pool, d: dict, split: int, c: dict, progress) -> tuple[pd.DataFrame, dict]:
    """The four AIE/MFA × raw/r pipelines of split ``d`` on its extraction pairs -> (the sweep's rows, ``{protocol:
    (layer, scale, mean accuracy)}`` of the chosen setting)."""
    specs, injs = _grid(adapter, c, d, PIPES)
    sweep = _scored(adapter, task, Pr.zeroshot_prompts(pool, d["ext"]), specs, injs, c, progress, split, "extraction")
    best = {}
    for prot, g in sweep.groupby("protocol"):
        m = g.groupby(["scale", "layer"], as_index=False)["accuracy"].mean()
        m = m.sort_values(["accuracy", "scale", "layer"], ascending=[False, True, True], kind="stable")
        best[prot] = (int(m.iloc[0]["layer"]), float(m.iloc[0]["scale"]), float(m.iloc[0]["accuracy"]))
    sweep["chosen"] = [best[p][:2] == (l, sc) for p, l, sc in zip(sweep["protocol"], sweep["layer"], sweep["scale"])]
    return sweep, best


def raw_magnitude_sweep(adapter, task, pool, per_split: list, c: dict, progress) -> pd.DataFrame:
    """The raw-magnitude control (raw and r) at every setting of the sweep grid, on each split's held-out pairs
    (``chosen`` marks the split's setting)."""
    out = []
    for s, d in enumerate(per_split):
        specs, injs = _grid(adapter, c, d, [("raw-magnitude", "raw"), ("raw-magnitude", "r")])
        df = _scored(adapter, task, Pr.zeroshot_prompts(pool, d["held"]), specs, injs, c, progress, s, "held-out")
        df["chosen"] = [d["best"][p][:2] == (l, sc) for p, l, sc in zip(df["protocol"], df["layer"], df["scale"])]
        out.append(df)
    return pd.concat(out, ignore_index=True)


def clean_sweep(adapter, task, pool, per_split: list, null, c: dict, progress) -> pd.DataFrame:
    """MFA·r from the first ``n`` clean prompts of each split, for every ``n`` of ``fv.clean_sweep`` up to the
    split's clean prompts, at the split's chosen setting (both protocols), on its held-out pairs."""
    k = int(c["n_selected"])
    rows = []
    for s, d in enumerate(per_split):
        held = Pr.zeroshot_prompts(pool, d["held"])
        ans = np.asarray([p.answer for p in held])
        ns = sorted({int(n) for n in c["clean_sweep"] if 1 <= int(n) <= len(d["clean"])})
        if not ns:
            raise ValueError(f"task {task.name!r}: fv.clean_sweep {list(c['clean_sweep'])} names no count between 1 "
                             f"and the split's {len(d['clean'])} clean prompts (fv.n_clean); give one in that range")
        specs, injs = [], []
        for n in ns:
            r = Hd.task_deviation(d["reads"].z[:n].mean(0), null)
            g = None if d["reads"].g is None else d["reads"].g[:n]  # the first n cues' gates, as their reads
            On = Hd.written_slices(d.get("O_heads", d["O"]), g)
            sel = Hd.top_heads(Hd.head_norms(r, On), k, adapter.attention_layers)
            for prot in ("sum", "per_head"):
                layer, scale, _ = d["best"][prot]
                injs.append(Inj.sum_injection(r, sel, On, layer, scale) if prot == "sum"
                            else Inj.per_head_injection(r, sel, scale))
                specs.append((n, prot, layer if prot == "sum" else -1, scale, " ".join(f"L{l}H{h}" for l, h in sel)))
        top1, _ = Inj.evaluate(adapter, held, injs, batch_size=int(c["batch_size"]), progress=progress)
        for (n, prot, layer, scale, heads), t1 in zip(specs, top1):
            rows.append(dict(task=task.name, split=s, n_clean=n, protocol=prot, selection="MFA", construction="r",
                             n=len(ans), correct=int((t1 == ans).sum()), layer=layer, scale=scale, heads=heads))
    return pd.DataFrame(rows)
