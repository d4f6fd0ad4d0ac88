"""The function-vector prompts of Sec. 6.4 / App. fv, token-level.

A task's pairs ``(x, y)`` are written as few-shot text (:func:`mfpipe.tasks.fewshot_text`'s format, the paper's)::

    x1:{a}y1\\nx2:{a}y2\\n … xq:

where ``{a}`` is the answer prefix (``" "``: the answer in its leading-space form, the form the paper's corrected
prompt format elicits on a byte-level BPE; ``""`` for a model trained on ``x:y``). The prompt ends at the
answer-cuing token ``:`` and its target is the FIRST token of ``{a}yq`` as the tokenizer encodes it after the
prompt (an item whose answer does not encode as a continuation of its prompt is dropped, as in Exp. 2).

* clean: ``n_shots`` exemplars and the query drawn from the split's extraction pairs;
* corrupted (AIE): a clean prompt with its exemplars' answers shuffled among them (Todd et al.: the input→output
  mapping broken, the format kept); target still the query's true answer;
* zero-shot: ``[BOS, xq, :]``; the query alone.

:func:`task_pool` keeps the task's pairs whose zero-shot prompt has a well-defined answer token, draws ``n_pairs``
(60) of them with the seed and :func:`splits` cuts them three times into ``n_extract`` (20) extraction and the rest
(40) held-out.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from mfpipe.tasks import encode_fewshot, fewshot_text, zeroshot_text

__all__ = ["FVPrompt", "TaskPool", "task_pool", "splits", "clean_prompts", "corrupted_prompts", "zeroshot_prompts",
           "fewshot_eval_prompts", "by_length"]


@dataclass
class FVPrompt:
    """``tokens`` int64 ``[n]`` (``tokens[0]`` = BOS, ``tokens[-1]`` the cue); ``answer`` the target token id;
    ``pair`` the index of the query pair in its :class:`TaskPool`; ``exemplars`` the indices of the pairs shown as
    exemplars (empty for a zero-shot prompt)."""

    tokens: np.ndarray
    answer: int
    pair: int
    text: str = ""
    exemplars: tuple[int, ...] = ()


@dataclass
class TaskPool:
    """A task's usable pairs: ``pairs`` (the ``n_pairs`` drawn), ``answers`` their first answer tokens,
    ``category`` the first answer tokens of ALL usable pairs of the task (the task's answer category),
    ``out_of_task`` the category tokens of usable pairs not drawn (same category, in neither set); ``dropped`` the
    pairs left out (``meta``: ``undefined``, no well-defined answer token; ``copy``, the answer token is the query's
    first token)."""

    name: str
    pairs: list[tuple[str, str]]
    answers: np.ndarray
    zeroshot: list[FVPrompt]
    category: np.ndarray
    out_of_task: np.ndarray
    n_usable: int
    source: str = ""
    dropped: int = 0
    meta: dict = field(default_factory=dict)


def _text(exemplars, xq: str, sep: str, prefix: str, joiner: str) -> str:
    return fewshot_text([(x, prefix + y) for x, y in exemplars], xq, sep, joiner)


def task_pool(task, tokenizer, bos_id: int, *, n_pairs: int = 60, seed: int = 0, sep: str = ":",
              answer_prefix: str = " ") -> TaskPool:
    """The ``n_pairs`` pairs of ``task`` (:class:`mfpipe.tasks.FewShotTask`) the experiment uses, drawn with
    ``seed`` among those whose zero-shot answer token is defined and whose answer tokens differ from the query's
    first token (so copying the query is not an answer). Raises ValueError when fewer than ``n_pairs`` qualify."""
    usable, answers, undefined, copy = [], [], 0, 0
    seen = set()
    for x, y in task.pairs:
        x, y = str(x).strip(), str(y).strip()
        if not x or not y or (x, y) in seen:
            continue
        seen.add((x, y))
        encoded = encode_fewshot(tokenizer, zeroshot_text(x, sep), answer_prefix + y)
        if encoded is None or not encoded[0]:
            undefined += 1
            continue
        if int(encoded[1]) == int(encoded[0][0]):  # the query's first token would answer it: a copy, not the task
            copy += 1
            continue
        usable.append((x, y, encoded[0]))
        answers.append(encoded[1])
    dropped = undefined + copy
    if len(usable) < n_pairs:
        raise ValueError(
            f"function-vector task {task.name!r}: {len(usable)} pairs have a well-defined answer token with this "
            f"tokenizer ({undefined} without one, {copy} answered by the query's first token), the experiment needs "
            f"n_pairs = {n_pairs}; lower fv.n_pairs or give a task with more pairs")
    rng = np.random.default_rng([int(seed), 0xF5])
    pick = np.sort(rng.choice(len(usable), size=int(n_pairs), replace=False))
    rest = np.setdiff1d(np.arange(len(usable)), pick)
    all_answers = np.asarray(answers, dtype=np.int64)
    chosen = [usable[i] for i in pick]
    zs = [FVPrompt(np.asarray([bos_id] + ids, dtype=np.int64), int(all_answers[i]), k, zeroshot_text(x, sep))
          for k, (i, (x, y, ids)) in enumerate(zip(pick, chosen))]
    chosen_answers = all_answers[pick]
    category = np.unique(all_answers)
    out = np.setdiff1d(np.unique(all_answers[rest]), chosen_answers) if len(rest) else np.zeros(0, np.int64)
    return TaskPool(task.name, [(x, y) for x, y, _ in chosen], chosen_answers, zs, category, out, len(usable),
                    getattr(task, "source", "") or "", dropped, {"undefined": undefined, "copy": copy})


def splits(n_pairs: int, n_extract: int, n_splits: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """``n_splits`` random (extraction, held-out) index splits of ``range(n_pairs)``, seeded."""
    if not 0 < n_extract < n_pairs:
        raise ValueError(f"fv.n_extract = {n_extract} must lie between 1 and n_pairs - 1 = {n_pairs - 1}")
    out = []
    for s in range(int(n_splits)):
        perm = np.random.default_rng([int(seed), 0x5B, s]).permutation(n_pairs)
        out.append((np.sort(perm[:n_extract]), np.sort(perm[n_extract:])))
    return out


def _fewshot(pool: TaskPool, tokenizer, bos_id: int, exemplar_idx, query: int, sep, prefix, joiner, T,
             shuffle_rng=None) -> FVPrompt | None:
    ex = [pool.pairs[i] for i in exemplar_idx]
    if shuffle_rng is not None and len(ex) > 1:
        ys = [y for _, y in ex]
        for _ in range(20):  # a derangement where one exists: no exemplar keeps its own answer
            perm = shuffle_rng.permutation(len(ys))
            if not np.any(perm == np.arange(len(ys))):
                break
        ex = [(x, ys[j]) for (x, _), j in zip(ex, perm)]
    xq, yq = pool.pairs[query]
    text = _text(ex, xq, sep, prefix, joiner)
    encoded = encode_fewshot(tokenizer, text, prefix + yq, max_tokens=T - 1)
    if encoded is None:
        return None
    return FVPrompt(np.asarray([bos_id] + encoded[0], dtype=np.int64), encoded[1], int(query), text,
                    tuple(int(i) for i in exemplar_idx))


def _prompts(pool, tokenizer, bos_id, queries, exemplar_from, n_shots, seed, tag, sep, prefix, joiner, T,
             shuffle=False) -> list[FVPrompt]:
    rng = np.random.default_rng([*(int(x) for x in np.atleast_1d(seed)), tag])
    out = []
    for q in queries:
        others = np.asarray([i for i in exemplar_from if i != q])
        k = min(int(n_shots), len(others))
        for _ in range(10):
            ex = rng.choice(others, size=k, replace=False)
            p = _fewshot(pool, tokenizer, bos_id, ex, int(q), sep, prefix, joiner, T,
                         shuffle_rng=rng if shuffle else None)
            if p is not None:
                out.append(p)
                break
            k = max(1, k - 1)  # too long for the context: fewer exemplars
    return out


def clean_prompts(pool, tokenizer, bos_id, extract, *, n_shots, n_prompts, seed, sep=":", answer_prefix=" ",
                  joiner="\n", context_length=1 << 30) -> list[FVPrompt]:
    """Clean few-shot prompts of the extraction pairs: each of the first ``n_prompts`` extraction pairs once as the
    query, ``n_shots`` other extraction pairs as exemplars."""
    return _prompts(pool, tokenizer, bos_id, list(extract)[: int(n_prompts)], extract, n_shots, seed, 1, sep,
                    answer_prefix, joiner, context_length)


def corrupted_prompts(pool, tokenizer, bos_id, extract, *, n_shots, n_prompts, seed, sep=":", answer_prefix=" ",
                      joiner="\n", context_length=1 << 30) -> list[FVPrompt]:
    """Label-shuffled few-shot prompts (AIE): the exemplars' answers permuted among them, the query's target kept."""
    q = list(extract)[::-1][: int(n_prompts)]
    return _prompts(pool, tokenizer, bos_id, q, extract, n_shots, seed, 2, sep, answer_prefix, joiner,
                    context_length, shuffle=True)


def fewshot_eval_prompts(pool, tokenizer, bos_id, extract, heldout, *, n_shots, seed, sep=":", answer_prefix=" ",
                         joiner="\n", context_length=1 << 30) -> list[FVPrompt]:
    """Few-shot prompts of the held-out queries with extraction exemplars (the model's in-context ceiling)."""
    return _prompts(pool, tokenizer, bos_id, list(heldout), extract, n_shots, seed, 3, sep, answer_prefix, joiner,
                    context_length)


def zeroshot_prompts(pool: TaskPool, idx) -> list[FVPrompt]:
    return [pool.zeroshot[int(i)] for i in idx]


def by_length(prompts: list[FVPrompt]) -> dict[int, list[int]]:
    """Prompt indices grouped by token length (the site runs unpadded batches)."""
    groups: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        groups.setdefault(len(p.tokens), []).append(i)
    return groups
