"""What the function vectors contain, read through the lenses (App. fv-gpt2, App. fv-jlens), on split 0 of a task.

* :func:`populations`: the paper's four token populations (its defaults 10 / 10 / 15 / 15, config
  ``fv.populations``): answers seen in the extraction prompts, held-out answers not among them, answers of the
  task's category appearing nowhere in the task's drawn pairs (out-of-task) and unrelated words, the first tokens of
  a fixed generic word list shipped with the package (:func:`mfpipe.tasks.unrelated_words`), never another task's
  answers (which would make the unrelated rank depend on the run's other tasks). Each population is drawn with the
  seed where more tokens qualify; where fewer do (a small task), all of them, and the table says how many.
* :func:`rank_rows`: the populations' median ranks under each lens for the summed vectors of every pipeline and for
  EVERY head's own component ``O_h r`` at its layer, each head's rows naming the selections it belongs to and its
  place among all heads by the median rank of the answers (seen and held-out together): the best-decoding heads
  over all heads.
* :func:`prompt_rank_rows`: the per-prompt decode of App. fv-jlens for every head: the rank of each clean prompt's
  own answer in its per-prompt residual ``O_h(z_{:,X} − ẑ_:)``, and the heads' order by its median.
"""

from __future__ import annotations

import numpy as np
import torch

from mfpipe.experiments.fv import inject as Inj

__all__ = ["decoder", "lens_rows", "ranks", "populations", "rank_rows", "prompt_rank_rows", "POPULATIONS"]

#: population -> its config key in ``fv.populations`` and the paper's count
POPULATIONS = {"seen": ("seen", 10), "held-out": ("held_out", 10), "out-of-task": ("out_of_task", 15),
               "unrelated": ("unrelated", 15)}


def decoder(adapter, jlens):
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


def lens_rows(adapter, jlens, rows):
    """``rows(decode)`` with ``decode`` the :func:`decoder` of ``jlens``: a J-lens store or None directly; a J-lens
    sample (:class:`~mfpipe.jlens.jvp.JLensSample`: the J-lens through Jacobian-vector products) twice, first with a
    decode that records what is asked and returns no lens (so ``rows`` builds no row), then, the products of every
    recorded vector computed in one pass over the sample's positions (:func:`~mfpipe.jlens.jvp.jvp_products`), with
    one that answers the same calls in the same order (each checked to be the recorded one), ``J`` read out as
    :func:`~mfpipe.jlens.jvp.lens_logits` reads it."""
    from mfpipe.jlens.jvp import JLensSample, jvp_products

    if not isinstance(jlens, JLensSample):
        return rows(decoder(adapter, jlens))
    asked: list = []

    def record(v: torch.Tensor, layer: int, point: str) -> dict:
        asked.append((v.float().to(adapter.device), int(layer), point))
        return {}

    rows(record)
    if not asked:
        return rows(decoder(adapter, None))
    layers = np.concatenate([np.full(len(v), layer) for v, layer, _ in asked])
    points = [point for v, _, point in asked for _ in range(len(v))]
    Jv = jvp_products(adapter, jlens, torch.cat([v for v, _, _ in asked]), layers, points, desc="fv jvp")
    answers = iter(zip(asked, torch.split(Jv, [len(v) for v, _, _ in asked])))

    def replay(v: torch.Tensor, layer: int, point: str) -> dict:
        (want, l, p), jv = next(answers, ((None, None, None), None))
        v = v.float().to(adapter.device)
        if (l, p) != (int(layer), point) or not torch.equal(v, want):
            raise RuntimeError(f"the J-lens products were recorded for ({p}, layer {l}), asked for ({point}, layer "
                               f"{layer}) or another vector: the rows must ask the same in the same order")
        return {"raw": adapter.unembed(v).float().cpu(), "J": adapter.unembed(jv.to(adapter.dtype)).float().cpu()}

    return rows(replay)


def ranks(logits: torch.Tensor, ids) -> np.ndarray:
    """Rank (0 = top) of each token of ``ids`` in each row of ``logits [n,V]`` -> ``[n, len(ids)]``."""
    ids = torch.as_tensor(np.asarray(ids, dtype=np.int64))
    if not len(ids):
        return np.zeros((logits.shape[0], 0))
    val = logits[:, ids]  # [n, k]
    return (logits[:, None, :] > val[:, :, None]).sum(-1).numpy()


def _draw(ids, n: int, rng) -> np.ndarray:
    ids = np.unique(np.asarray(ids, dtype=np.int64))
    return np.sort(rng.choice(ids, size=int(n), replace=False)) if len(ids) > int(n) else ids


def populations(tokenizer, pool, d0: dict, bos_id: int, counts: dict, seed: int, answer_prefix: str) -> dict:
    """The four populations of split 0 (``d0``: its ``ext`` / ``held`` pair indices) -> {name: token ids}; ``counts``
    = ``fv.populations`` (missing keys: the paper's counts)."""
    from mfpipe.tasks import unrelated_words

    n = {name: int(counts.get(key, default)) for name, (key, default) in POPULATIONS.items()}
    rng = np.random.default_rng([int(seed), 0xC4])
    seen_all = np.unique(pool.answers[d0["ext"]])
    held = np.setdiff1d(np.unique(pool.answers[d0["held"]]), seen_all)
    words = []
    for w in unrelated_words():
        ids = tokenizer(answer_prefix + w, add_special_tokens=False)["input_ids"]
        if ids:
            words.append(int(ids[0]))
    unrelated = np.setdiff1d(np.asarray(words, dtype=np.int64), np.concatenate([pool.category, [int(bos_id)]]))
    return {"seen": _draw(seen_all, n["seen"], rng), "held-out": _draw(held, n["held-out"], rng),
            "out-of-task": _draw(pool.out_of_task, n["out-of-task"], rng),
            "unrelated": _draw(unrelated, n["unrelated"], rng)}


