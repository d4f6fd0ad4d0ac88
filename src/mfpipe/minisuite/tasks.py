"""Few-shot tasks the mini suite learns: fixed random mappings of its own vocabulary, and their accuracies.

The tasks share one input word set ``X`` and each has its own output set ``Y_k`` (disjoint from ``X`` and from the
other tasks' outputs) with a fixed random bijection ``X -> Y_k``. A zero-shot prompt ``x:`` is therefore ambiguous
between the tasks (at best ``1 / n_tasks`` accurate), while few-shot exemplars name the task by their answers
(the task's *category*: its output set). Every word is one token of the suite's byte-level BPE both as a query
input at the start of a line and as an answer right after the separator, so the few-shot text of
:func:`mfpipe.experiments.prompts.sets.fewshot_text`, ``x1:y1\\nx2:y2\\n…xq:`` (after BOS), encodes to
``[x1, sep, y1, nl, x2, sep, y2, nl, …, xq, sep]``, one token per word.

The tasks are written in the user task-file format (:func:`mfpipe.experiments.prompts.sets.load_task_file`):
``{"name", "pairs", "category", "source"}``; the training rows of :mod:`mfpipe.minisuite.data` use their token
form (:func:`task_token_pairs`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from mfpipe.tasks import N_EXEMPLARS, encode_text, fewshot_text, zeroshot_text

__all__ = ["TASK_NAMES", "candidate_words", "fewshot_accuracy", "make_tasks", "task_token_pairs",
           "zeroshot_accuracy"]

TASK_NAMES = tuple(f"map-{c}" for c in "abcdefghijklmnopqrstuvwxyz")


def _single(tokenizer, text: str) -> int | None:
    ids = encode_text(tokenizer, text)
    return ids[0] if len(ids) == 1 else None


def candidate_words(tokenizer, *, separator: str = ":", joiner: str = "\n", min_length: int = 3) -> list[str]:
    """Vocabulary strings (token-id order) that are ASCII alphabetic, at least ``min_length`` letters, and one and
    the same token both at the start of a line and right after ``separator`` in :func:`fewshot_text`."""
    special = set(tokenizer.all_special_ids)
    sep, nl = _single(tokenizer, separator), _single(tokenizer, joiner)
    if sep is None or nl is None:
        raise ValueError(f"separator {separator!r} and joiner {joiner!r} must each be one token")
    out, seen = [], set()
    for tid in range(len(tokenizer)):
        if tid in special:
            continue
        w = tokenizer.decode([tid])
        if len(w) < min_length or not (w.isascii() and w.isalpha()) or w in seen:
            continue
        # one token as an input (line start) and as an answer (after the separator), inside the prompt format
        if encode_text(tokenizer, fewshot_text([(w, w)], w, separator, joiner)) != [tid, sep, tid, nl, tid, sep]:
            continue
        seen.add(w)
        out.append(w)
    return out


def _check_layout(tokenizer, pairs, separator: str, joiner: str) -> tuple[int, int]:
    """The separator and joiner ids, after checking that the few-shot text of ``pairs`` encodes one token a word."""
    sep, nl = _single(tokenizer, separator), _single(tokenizer, joiner)
    if sep is None or nl is None:
        raise ValueError(f"separator {separator!r} and joiner {joiner!r} must each be one token")
    ids = {w: _single(tokenizer, w) for p in pairs for w in p}
    text = fewshot_text(pairs[:-1], pairs[-1][0], separator, joiner)
    want = [t for x, y in pairs[:-1] for t in (ids[x], sep, ids[y], nl)] + [ids[pairs[-1][0]], sep]
    if encode_text(tokenizer, text) != want:
        raise ValueError(f"few-shot text {text[:60]!r}… does not encode to one token per word")
    return sep, nl


def make_tasks(tokenizer, *, n_tasks: int = 3, n_pairs: int = 64, seed: int = 0, separator: str = ":",
               joiner: str = "\n") -> list[dict]:
    """``n_tasks`` word-pair tasks ``map-a``, ``map-b``, … over the tokenizer's own vocabulary (module docstring):
    ``n_pairs`` shared inputs, ``n_pairs`` outputs per task, all distinct words of :func:`candidate_words`,
    drawn with ``numpy.random.default_rng(seed)``; each task maps the inputs (in one shared order) to its outputs
    by a fixed random bijection. Deterministic given the tokenizer and the arguments."""
    n_tasks, n_pairs = int(n_tasks), int(n_pairs)
    if not 1 <= n_tasks <= len(TASK_NAMES):
        raise ValueError(f"n_tasks must lie in [1, {len(TASK_NAMES)}], got {n_tasks}")
    if n_pairs < N_EXEMPLARS + 1:
        raise ValueError(f"n_pairs must be at least {N_EXEMPLARS + 1} (a prompt's exemplars and query), got {n_pairs}")
    words = candidate_words(tokenizer, separator=separator, joiner=joiner)
    need = n_pairs * (n_tasks + 1)
    if len(words) < need:
        raise ValueError(f"{n_tasks} tasks of {n_pairs} pairs need {need} single-token words; the tokenizer has "
                         f"{len(words)}")
    rng = np.random.default_rng(int(seed))
    pick = [words[i] for i in rng.choice(len(words), size=need, replace=False)]
    xs = pick[:n_pairs]
    tasks = []
    for k in range(n_tasks):
        ys = pick[n_pairs * (k + 1): n_pairs * (k + 2)]
        perm = rng.permutation(n_pairs)
        pairs = [[x, ys[int(j)]] for x, j in zip(xs, perm)]
        _check_layout(tokenizer, pairs, separator, joiner)
        name = TASK_NAMES[k]
        tasks.append({"name": name, "pairs": pairs, "category": f"outputs of {name}",
                      "source": f"mini suite: a fixed random mapping of its own vocabulary (seed {int(seed)}, "
                                f"{n_tasks} tasks sharing {n_pairs} inputs)"})
    return tasks


def task_token_pairs(tokenizer, tasks: Sequence[dict], *, separator: str = ":", joiner: str = "\n"
                     ) -> tuple[list[np.ndarray], int, int]:
    """Per task its pairs as token ids (int64 ``[n_pairs, 2]``: input, output), the separator id and the joiner id;
    raises ValueError unless every word is one token in the few-shot text."""
    out, sep, nl = [], None, None
    for t in tasks:
        pairs = [tuple(p) for p in t["pairs"]]
        sep, nl = _check_layout(tokenizer, pairs, separator, joiner)
        out.append(np.array([[_single(tokenizer, x), _single(tokenizer, y)] for x, y in pairs], dtype=np.int64))
    if not out:
        raise ValueError("no few-shot tasks")
    return out, int(sep), int(nl)


def _next_token_hits(model, rows: list[list[int]], targets: list[int]) -> np.ndarray:
    import torch

    n = max(len(r) for r in rows)
    if any(len(r) != n for r in rows):  # the prompts of one call have one length
        raise ValueError("prompts of different lengths")
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor(rows, dtype=torch.long)).logits[:, -1]
    finally:
        model.train(was_training)
    return (logits.argmax(-1).numpy() == np.asarray(targets)).astype(bool)


def _prompts(tokenizer, task: dict, n_shots: int, n_prompts: int, seed, separator: str, joiner: str):
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else 0
    pairs = [tuple(p) for p in task["pairs"]]
    if len(pairs) < n_shots + 1:
        raise ValueError(f"task {task['name']!r}: {len(pairs)} pairs, a prompt needs {n_shots + 1}")
    rng = np.random.default_rng(seed)
    rows, targets = [], []
    for _ in range(int(n_prompts)):
        pick = [pairs[j] for j in rng.choice(len(pairs), size=n_shots + 1, replace=False)]
        rows.append([bos] + encode_text(tokenizer, fewshot_text(pick[:-1], pick[-1][0], separator, joiner)))
        targets.append(_single(tokenizer, pick[-1][1]))
    return rows, targets


def fewshot_accuracy(model, tokenizer, task: dict, *, n_shots: int = N_EXEMPLARS, n_prompts: int = 256, seed=0,
                     separator: str = ":", joiner: str = "\n") -> float:
    """Share of ``n_prompts`` prompts ``BOS x1:y1\\n…x{n_shots}:y{n_shots}\\nxq:`` (``n_shots + 1`` distinct pairs
    of ``task``, drawn with ``default_rng(seed)``) whose argmax next token is the answer ``yq``'s token."""
    rows, targets = _prompts(tokenizer, task, n_shots, n_prompts, seed, separator, joiner)
    return float(_next_token_hits(model, rows, targets).mean())


def zeroshot_accuracy(model, tokenizer, task: dict, *, separator: str = ":", joiner: str = "\n") -> float:
    """Share of the task's pairs whose zero-shot prompt ``BOS x:`` (``x`` and the separator, no joiner before
    it) has the answer ``y``'s token as argmax."""
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else 0
    rows = [[bos] + encode_text(tokenizer, zeroshot_text(x, separator)) for x, _ in task["pairs"]]
    targets = [_single(tokenizer, y) for _, y in task["pairs"]]
    return float(_next_token_hits(model, rows, targets).mean())
