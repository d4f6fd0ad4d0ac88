"""The prompt classes of Sec. 6.1 (Experiment 2) and the repeated chunks of Experiment 1, token-level.

Every prompt is ``[BOS, ...]``, at most the model's context length ``T`` long; its *query* is the last token and
its *target* the token the class says comes next (what loss and accuracy are scored on). All draws use a
``numpy.random.Generator`` seeded by the caller, so the same seed gives the same prompts.

Classes (:class:`Prompt` ``.cls``)
----------------------------------
* ``induction`` (planted ICL): ``k = min(n_random, T // 2, len(pool))`` *distinct* random tokens ``r_1..r_k``
  drawn from ``pool`` (the tracked types with a kernel row, so the query has a mean field), then a repeat of
  ``r_1..r_m`` with ``m`` uniform in ``[min_repeat, k-1]``: ``[BOS, r_1..r_k, r_1..r_m]``. Query ``r_m`` (last
  token of the repeat), target ``r_{m+1}``: the token that followed the query's first (only) occurrence.
  Drawing without replacement makes that occurrence unique.
* ``random`` (matched non-ICL control): the same sequence cut inside the first copy at the same query token,
  ``[BOS, r_1..r_m]``; target ``r_{m+1}``, the next random token, which nothing in the context predicts.
* ``natural`` (background ICL): eval-half windows ``[BOS, t_1 ..]`` cut to ``length`` tokens whose last token is
  a query type (``query_ids``); target the window's next token, of the same document. Each prompt's query comes
  from a different document (``doc_ids``).
* ``few-shot`` (planted ICL): five exemplars of one task and a held-out query input, as text::

      x1:y1\\nx2:y2\\nx3:y3\\nx4:y4\\nx5:y5\\nxq:

  (separator ``:``, exemplars joined by a newline; both configurable), encoded without special tokens after BOS.
  The query is the last token (the separator), the target the first token of ``yq`` *as the tokenizer encodes
  it after the prompt* (prompt + ``yq`` must encode to the prompt's tokens followed by tokens that decode to
  ``yq``, else the item is redrawn).

Few-shot tasks
--------------
``prompts.icl.tasks`` names them (:func:`fewshot_tasks`, in the order given): a built-in task generated offline
(below) or a vendored dataset (:mod:`mfpipe.tasks`): by default the paper's five, ``antonym``, ``country-capital``,
``present-past``, ``singular-plural`` and ``capitalize`` from Todd et al.'s function-vector datasets. A vendored
task keeps the pairs whose input and output each encode and decode back to themselves; inputs and outputs may be
several tokens long (the target is the answer's first token, and the round trip above redraws a draw whose answer
does not encode as a continuation of the prompt). Few-shot prompts over words the model does not know (the mini
suite's) are left to the built-in tasks.

Built offline from words the tokenizer encodes (:func:`builtin_tasks`): the words are the tracked types' strings
that are lower-case alphabetic words (leading whitespace stripped, at least ``min_word_length`` letters, encoding
to at most ``max_word_tokens`` tokens and decoding back to themselves; by default only types that begin a word,
i.e. whose string starts with whitespace, a heuristic against sub-word pieces):

* ``capitalisation``: ``word -> Word`` (``style="upper"``: ``WORD``), kept where the output is a known token
  sequence: it decodes back to itself from at most ``max_word_tokens`` tokens and differs from the input;
* ``copying``: ``word -> word``;
* ``successor``: number words ``one -> two .. nine -> ten``, letters ``a -> b .. y -> z``, digits
  ``0 -> 1 .. 8 -> 9``; three groups, each prompt draws all six pairs from one group.

A user's own word-pair task (``prompts.icl.task_files``) is a JSON file read by :func:`load_task_file`::

    {"name": "my-task", "pairs": [["hot", "cold"], ["big", "small"], ...]}

``name`` a non-empty string, ``pairs`` at least six ``[input, output]`` pairs of non-empty strings (an optional
``"groups"``: one label per pair, prompts then draw within one group). :class:`FewShotTask`, :func:`load_task_file`
and :func:`fewshot_text` live in :mod:`mfpipe.tasks` and are re-exported here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mfpipe.tasks import (
    N_EXEMPLARS,
    TASK_FILE_FORMAT,
    FewShotTask,
    encode_fewshot,
    encodes_back,
    fewshot_text,
    load_task,
    load_task_file,
    vendored_tasks,
)

__all__ = ["Prompt", "FewShotTask", "CLASSES", "induction_and_random_prompts", "natural_prompts", "fewshot_prompts",
           "builtin_tasks", "fewshot_tasks", "load_task_file", "task_words", "fewshot_text", "prompt_classes",
           "meter_sequences", "meter_chunk_length", "N_EXEMPLARS", "BUILTIN_TASKS"]

#: the classes in the paper's table order (planted ICL, background ICL, control)
CLASSES = ("induction", "few-shot", "natural", "random")


def ordered_classes(df, classes=CLASSES) -> list[str]:
    """The prompt classes present in a per-prompt table (its ``cls`` column): the paper's order first, then any other."""
    present = list(dict.fromkeys(df["cls"]))
    return [c for c in classes if c in present] + [c for c in present if c not in classes]