def _pop_columns(lg: torch.Tensor, pops: dict) -> list[dict]:
    """Per row of ``lg [n, V]``: each population's median rank and size, the answers' (seen + held-out) median."""
    rk = {name: ranks(lg, ids) for name, ids in pops.items()}
    answers = np.concatenate([rk["seen"], rk["held-out"]], axis=1)
    out = []
    for i in range(lg.shape[0]):
        row = {}
        for name, ids in pops.items():
            row[f"median_rank_{name}"] = float(np.median(rk[name][i])) if rk[name].shape[1] else float("nan")
            row[f"n_{name}"] = int(len(ids))
        row["median_rank_answers"] = float(np.median(answers[i])) if answers.shape[1] else float("nan")
        row["top1"] = int(lg[i].argmax())
        out.append(row)
    return out


def _order(rows: list, key: str) -> None:
    """Each head row's place among the heads of its lens by ``key`` (0 = best; ties: lower layer, then head)."""
    for lens in {r["lens"] for r in rows}:
        mine = [r for r in rows if r["lens"] == lens]
        for k, r in enumerate(sorted(mine, key=lambda r: (r[key], r["layer"], r["head"]))):
            r["head_order"] = k


def _membership(selections: dict) -> dict:
    out: dict = {}
    for name, heads in selections.items():
        for lh in heads:
            out.setdefault(tuple(lh), []).append(name)
    return out


def rank_rows(task, decode, pops: dict, d0: dict, O: torch.Tensor, pipelines, sum_layer: int) -> list:
    """The category analysis (App. fv-gpt2) on split 0: the populations' ranks under each lens for the summed
    vector of each (selection, construction) of ``pipelines`` at the injection layer ``sum_layer``, and for every
    head's own component ``O_h r`` at its layer (``vector`` "head", ``selections`` the selections holding it,
    ``head_order`` its place among all heads by the answers' median rank)."""
    out = []
    for sel, cons in pipelines:
        v = Inj.summed_vector(d0["zbar"] if cons == "raw" else d0["r"], d0["sel"][sel], O)
        for lens, lg in decode(v[None], sum_layer, "block").items():
            out.append(dict(task=task.name, vector=f"sum {sel} {cons}", layer=sum_layer, head=-1, point="block",
                            lens=lens, selections=sel, **_pop_columns(lg, pops)[0]))
    member = _membership(d0["sel"])
    heads = []
    L, H = d0["r"].shape[:2]
    for l in range(L):
        vec = torch.einsum("he,hed->hd", d0["r"][l].float(), O[l])  # every head's O_h r at layer l
        for lens, lg in decode(vec, l, "attn").items():
            for h, cols in enumerate(_pop_columns(lg, pops)):
                heads.append(dict(task=task.name, vector="head r", layer=l, head=h, point="attn", lens=lens,
                                  selections=" ".join(member.get((l, h), [])), **cols))
    _order(heads, "median_rank_answers")
    return out + heads


def prompt_rank_rows(task, decode, d0: dict, null: torch.Tensor, O: torch.Tensor) -> list:
    """The per-prompt decode (App. fv-jlens) of every head on split 0's clean prompts: the rank of each prompt's own
    answer in its residual ``O_h(z_{:,X} − ẑ_:)`` (times the prompt's own gate at the cue where the attention gates
    its reads; ``O`` the ungated slices) (median, best, share at rank 0), ``head_order`` the heads' order
    by the median (0 = best), ``selections`` the selections holding the head."""
    ans = torch.as_tensor(np.asarray([p.answer for p in d0["clean"]], dtype=np.int64))
    n = len(ans)
    z = d0["reads"].z  # [n, L, H, dh]
    # each prompt's own gate at its cue where the attention gates its reads: its write is ((z - ẑ) * g) O_h
    g = getattr(d0["reads"], "g", None)
    member = _membership(d0["sel"])
    rows = []
    L, H = z.shape[1:3]
    for l in range(L):
        for h in range(H):
            dz = z[:, l, h] - null[l, h]
            resid = (dz if g is None else dz * g[:, l, h]) @ O[l, h]  # per-prompt residual, residual units
            for lens, lg in decode(resid, l, "attn").items():
                rk = (lg > lg[torch.arange(n), ans][:, None]).sum(-1).numpy()
                rows.append(dict(task=task.name, head=f"L{l}H{h}", layer=l, head_index=h, lens=lens, n=n,
                                 median_answer_rank=float(np.median(rk)), best_rank=int(rk.min()),
                                 top1_share=float(np.mean(rk == 0)), selections=" ".join(member.get((l, h), []))))
    for lens in {r["lens"] for r in rows}:
        mine = sorted((r for r in rows if r["lens"] == lens),
                      key=lambda r: (r["median_answer_rank"], r["layer"], r["head_index"]))
        for k, r in enumerate(mine):
            r["head_order"] = k
    return rows
