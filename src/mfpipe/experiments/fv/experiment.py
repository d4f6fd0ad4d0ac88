"""The function-vector experiment of one (model, revision): Sec. 6.4 and App. fv, task by task.

Per task (:func:`run_task`):

1. ``n_pairs`` pairs drawn (:func:`~mfpipe.experiments.fv.prompts.task_pool`), cut ``n_splits`` times into
   ``n_extract`` extraction and the rest held-out pairs;
2. per split, ONE forward per clean few-shot prompt of the extraction pairs gives every head's mean read at the cue,
   ``z̄^{ℓh}``, and the task deviation ``r^{ℓh} = z̄^{ℓh} − ẑ^{ℓh}_:`` (eq:taskresid). Selections: **MFA** (top
   ``n_selected`` by ``‖O_h r‖``), the **raw-magnitude** control (top by ``‖O_h z̄‖``: the same average, nothing
   subtracted), a **random** ``n_selected``-head control, and every **head list** the config gives for the model
   (``fv.head_lists``, e.g. Todd et al.'s ten GPT-J heads as ``todd``), fixed;
3. per split, **AIE** (Todd et al.): ``n_corrupted`` label-shuffled prompts of the split's extraction pairs, every
   head patched in turn with its clean mean; top ``n_selected`` by AIE. The paper holds one AIE sweep per task
   fixed across splits; computed on split 0's extraction pairs, that selection would have seen about a third of
   the other splits' held-out pairs, so each split runs its own (the MFA selection is per split already);
4. constructions: **raw** (the heads' clean means ``z̄``) and **MFA r**;
5. per split, one sweep on the split's own extraction pairs (zero-shot prompts) fixes the injection layer and scale
   of the summed protocol and the scale of the per-head protocol, held for every method and control of the split
   (:mod:`~mfpipe.experiments.fv.sweeps`): tuning, selection and evaluation never share a pair;
6. evaluation on each split's held-out zero-shot prompts: accuracy (top-1 = the answer's first token), whether
   the top-1 falls in the task's answer category, and whether it is one of the extraction answers seen in the
   prompts; the zero-shot floor (no injection) and the few-shot ceiling (held-out queries after extraction
   exemplars); the raw-magnitude control at every setting of the grid; MFA·r against the number of clean prompts;
7. the category analysis of App. fv-gpt2 and the per-prompt decode of App. fv-jlens on split 0, over every head
   (:mod:`~mfpipe.experiments.fv.decode`).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from mfpipe.experiments.fv import decode as Dc
from mfpipe.experiments.fv import heads as Hd
from mfpipe.experiments.fv import inject as Inj
from mfpipe.experiments.fv import prompts as Pr
from mfpipe.experiments.fv import sweeps as Sw

__all__ = ["DEFAULTS", "run_task", "run_tasks", "run_seeds", "resolve_tasks", "selections", "task_head_lists",
           "SELECTIONS", "CONSTRUCTIONS", "PROTOCOLS", "RESERVED", "PARTS"]

#: the selections every task runs; head lists (``fv.head_lists``) join after MFA (:func:`selections`)
SELECTIONS = ("AIE", "MFA", "raw-magnitude", "random")
CONSTRUCTIONS = ("raw", "r")
PROTOCOLS = ("sum", "per_head")
#: the per-row results of :func:`run_task` (each a DataFrame)
PARTS = ("transfer", "heads", "sweep", "clean", "ranks", "prompt_ranks")
#: names a head list may not take: the selections' and the floor/ceiling rows'
RESERVED = (*SELECTIONS, "none")

DEFAULTS = dict(n_pairs=60, n_extract=20, n_splits=3, n_shots=10, n_clean=20, n_corrupted=10, n_selected=10,
                layers=None, sum_scales=[1.0, 2.0, 4.0, 8.0], head_scales=[1.0, 2.0, 5.0, 10.0], null="mean_field",
                answer_prefix=" ", separator=":", joiner="\n", seed=0, n_seeds=3, batch_size=64,
                populations={"seen": 10, "held_out": 10, "out_of_task": 15, "unrelated": 15},
                clean_sweep=[1, 2, 5, 10, 20], head_lists={})


def selections(lists) -> tuple[str, ...]:
    """The selections of a task in table order: AIE, MFA, the head lists', the two controls."""
    return ("AIE", "MFA", *lists, "raw-magnitude", "random")


