"""The function-vector experiment of one (model, revision): Sec. 6.4 and App. fv, task by task.

Per task (:func:`run_task`):

1. ``n_pairs`` pairs drawn (:func:`~mfpipe.experiments.fv.prompts.task_pool`), cut ``n_splits`` times into
   ``n_extract`` extraction and the rest held-out pairs;
2. per split, ONE forward per clean few-shot prompt of the extraction pairs gives every head's mean read at the cue,
   ``z̄^{ℓh}``, and the task deviation ``r^{ℓh} = z̄^{ℓh} − ẑ^{ℓh}_:`` (eq:taskresid). Selections: **MFA** (top
   ``n_selected`` by ``‖O_h r‖``), the **raw-magnitude** control (top by ``‖O_h z̄‖``: the same average, nothing
   subtracted) and a **random** ``n_selected``-head control;
3. **AIE** (Todd et al.) once per task, on split 0: ``n_corrupted`` label-shuffled prompts, every head patched in
   turn with its clean mean; top ``n_selected`` by AIE, held fixed across splits (as the paper does);
4. constructions: **raw** (the heads' clean means ``z̄``) and **MFA r**;
5. one sweep on split 0's extraction pairs (zero-shot prompts) fixes the injection layer and scale of the summed
   protocol and the scale of the per-head protocol: the setting with the best accuracy averaged over the four
   AIE/MFA × raw/r pipelines (ties: the smaller scale, then the earlier layer), then held for every method, split
   and control;
6. evaluation on each split's held-out zero-shot prompts: accuracy (top-1 = the answer's first token), whether
   the top-1 falls in the task's answer category, and whether it is one of the extraction answers seen in the
   prompts; the zero-shot floor (no injection) and the few-shot ceiling (held-out queries after extraction
   exemplars);
7. the category analysis of App. fv-gpt2 on split 0: ranks of the extraction answers, the held-out answers,
   same-category answers in neither set and unrelated words under the J-lens (and the raw lens) for the summed
   vectors and for each MFA head's own component; and the per-prompt decode of App. fv-jlens (the rank of each
   prompt's own answer in its per-prompt residual ``O_h(z_{:,X} − ẑ_:)``).
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from mfpipe.experiments.fv import heads as Hd
from mfpipe.experiments.fv import inject as Inj
from mfpipe.experiments.fv import prompts as Pr

__all__ = ["DEFAULTS", "run_task", "run_tasks", "run_seeds", "resolve_tasks", "SELECTIONS", "CONSTRUCTIONS", "PROTOCOLS"]

SELECTIONS = ("AIE", "MFA", "raw-magnitude", "random")
CONSTRUCTIONS = ("raw", "r")
PROTOCOLS = ("sum", "per_head")
# the four pipelines that choose the injection setting and that the category analysis decodes
_PIPES = [(sel, cons) for sel in ("AIE", "MFA") for cons in CONSTRUCTIONS]

DEFAULTS = dict(n_pairs=60, n_extract=20, n_splits=3, n_shots=10, n_clean=20, n_corrupted=10, n_selected=10,
                layers=None, sum_scales=[1.0, 2.0, 4.0, 8.0], head_scales=[1.0, 2.0, 5.0, 10.0], null="mean_field",
                answer_prefix=" ", separator=":", joiner="\n", seed=0, n_seeds=3, batch_size=64, n_unrelated=50)


def _decoder(adapter, jlens):
    """``decode(vectors [n,d], layer, point) -> {lens: logits [n,V]}``: the raw logit lens, and the J-lens when a
    store is given (``point``: "block" = the residual entering that block, "attn" = the output projection's output)."""
    def decode(v: torch.Tensor, layer: int, point: str) -> dict:
        v = v.float().to(adapter.device)
        out = {"raw": adapter.unembed(v).float().cpu()}
        if jlens is not None:
            from mfpipe.jlens.lens import jlens_decode

            out["J"] = jlens_decode(adapter, jlens, int(layer), point, v).float().cpu()
        return out

    return decode


def _ranks(logits: torch.Tensor, ids) -> np.ndarray:
    """Rank (0 = top) of each token of ``ids`` in each row of ``logits [n,V]`` -> ``[n, len(ids)]``."""
    ids = torch.as_tensor(np.asarray(ids, dtype=np.int64))
    if not len(ids):
        return np.zeros((logits.shape[0], 0))
    val = logits[:, ids]  # [n, k]
    return (logits[:, None, :] > val[:, :, None]).sum(-1).numpy()


def run_task(adapter, task, tokenizer, bos_id: int, null, cfg: dict, *, other_categories=(),
             jlens=None, context_length: int | None = None, log=None, progress=None, pool=None) -> dict:
    """Everything of one task (module docstring). ``null``: ``cue token id -> the corpus null at that type [L,H,dh]``
    (e.g. :func:`~mfpipe.experiments.fv.heads.corpus_null` bound to the statistics half) or that tensor;
    ``other_categories``: the answer tokens of the run's other tasks (the unrelated population); ``pool``: the task's
    :func:`~mfpipe.experiments.fv.prompts.task_pool` with these settings, where the caller has drawn it already.

    Returns a dict of DataFrames: ``transfer`` (per split × protocol × selection × construction, plus the
    zero-shot / few-shot rows), ``heads`` (per split and head: the three scores and the selections), ``sweep``,
    ``ranks`` (category analysis), ``prompt_ranks`` (per-prompt decode) and ``info``."""
    c = {**DEFAULTS, **cfg}
    T = int(context_length or 1 << 30)
    seed = int(c["seed"])
    kw = dict(sep=c["separator"], answer_prefix=c["answer_prefix"], joiner=c["joiner"], context_length=T)
    if pool is None:
        pool = Pr.task_pool(task, tokenizer, bos_id, n_pairs=int(c["n_pairs"]), seed=seed, sep=c["separator"],
                            answer_prefix=c["answer_prefix"])
    cues = {int(p.tokens[-1]) for p in pool.zeroshot}
    if len(cues) == 1 and callable(null):
        null = null(next(iter(cues)))
    sp = Pr.splits(len(pool.pairs), int(c["n_extract"]), int(c["n_splits"]), seed)
    O = Hd.out_slices(adapter)
    per_split, cue = _extract_splits(adapter, task, pool, sp, tokenizer, bos_id, null, c, kw, cues, O, progress)

    # AIE: one mediation sweep per task, on split 0, held fixed
    s0 = per_split[0]
    corrupted = Pr.corrupted_prompts(pool, tokenizer, bos_id, s0["ext"], n_shots=c["n_shots"],
                                     n_prompts=c["n_corrupted"], seed=seed, **kw)
    aie, p_corrupt, _ = Hd.aie(adapter, corrupted, s0["zbar"], batch_size=int(c["batch_size"]), progress=progress)
    aie_sel = Hd.top_heads(aie.float(), int(c["n_selected"]))
    for d in per_split:
        d["sel"]["AIE"] = aie_sel

    sweep, best = _sweep(adapter, task, pool, s0, O, c, progress)
    rows, head_rows = _evaluate_splits(adapter, task, pool, per_split, aie, best, O, c, progress)
    pops = _rank_populations(adapter, pool, s0, bos_id, other_categories, c)
    decode = _decoder(adapter, jlens)
    rank_rows = _rank_rows(task, decode, pops, s0, best["sum"][0], O)
    prompt_rows = _prompt_rank_rows(task, decode, s0, null, O)
    info = dict(task=task.name, source=pool.source, n_usable=pool.n_usable, dropped=pool.dropped,
                n_pairs=len(pool.pairs), cue_token=int(cue), p_corrupted=p_corrupt, n_corrupted=len(corrupted),
                n_clean=[len(d["clean"]) for d in per_split], aie_heads=[f"L{l}H{h}" for l, h in aie_sel],
                mfa_heads=[[f"L{l}H{h}" for l, h in d["sel"]["MFA"]] for d in per_split],
                sum_layer=best["sum"][0], sum_scale=best["sum"][1], head_scale=best["per_head"][1])
    if log is not None:
        log.info("task %s: %d pairs (of %d usable), cue token %d; AIE heads %s; MFA heads (split 0) %s; injection "
                 "layer %d scale %g (sum), scale %g (per head); P(answer | corrupted) %.3f", task.name,
                 len(pool.pairs), pool.n_usable, cue, info["aie_heads"], info["mfa_heads"][0], best["sum"][0],
                 best["sum"][1], best["per_head"][1], p_corrupt)
    return dict(transfer=pd.DataFrame(rows), heads=pd.DataFrame(head_rows), sweep=sweep,
                ranks=pd.DataFrame(rank_rows), prompt_ranks=pd.DataFrame(prompt_rows), info=info)


def _vectors(d: dict, cons: str) -> torch.Tensor:
    """The heads' vectors of construction ``cons`` in one split: the clean means (raw) or the task deviation (r)."""
    return d["zbar"] if cons == "raw" else d["r"]


def _extract_splits(adapter, task, pool, sp, tokenizer, bos_id, null, c, kw, cues, O,
                    progress) -> tuple[list, int]:
    """Step 2 of every split of ``sp`` (the clean reads, the task deviation, the MFA / raw-magnitude / random
    selections and the few-shot ceiling's reads) -> (one dict per split, the answer-cuing token). Stops at the first
    split whose prompts end in a second cue token: the deviation needs one null type."""
    L, H, k, seed, bs = adapter.n_layers, adapter.n_heads, int(c["n_selected"]), int(c["seed"]), int(c["batch_size"])
    per_split = []
    for s, (ext, held) in enumerate(sp):
        clean = Pr.clean_prompts(pool, tokenizer, bos_id, ext, n_shots=c["n_shots"], n_prompts=c["n_clean"],
                                 seed=[seed, s], **kw)
        if not clean:
            raise ValueError(f"task {task.name!r}: no clean few-shot prompt fits the context of {kw['context_length']}"
                             " tokens")
        cues |= {int(p.tokens[-1]) for p in clean}
        if len(cues) > 1:
            break
        reads = Hd.cue_reads(adapter, clean, batch_size=bs, progress=progress)
        zbar = reads.mean
        r = Hd.task_deviation(zbar, null)
        mfa, raw = Hd.head_norms(r, O), Hd.head_norms(zbar, O)
        fs = Hd.cue_reads(adapter, Pr.fewshot_eval_prompts(pool, tokenizer, bos_id, ext, held, n_shots=c["n_shots"],
                                                            seed=[seed, s], **kw), batch_size=bs)
        per_split.append(dict(ext=ext, held=held, clean=clean, reads=reads, zbar=zbar, r=r, mfa=mfa, raw=raw,
                              fewshot=fs, sel={"MFA": Hd.top_heads(mfa, k), "raw-magnitude": Hd.top_heads(raw, k),
                                               "random": Hd.random_heads(L, H, k, [seed, 0xAA, s])}))
    if len(cues) != 1:
        raise ValueError(f"task {task.name!r}: the prompts end in {len(cues)} different tokens {sorted(cues)}; the "
                         "answer-cuing separator must encode as one token")
    return per_split, cues.pop()


def _sweep(adapter, task, pool, s0, O, c, progress) -> tuple[pd.DataFrame, dict]:
    """Step 5: the four AIE/MFA x raw/r pipelines on split 0's extraction pairs -> (the sweep's table, ``{protocol:
    (layer, scale, mean accuracy)}`` of the chosen setting)."""
    L = adapter.n_layers
    layers = list(range(L)) if c["layers"] is None else [int(x) for x in c["layers"]]
    bad = [x for x in layers if not 0 <= x < L]
    if bad:
        raise ValueError(f"fv.layers {bad}: this model has layers 0..{L - 1}")
    ext_zs = Pr.zeroshot_prompts(pool, s0["ext"])
    ext_ans = np.asarray([p.answer for p in ext_zs])
    sweep_rows, injs = [], []
    for layer in layers:
        for scale in c["sum_scales"]:
            for sel, cons in _PIPES:
                injs.append(Inj.sum_injection(_vectors(s0, cons), s0["sel"][sel], O, layer, scale))
                sweep_rows.append(("sum", layer, float(scale), sel, cons))
    for scale in c["head_scales"]:
        for sel, cons in _PIPES:
            injs.append(Inj.per_head_injection(_vectors(s0, cons), s0["sel"][sel], scale))
            sweep_rows.append(("per_head", -1, float(scale), sel, cons))
    top1, _ = Inj.evaluate(adapter, ext_zs, injs, batch_size=int(c["batch_size"]), progress=progress)
    sweep = pd.DataFrame(sweep_rows, columns=["protocol", "layer", "scale", "selection", "construction"])
    sweep["accuracy"] = (top1 == ext_ans[None, :]).mean(1)
    sweep.insert(0, "task", task.name)
    best = {}
    for prot, g in sweep.groupby("protocol"):
        m = g.groupby(["scale", "layer"], as_index=False)["accuracy"].mean()
        m = m.sort_values(["accuracy", "scale", "layer"], ascending=[False, True, True], kind="stable")
        best[prot] = (int(m.iloc[0]["layer"]), float(m.iloc[0]["scale"]), float(m.iloc[0]["accuracy"]))
    sweep["chosen"] = [best[p][:2] == (l, sc) for p, l, sc in zip(sweep["protocol"], sweep["layer"], sweep["scale"])]
    return sweep, best


def _evaluate_splits(adapter, task, pool, per_split, aie, best, O, c, progress) -> tuple[list, list]:
    """Step 6 on the held-out pairs of every split -> (the transfer rows, the per-head rows)."""
    rows, head_rows = [], []
    for s, d in enumerate(per_split):
        held_zs = Pr.zeroshot_prompts(pool, d["held"])
        ans = np.asarray([p.answer for p in held_zs])
        seen = set(pool.answers[d["ext"]].tolist())
        cat = set(pool.category.tolist())
        specs, injs = [("zero-shot", "none", "none")], [Inj.Injection()]
        for prot in PROTOCOLS:
            layer, scale, _ = best[prot]
            for sel in SELECTIONS:
                for cons in CONSTRUCTIONS:
                    v = _vectors(d, cons)
                    injs.append(Inj.sum_injection(v, d["sel"][sel], O, layer, scale) if prot == "sum"
                                else Inj.per_head_injection(v, d["sel"][sel], scale))
                    specs.append((prot, sel, cons))
        top1, pa = Inj.evaluate(adapter, held_zs, injs, batch_size=int(c["batch_size"]), progress=progress)
        for (prot, sel, cons), t1, p in zip(specs, top1, pa):
            rows.append(dict(task=task.name, split=s, protocol=prot, selection=sel, construction=cons, n=len(ans),
                             correct=int((t1 == ans).sum()), in_category=int(sum(int(t) in cat for t in t1)),
                             seen_answer=int(sum(int(t) in seen for t in t1)), p_answer=float(p.mean()),
                             layer=best[prot][0] if prot == "sum" else -1,
                             scale=best[prot][1] if prot in best else float("nan")))
        fs = d["fewshot"]
        rows.append(dict(task=task.name, split=s, protocol="few-shot", selection="none", construction="none",
                         n=len(fs.answers), correct=int((fs.top1 == fs.answers).sum()),
                         in_category=int(sum(int(t) in cat for t in fs.top1)),
                         seen_answer=int(sum(int(t) in seen for t in fs.top1)), p_answer=float(fs.p_answer.mean()),
                         layer=-1, scale=float("nan")))
        sel_sets = {name: set(v) for name, v in d["sel"].items()}
        for l in range(adapter.n_layers):
            for h in range(adapter.n_heads):
                head_rows.append(dict(task=task.name, split=s, layer=l, head=h, mfa_norm=float(d["mfa"][l, h]),
                                      raw_norm=float(d["raw"][l, h]), aie=float(aie[l, h]),
                                      **{f"sel_{n}": (l, h) in v for n, v in sel_sets.items()}))
    return rows, head_rows


def _rank_populations(adapter, pool, s0, bos_id, other_categories, c) -> dict:
    """Step 7's token populations on split 0: {seen, held-out, out-of-task, unrelated} -> token ids."""
    ext_ans_set = np.unique(pool.answers[s0["ext"]])
    held_set = np.setdiff1d(np.unique(pool.answers[s0["held"]]), ext_ans_set)
    unrelated = np.setdiff1d(np.unique(np.concatenate([np.asarray(x, np.int64) for x in other_categories]))
                             if len(other_categories) else np.zeros(0, np.int64), pool.category)
    if len(unrelated) < 5:  # no other task to draw from: random vocabulary ids outside the category
        V = int(adapter.model.get_output_embeddings().weight.shape[0])
        cand = np.setdiff1d(np.arange(V), np.concatenate([pool.category, [bos_id]]))
        unrelated = np.random.default_rng([int(c["seed"]), 0xC4]).choice(
            cand, size=min(int(c["n_unrelated"]), len(cand)), replace=False)
    return {"seen": ext_ans_set, "held-out": held_set, "out-of-task": pool.out_of_task, "unrelated": unrelated}


def _rank_rows(task, decode, pops, s0, lay0: int, O) -> list:
    """Step 7's category analysis (App. fv-gpt2): the populations' ranks under each lens for the summed vectors of
    the four pipelines (at the sweep's layer ``lay0``) and for each MFA head's own component."""
    rank_rows = []

    def add_ranks(what, layer, point, vec):
        for lens, lg in decode(vec[None], layer, point).items():
            row = dict(task=task.name, vector=what, layer=layer, point=point, lens=lens)
            for name, ids in pops.items():
                rk = _ranks(lg, ids)
                row[f"median_rank_{name}"] = float(np.median(rk)) if rk.size else float("nan")
                row[f"n_{name}"] = int(len(ids))
            row["top1"] = int(lg[0].argmax())
            rank_rows.append(row)

    for sel, cons in _PIPES:
        add_ranks(f"sum {sel} {cons}", lay0, "block", Inj.summed_vector(_vectors(s0, cons), s0["sel"][sel], O))
    for l, h in s0["sel"]["MFA"]:
        add_ranks(f"head L{l}H{h} r", l, "attn", s0["r"][l, h] @ O[l, h])
    return rank_rows


def _prompt_rank_rows(task, decode, s0, null, O) -> list:
    """Step 7's per-prompt decode (App. fv-jlens): the rank of each clean prompt's own answer in its per-prompt
    residual, for the first three MFA heads of split 0."""
    prompt_rows = []
    ans_clean = np.asarray([p.answer for p in s0["clean"]])
    for l, h in s0["sel"]["MFA"][:3]:
        resid = (s0["reads"].z[:, l, h] - null[l, h]) @ O[l, h]  # per-prompt residual, residual units
        for lens, lg in decode(resid, l, "attn").items():
            rk = (lg > lg[torch.arange(len(ans_clean)), torch.as_tensor(ans_clean)][:, None]).sum(-1).numpy()
            prompt_rows.append(dict(task=task.name, head=f"L{l}H{h}", lens=lens, n=len(rk),
                                    median_answer_rank=float(np.median(rk)), best_rank=int(rk.min()),
                                    top1_share=float(np.mean(rk == 0))))
    return prompt_rows


def resolve_tasks(names, files) -> list[tuple]:
    """(task, settings it overrides) of every task name (mfpipe.tasks vendored names, JSON paths, or "minisuite":
    the mini suite's tasks from its ``tasks.json`` among ``files``). The mini suite's tasks are written as it
    trained on them, ``x:y`` (no space before the answer); the rest use the configured format."""
    import json

    from mfpipe.tasks import FewShotTask, load_task

    tasks = []
    for name in names:
        if name == "minisuite":
            path = next(f for f in files if str(f).endswith("minisuite/tasks.json"))
            with open(path) as fh:
                for t in json.load(fh)["tasks"]:
                    tasks.append((FewShotTask(t["name"], [tuple(p) for p in t["pairs"]], source=t.get("source", path)),
                                  {"answer_prefix": ""}))
        else:
            tasks.append((load_task(name), {}))
    return tasks


def run_tasks(adapter, tasks, tokenizer, tracked, stats, cfg: dict, *, jlens=None, log=None,
              desc: str = "fv") -> tuple[dict, list]:
    """:func:`run_task` of every (task, overrides) of ``tasks`` (:func:`resolve_tasks`) with the statistics half
    ``stats`` (the corpus null at the cue) -> ({part: one DataFrame over the tasks}, [each task's info]). Every
    task's pool is drawn once first: its answer category is the "unrelated words" population of the others."""
    from tqdm.auto import tqdm

    T = int(stats.attrs.get("context_length") or 1 << 30)
    bos = int(tracked.bos_id)

    def null(cue):
        return Hd.corpus_null(stats, tracked, cue, cfg.get("null", "mean_field"))

    pools, cats = {}, {}
    for t, over in tasks:
        c = {**cfg, **over}
        try:
            pools[t.name] = Pr.task_pool(t, tokenizer, bos, n_pairs=int(c["n_pairs"]), seed=int(c["seed"]),
                                         sep=c["separator"], answer_prefix=c["answer_prefix"])
            cats[t.name] = pools[t.name].category
        except ValueError:  # run_task draws it again and stops the job with that error
            cats[t.name] = np.zeros(0, np.int64)
    parts, infos = {k: [] for k in ("transfer", "heads", "sweep", "ranks", "prompt_ranks")}, []
    with tqdm(desc=desc, unit="row", mininterval=5) as bar:
        for t, over in tasks:
            out = run_task(adapter, t, tokenizer, bos, null, {**cfg, **over}, jlens=jlens, context_length=T, log=log,
                           other_categories=[c for k, c in cats.items() if k != t.name], progress=bar,
                           pool=pools.get(t.name))
            for k in parts:
                parts[k].append(out[k])
            infos.append(out["info"])
    return {k: pd.concat(v, ignore_index=True) for k, v in parts.items()}, infos


def run_seeds(adapter, tasks, tokenizer, tracked, stats, cfg: dict, *, jlens=None, log=None,
              desc: str = "fv") -> tuple[dict, list]:
    """:func:`run_tasks` once per prompt-sampling seed ``seed, seed + 1, …`` (``n_seeds`` of them): each seed draws
    its own pairs, splits, prompts and random heads, so the spread over seeds shows how far the comparisons move with
    the prompts sampled. -> ({part: one DataFrame over seeds and tasks, with a ``seed`` column}, [each seed's and
    task's info, with ``seed``])."""
    c = {**DEFAULTS, **cfg}
    parts, infos = {}, []
    for i in range(int(c["n_seeds"])):
        seed = int(c["seed"]) + i
        res, inf = run_tasks(adapter, tasks, tokenizer, tracked, stats, {**c, "seed": seed}, jlens=jlens, log=log,
                             desc=f"{desc} seed {seed}")
        for k, df in res.items():
            parts.setdefault(k, []).append(df.assign(seed=seed))
        infos += [{**i_, "seed": seed} for i_ in inf]
    return {k: pd.concat(v, ignore_index=True) for k, v in parts.items()}, infos