BUILTIN_TASKS = ("capitalisation", "copying", "successor")
NUMBER_WORDS = ("one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")


@dataclass
class Prompt:
    """One prompt: ``tokens`` int64 ``[n]`` (``tokens[0]`` = BOS, query = ``tokens[-1]``) and the ``target`` id."""

    cls: str
    tokens: np.ndarray
    target: int
    task: str = ""
    meta: dict = field(default_factory=dict)

    def __post_init__(self):
        self.tokens = np.asarray(self.tokens, dtype=np.int64)
        self.target = int(self.target)

    @property
    def query(self) -> int:
        return int(self.tokens[-1])

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


def _rng(seed) -> np.random.Generator:
    return seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)


# ------------------------------------------------------------------ induction / random control
def induction_and_random_prompts(pool, bos_id: int, context_length: int, n: int, *, n_random: int = 12,
                                 min_repeat: int = 2, seed=0) -> tuple[list[Prompt], list[Prompt]]:
    """``n`` induction prompts and their ``n`` matched random controls (see the module docstring)."""
    pool = np.unique(np.asarray(pool, dtype=np.int64))
    pool = pool[pool != int(bos_id)]
    k = min(int(n_random), int(context_length) // 2, pool.size)
    if k < 2:
        raise ValueError(f"induction prompts need at least 2 random tokens: n_random={n_random}, T={context_length}, "
                         f"{pool.size} tracked types with a kernel row")
    lo = min(max(int(min_repeat), 1), k - 1)
    rng = _rng(seed)
    ind, rnd = [], []
    for i in range(int(n)):
        r = rng.choice(pool, size=k, replace=False)
        m = int(rng.integers(lo, k))  # repeat r_1..r_m, 1 <= m <= k-1: r_{m+1} exists
        meta = {"sequence": i, "n_random": k, "repeat": m}
        ind.append(Prompt("induction", np.concatenate([[bos_id], r, r[:m]]), r[m], meta=meta))
        rnd.append(Prompt("random", np.concatenate([[bos_id], r[:m]]), r[m], meta=dict(meta)))
    return ind, rnd


# ------------------------------------------------------------------ natural text
def natural_prompts(tokens: np.ndarray, doc_ids: np.ndarray, query_ids, n: int, *, length: int | None = None,
                    seed=0) -> list[Prompt]:
    """Up to ``n`` natural prompts from eval-half windows ``tokens``/``doc_ids [m, T]`` (see the module docstring):
    windows in a seeded random order, each cut to ``length`` tokens (default ``T - 1``: the longest cut whose
    target lies in the window), kept when its last token is in ``query_ids``, the target belongs to the same
    document, and no earlier prompt's query came from that document. Fewer than ``n`` when the windows run out."""
    tokens, doc_ids = np.asarray(tokens), np.asarray(doc_ids)
    T = tokens.shape[1]
    length = T - 1 if length is None else int(length)
    if not 2 <= length <= T - 1:
        raise ValueError(f"natural prompt length {length} must lie in [2, T-1 = {T - 1}]")
    q = length - 1
    ok = np.isin(tokens[:, q], np.asarray(list(query_ids), dtype=np.int64)) & (doc_ids[:, q] == doc_ids[:, q + 1])
    out, used = [], set()
    for w in _rng(seed).permutation(tokens.shape[0]):
        if not ok[w] or int(doc_ids[w, q]) in used:
            continue
        used.add(int(doc_ids[w, q]))
        out.append(Prompt("natural", tokens[w, :length], tokens[w, length], meta={"window": int(w),
                                                                                  "document": int(doc_ids[w, q])}))
        if len(out) == n:
            break
    return out


# ------------------------------------------------------------------ few-shot
def task_words(tokenizer, strings, *, min_word_length: int = 2, max_word_tokens: int = 2,
               word_initial: bool = True) -> list[str]:
    """Lower-case alphabetic words among ``strings`` (the tracked types' strings), in order, without duplicates,
    that the tokenizer encodes in at most ``max_word_tokens`` tokens and decodes back (leading whitespace
    stripped). With ``word_initial`` only strings that start with whitespace count (a byte-level BPE type that
    begins a word, ``" the"``, rather than a piece of one, ``"re"``), unless fewer than six such words exist."""
    def scan(need_space: bool) -> list[str]:
        out, seen = [], set()
        for s in strings:
            s = str(s)
            w = s.strip()
            if need_space and not s[:1].isspace():
                continue
            if (len(w) >= min_word_length and w.isascii() and w.isalpha() and w.islower() and w not in seen
                    and encodes_back(tokenizer, w, max_word_tokens)):
                seen.add(w)
                out.append(w)
        return out

    words = scan(True) if word_initial else []
    return words if len(words) >= N_EXEMPLARS + 1 else scan(False)


def builtin_tasks(tokenizer, strings, names=BUILTIN_TASKS, *, style: str = "title",
                  min_word_length: int = 2, max_word_tokens: int = 2, word_initial: bool = True
                  ) -> list[FewShotTask]:
    """The offline tasks named (module docstring), from the tracked strings (:func:`task_words`); a task with
    fewer than six usable pairs is left out."""
    words = task_words(tokenizer, strings, min_word_length=min_word_length, max_word_tokens=max_word_tokens,
                       word_initial=word_initial)
    tasks = []
    for name in names:
        if name == "capitalisation":
            f = str.upper if style == "upper" else str.capitalize
            pairs = [(w, f(w)) for w in words if f(w) != w and encodes_back(tokenizer, f(w), max_word_tokens)]
            task = FewShotTask(name, pairs, source="built-in: the tracked types' words")
        elif name == "copying":
            task = FewShotTask(name, [(w, w) for w in words], source="built-in: the tracked types' words")
        elif name == "successor":
            fam = {"word": list(zip(NUMBER_WORDS[:-1], NUMBER_WORDS[1:])),
                   "letter": [(chr(c), chr(c + 1)) for c in range(ord("a"), ord("z"))],
                   "digit": [(str(i), str(i + 1)) for i in range(9)]}
            pairs, groups = [], []
            for g, ps in fam.items():
                ps = [p for p in ps if all(encodes_back(tokenizer, s, max_word_tokens) for s in p)]
                pairs += ps
                groups += [g] * len(ps)
            task = FewShotTask(name, pairs, groups, source="built-in: number words, letters, digits")
        else:
            raise ValueError(f"unknown built-in few-shot task {name!r}; known: capitalisation, copying, successor")
        if task.pools():
            tasks.append(task)
    return tasks


def fewshot_tasks(tokenizer, strings, names=BUILTIN_TASKS, task_files=()) -> list[FewShotTask]:
    """The few-shot tasks ``names`` in order, each a built-in task (:func:`builtin_tasks`, from the tracked
    ``strings``) or a vendored dataset (:func:`mfpipe.tasks.load_task`, pairs the tokenizer encodes back), then the
    user's ``task_files``. A task with fewer than six usable pairs is left out."""
    out = []
    for name in names:
        if name in BUILTIN_TASKS:
            out += builtin_tasks(tokenizer, strings, (name,))
        elif name not in vendored_tasks():
            raise ValueError(f"unknown few-shot task {name!r}: a built-in task ({', '.join(BUILTIN_TASKS)}) or a "
                             f"vendored dataset ({', '.join(vendored_tasks())}); a task of your own goes in "
                             f"prompts.icl.task_files as {TASK_FILE_FORMAT}")
        else:
            task = load_task(name, tokenizer=tokenizer)
            if task.pools():
                out.append(task)
    return out + [load_task_file(p) for p in task_files]


def fewshot_prompts(tokenizer, tasks, bos_id: int, context_length: int, n: int, *, sep: str = ":",
                    joiner: str = "\n", seed=0, max_tries: int = 50) -> list[Prompt]:
    """``n`` few-shot prompts shared round-robin over ``tasks`` (:class:`FewShotTask`): per prompt six distinct
    pairs of one pool, five exemplars and the query (module docstring). A draw whose answer does not encode as a
    continuation of the prompt, or whose prompt is longer than ``context_length``, is redrawn (``max_tries``)."""
    rng = _rng(seed)
    tasks = [t for t in tasks if t.pools()]
    if not tasks:
        return []
    out = []
    for i in range(int(n)):
        task = tasks[i % len(tasks)]
        pools = task.pools()
        for _ in range(int(max_tries)):
            pool = pools[int(rng.integers(len(pools)))]
            pick = [pool[j] for j in rng.choice(len(pool), size=N_EXEMPLARS + 1, replace=False)]
            text = fewshot_text(pick[:-1], pick[-1][0], sep, joiner)
            encoded = encode_fewshot(tokenizer, text, pick[-1][1], max_tokens=context_length - 1, exact=True)
            if encoded is None:
                continue
            out.append(Prompt("few-shot", [bos_id] + encoded[0], encoded[1], task=task.name,
                              meta={"text": text, "answer": pick[-1][1]}))
            break
    return out


# ------------------------------------------------------------------ all four classes
def prompt_classes(pool, tokenizer, tracked, context_length: int, tokens: np.ndarray, doc_ids: np.ndarray, *,
                   n: int = 60, n_fewshot: int = 48, n_random: int = 12, seed: int = 0, tasks=BUILTIN_TASKS,
                   task_files=(), natural_length: int | None = None, sep: str = ":", joiner: str = "\n"
                   ) -> tuple[list[Prompt], dict]:
    """The prompts of Experiment 2 in class order: ``n`` induction, ``n_fewshot`` few-shot (shared over the
    tasks named in ``tasks``, built-in or vendored, and the user's ``task_files``: :func:`fewshot_tasks`), ``n``
    natural (from the eval windows ``tokens`` / ``doc_ids``) and the ``n`` matched random controls. ``pool``: the token ids with a mean field (query types;
    :func:`mfpipe.experiments.prompts.classes.queryable_types`), ``tracked`` the :class:`~mfpipe.corpus.tracked.TrackedSet` (BOS id,
    strings for the built-in tasks). Each class draws from its own generator of ``seed``. Also returns
    ``info``: per class the count (``counts``), per task its number of usable pairs (``tasks``) and its source
    (``sources``)."""
    bos = int(tracked.bos_id)
    ind, rnd = induction_and_random_prompts(pool, bos, context_length, n, n_random=n_random,
                                            seed=np.random.default_rng([int(seed), 0]))
    nat = natural_prompts(tokens, doc_ids, pool, n, length=natural_length, seed=np.random.default_rng([int(seed), 1]))
    tasks = fewshot_tasks(tokenizer, tracked.strings, tuple(tasks), task_files)
    few = fewshot_prompts(tokenizer, tasks, bos, context_length, n_fewshot, sep=sep, joiner=joiner,
                          seed=np.random.default_rng([int(seed), 2]))
    prompts = ind + few + nat + rnd
    info = {"counts": {c: sum(p.cls == c for p in prompts) for c in CLASSES},
            "tasks": {t.name: len(t.pairs) for t in tasks}, "sources": {t.name: t.source for t in tasks}}
    return prompts, info


def meter_chunk_length(requested: int | None, window_length: int) -> tuple[int, bool]:
    """The chunk length ``k`` of ``[BOS; c; c]`` in windows of ``T = window_length`` tokens: ``requested`` (None:
    the longest that fits), cut to ``(T-1) // 2`` where ``2k + 1 > T``. Returns (k, whether it was cut)."""
    fit = (int(window_length) - 1) // 2
    if requested is None or int(requested) <= fit:
        return (fit if requested is None else int(requested)), False
    return fit, True


def meter_sequences(tokens: np.ndarray, doc_ids: np.ndarray, n: int, k: int | None = None, *, bos_id: int,
                    seed=0) -> tuple[np.ndarray, int]:
    """``[BOS; c; c]`` rows ``[n', 1 + 2k]`` (int64) with ``c`` the tokens at positions ``1..k`` of an eval-half
    window (``k`` default ``(T-1) // 2``): windows in a seeded random order, those whose chunk lies in one
    document first, then the others. Returns (sequences, how many chunks span a document boundary)."""
    tokens, doc_ids = np.asarray(tokens), np.asarray(doc_ids)
    T = tokens.shape[1]
    k = (T - 1) // 2 if k is None else int(k)
    if not 1 <= k <= (T - 1) // 2:
        raise ValueError(f"chunk length k={k} must lie in [1, (T-1)//2 = {(T - 1) // 2}]")
    order = _rng(seed).permutation(tokens.shape[0])
    one_doc = (doc_ids[order, 1 : k + 1] == doc_ids[order, 1:2]).all(1)
    pick = np.concatenate([order[one_doc], order[~one_doc]])[: int(n)]
    c = tokens[pick, 1 : k + 1].astype(np.int64)
    seqs = np.concatenate([np.full((len(pick), 1), int(bos_id), np.int64), c, c], axis=1)
    return seqs, max(0, len(pick) - int(one_doc.sum()))