def task_head_lists(head_lists: dict, task: str, n_layers: int, n_heads: int) -> dict:
    """``fv.head_lists`` as the job receives it (``{name: {task or "*": ["L15H5", ...]}}``, this model's) -> the
    lists of ``task``: ``{name: [(layer, head), ...]}`` (its own list where one names the task, else the ``"*"``
    one; none: the list does not run on the task). Refused with the list's name where a head is not this model's."""
    out = {}
    for name, by_task in (head_lists or {}).items():
        if name in RESERVED:
            raise ValueError(f"fv.head_lists: the name {name!r} is taken (reserved: {', '.join(RESERVED)}); rename it")
        heads = by_task.get(task, by_task.get("*"))
        if heads is not None:
            out[name] = Hd.parse_heads(heads, n_layers, n_heads, f"fv.head_lists {name!r}")
    return out


def run_task(adapter, task, tokenizer, bos_id: int, null, cfg: dict, *, jlens=None,
             context_length: int | None = None, log=None, progress=None, pool=None) -> dict:
    """Everything of one task (module docstring). ``null``: ``cue token id -> the corpus null at that type [L,H,dh]``
    (e.g. :func:`~mfpipe.experiments.fv.heads.corpus_null` bound to the statistics half) or that tensor; ``pool``:
    the task's :func:`~mfpipe.experiments.fv.prompts.task_pool` with these settings, where the caller has drawn it.

    Returns a dict of DataFrames: ``transfer`` (per split × protocol × selection × construction, plus the
    zero-shot / few-shot rows), ``heads`` (per split and head: the three scores and the selections), ``sweep`` (the
    tuning sweep on each split's extraction pairs, the raw-magnitude control's on its held-out pairs), ``clean`` (the
    clean-prompt sweep), ``ranks`` (category analysis), ``prompt_ranks`` (per-prompt decode) and ``info``."""
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
    lists = task_head_lists(c["head_lists"], task.name, adapter.n_layers, adapter.n_heads)
    sp = Pr.splits(len(pool.pairs), int(c["n_extract"]), int(c["n_splits"]), seed)
    O = Hd.out_slices(adapter)
    per_split, cue = _extract_splits(adapter, task, pool, sp, tokenizer, bos_id, null, c, kw, cues, O, lists,
                                     progress)
    sweeps = [_tune_split(adapter, task, pool, d, s, tokenizer, bos_id, c, kw, progress)
              for s, d in enumerate(per_split)]
    sweeps.append(Sw.raw_magnitude_sweep(adapter, task, pool, per_split, c, progress))
    rows, head_rows = _evaluate_splits(adapter, task, pool, per_split, selections(lists), c, progress)
    clean = Sw.clean_sweep(adapter, task, pool, per_split, null, c, progress)
    s0 = per_split[0]
    pops = Dc.populations(tokenizer, pool, s0, bos_id, c["populations"], seed, c["answer_prefix"])
    pipes = Sw.PIPES + [(name, cons) for name in lists for cons in CONSTRUCTIONS]
    rank_rows, prompt_rows = Dc.lens_rows(adapter, jlens, lambda decode: (
        Dc.rank_rows(task, decode, pops, s0, s0["O"], pipes, s0["best"]["sum"][0]),
        Dc.prompt_rank_rows(task, decode, s0, null, O)))
    info = _info(task, pool, per_split, cue, lists)
    if log is not None:
        log.info("task %s: %d pairs (of %d usable, %d dropped), cue token %d; split 0: AIE heads %s, MFA heads %s, "
                 "injection layer %d scale %g (sum), scale %g (per head); P(answer | corrupted) %.3f", task.name,
                 len(pool.pairs), pool.n_usable, pool.dropped, cue, info["aie_heads"][0], info["mfa_heads"][0],
                 *s0["best"]["sum"][:2], s0["best"]["per_head"][1], s0["p_corrupt"])
    return dict(transfer=pd.DataFrame(rows), heads=pd.DataFrame(head_rows),
                sweep=pd.concat(sweeps, ignore_index=True), clean=clean, ranks=pd.DataFrame(rank_rows),
                prompt_ranks=pd.DataFrame(prompt_rows), info=info)


def _heads_str(heads) -> list[str]:
    return [f"L{l}H{h}" for l, h in heads]


def _info(task, pool, per_split, cue, lists) -> dict:
    """The task's record: pools, prompts, selections and settings per split, and the pairs each split tuned on
    (its sweep's and its AIE prompts', queries and exemplars) beside its held-out pairs."""
    return dict(task=task.name, source=pool.source, n_usable=pool.n_usable, dropped=pool.dropped,
                dropped_undefined=int(pool.meta.get("undefined", 0)), dropped_copy=int(pool.meta.get("copy", 0)),
                n_pairs=len(pool.pairs), cue_token=int(cue),
                p_corrupted=[d["p_corrupt"] for d in per_split], n_corrupted=[d["n_corrupted"] for d in per_split],
                n_clean=[len(d["clean"]) for d in per_split],
                aie_heads=[_heads_str(d["sel"]["AIE"]) for d in per_split],
                mfa_heads=[_heads_str(d["sel"]["MFA"]) for d in per_split],
                head_lists={name: _heads_str(h) for name, h in lists.items()},
                sum_layer=[d["best"]["sum"][0] for d in per_split], sum_scale=[d["best"]["sum"][1] for d in per_split],
                head_scale=[d["best"]["per_head"][1] for d in per_split],
                tuning_pairs=[sorted(d["tuning_pairs"]) for d in per_split],
                held_out_pairs=[[int(i) for i in d["held"]] for d in per_split])


def _extract_splits(adapter, task, pool, sp, tokenizer, bos_id, null, c, kw, cues, O, lists,
                    progress) -> tuple[list, int]:
    """Step 2 of every split of ``sp`` (the clean reads, the task deviation, the MFA / raw-magnitude / random / head
    list selections and the few-shot ceiling's reads) -> (one dict per split, the answer-cuing token). Stops at the
    first split whose prompts end in a second cue token: the deviation needs one null type."""
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
        Ow = Hd.written_slices(O, reads.g)  # O itself unless the attention gates its reads (then through the cues')
        mfa, raw = Hd.head_norms(r, Ow), Hd.head_norms(zbar, Ow)
        fs = Hd.cue_reads(adapter, Pr.fewshot_eval_prompts(pool, tokenizer, bos_id, ext, held, n_shots=c["n_shots"],
                                                            seed=[seed, s], **kw), batch_size=bs)
        att = adapter.attention_layers  # a hybrid's heads: its attention layers'
        sel = {"MFA": Hd.top_heads(mfa, k, att), **lists, "raw-magnitude": Hd.top_heads(raw, k, att),
               "random": Hd.random_heads(L, H, k, [seed, 0xAA, s], att)}
        per_split.append(dict(ext=ext, held=held, clean=clean, reads=reads, zbar=zbar, r=r, mfa=mfa, raw=raw,
                              fewshot=fs, sel=sel, O=Ow, O_heads=O, tuning_pairs={p.pair for p in clean}))
    if len(cues) != 1:
        raise ValueError(f"task {task.name!r}: the prompts end in {len(cues)} different tokens {sorted(cues)}; the "
                         "answer-cuing separator must encode as one token")
    return per_split, cues.pop()


def _tune_split(adapter, task, pool, d, s, tokenizer, bos_id, c, kw, progress) -> pd.DataFrame:
    """Steps 3 and 5 of split ``d`` (index ``s``) on its own extraction pairs: AIE (stored in ``d``: ``aie``,
    ``p_corrupt``, ``sel["AIE"]``) and the setting sweep (``d["best"]``) -> the sweep's rows."""
    corrupted = Pr.corrupted_prompts(pool, tokenizer, bos_id, d["ext"], n_shots=c["n_shots"],
                                     n_prompts=c["n_corrupted"], seed=[int(c["seed"]), s], **kw)
    aie, d["p_corrupt"], _ = Hd.aie(adapter, corrupted, d["zbar"], batch_size=int(c["batch_size"]),
                                    progress=progress)
    d["aie"], d["n_corrupted"] = aie, len(corrupted)
    d["sel"] = {"AIE": Hd.top_heads(aie.float(), int(c["n_selected"]), adapter.attention_layers), **d["sel"]}
    d["tuning_pairs"] |= {i for p in corrupted for i in (p.pair, *p.exemplars)}
    d["tuning_pairs"] |= {i for p in d["clean"] for i in p.exemplars}
    d["tuning_pairs"] |= {int(i) for i in d["ext"]}  # the sweep's zero-shot prompts
    sweep, d["best"] = Sw.tuning_sweep(adapter, task, pool, d, s, c, progress)
    return sweep


def _evaluate_splits(adapter, task, pool, per_split, sel_names, c, progress) -> tuple[list, list]:
    """Step 6 on the held-out pairs of every split, at the split's own setting -> (transfer rows, per-head rows)."""
    rows, head_rows = [], []
    for s, d in enumerate(per_split):
        held_zs = Pr.zeroshot_prompts(pool, d["held"])
        ans = np.asarray([p.answer for p in held_zs])
        seen = set(pool.answers[d["ext"]].tolist())
        cat = set(pool.category.tolist())
        specs, injs = [("zero-shot", "none", "none")], [Inj.Injection()]
        for prot in PROTOCOLS:
            layer, scale, _ = d["best"][prot]
            for sel in sel_names:
                for cons in CONSTRUCTIONS:
                    v = Sw.vectors(d, cons)
                    injs.append(Inj.sum_injection(v, d["sel"][sel], d["O"], layer, scale) if prot == "sum"
                                else Inj.per_head_injection(v, d["sel"][sel], scale))
                    specs.append((prot, sel, cons))
        top1, pa = Inj.evaluate(adapter, held_zs, injs, batch_size=int(c["batch_size"]), progress=progress)
        fs = d["fewshot"]
        outs = [(spec, t1, p, len(ans), ans) for spec, t1, p in zip(specs, top1, pa)]
        outs.append((("few-shot", "none", "none"), fs.top1, fs.p_answer, len(fs.answers), fs.answers))
        for (prot, sel, cons), t1, p, n, a in outs:
            rows.append(dict(task=task.name, split=s, protocol=prot, selection=sel, construction=cons, n=n,
                             correct=int((t1 == a).sum()), in_category=int(sum(int(t) in cat for t in t1)),
                             seen_answer=int(sum(int(t) in seen for t in t1)), p_answer=float(p.mean()),
                             layer=d["best"]["sum"][0] if prot == "sum" else -1,
                             scale=d["best"][prot][1] if prot in d["best"] else float("nan")))
        sel_sets = {name: set(v) for name, v in d["sel"].items()}
        for l in range(adapter.n_layers):
            for h in range(adapter.n_heads):
                head_rows.append(dict(task=task.name, split=s, layer=l, head=h, mfa_norm=float(d["mfa"][l, h]),
                                      raw_norm=float(d["raw"][l, h]), aie=float(d["aie"][l, h]),
                                      **{f"sel_{n}": (l, h) in v for n, v in sel_sets.items()}))
    return rows, head_rows


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
    ``stats`` (the corpus null at the cue, of the kind ``cfg["null"]``) -> ({part: one DataFrame over the tasks},
    [each task's info])."""
    from tqdm.auto import tqdm

    T = int(stats.attrs.get("context_length") or 1 << 30)
    bos = int(tracked.bos_id)

    def null(cue):
        return Hd.corpus_null(stats, tracked, cue, cfg.get("null", "mean_field"))

    parts, infos = {k: [] for k in PARTS}, []
    with tqdm(desc=desc, unit="row", mininterval=5) as bar:
        for t, over in tasks:
            out = run_task(adapter, t, tokenizer, bos, null, {**cfg, **over}, jlens=jlens, context_length=T, log=log,
                           progress=bar)
            for k in parts:
                parts[k].append(out[k])
            infos.append({**out["info"], "null": cfg.get("null", "mean_field")})
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
