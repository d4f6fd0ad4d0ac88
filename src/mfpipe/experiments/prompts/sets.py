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
Built offline from words the tokenizer encodes (:func:`builtin_tasks`): the words are the tracked types' strings
that are lower-case alphabetic words (leading whitespace stripped, at least ``min_word_length`` letters, encoding
to at most ``max_word_tokens`` tokens and decoding back to themselves; by default only types that begin a word,
i.e. whose string starts with whitespace, a heuristic against sub-word pieces):

* ``capitalisation``: ``word -> Word`` (``style="upper"``: ``WORD``), kept where the output is a known token
  sequence: it decodes back to itself from at most ``max_word_tokens`` tokens and differs from the input;
* ``copying``: ``word -> word``;
* ``successor``: number words ``one -> two .. nine -> ten``, letters ``a -> b .. y -> z``, digits
  ``0 -> 1 .. 8 -> 9``; three groups, each prompt draws all six pairs from one group.

A user's own word-pair task (the paper's antonym, capital, past-tense and plural tasks come from published
function-vector datasets) is a JSON file read by :func:`load_task_file`::

    {"name": "antonym", "pairs": [["hot", "cold"], ["big", "small"], ...]}

``name`` a non-empty string, ``pairs`` at least six ``[input, output]`` pairs of non-empty strings (an optional
``"groups"``: one label per pair, prompts then draw within one group).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

__all__ = ["Prompt", "FewShotTask", "CLASSES", "induction_and_random_prompts", "natural_prompts", "fewshot_prompts",
           "builtin_tasks", "load_task_file", "task_words", "fewshot_text", "prompt_classes", "eval_windows",
           "meter_sequences", "N_EXEMPLARS", "BUILTIN_TASKS"]

#: the classes in the paper's table order (planted ICL, background ICL, control)
CLASSES = ("induction", "few-shot", "natural", "random")


def ordered_classes(df, classes=CLASSES) -> list[str]:
    """The prompt classes present in a per-prompt table (its ``cls`` column): the paper's order first, then any other."""
    present = list(dict.fromkeys(df["cls"]))
    return [c for c in classes if c in present] + [c for c in present if c not in classes]
N_EXEMPLARS = 5
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
@dataclass
class FewShotTask:
    """A word-pair task: ``pairs`` of (input, output) strings; ``groups`` (optional, one label per pair): each
    prompt draws its pairs from one group."""

    name: str
    pairs: list[tuple[str, str]]
    groups: list[str] | None = None

    def __post_init__(self):
        self.pairs = [(str(a), str(b)) for a, b in self.pairs]
        if self.groups is not None and len(self.groups) != len(self.pairs):
            raise ValueError(f"task {self.name!r}: {len(self.groups)} group labels for {len(self.pairs)} pairs")

    def pools(self, need: int = N_EXEMPLARS + 1) -> list[list[tuple[str, str]]]:
        """The pair lists prompts draw from (one per group with at least ``need`` pairs)."""
        if self.groups is None:
            return [self.pairs] if len(self.pairs) >= need else []
        by: dict[str, list] = {}
        for g, p in zip(self.groups, self.pairs):
            by.setdefault(g, []).append(p)
        return [v for v in by.values() if len(v) >= need]


def load_task_file(path) -> FewShotTask:
    """A user's word-pair task (JSON, format in the module docstring)."""
    path = Path(path)
    try:
        d = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"few-shot task file {path}: {e}") from None
    name, pairs = d.get("name") if isinstance(d, dict) else None, d.get("pairs") if isinstance(d, dict) else None
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"few-shot task file {path}: needs a non-empty string 'name'")
    ok = isinstance(pairs, list) and all(
        isinstance(p, list) and len(p) == 2 and all(isinstance(s, str) and s for s in p) for p in pairs)
    if not ok:
        raise ValueError(f"few-shot task file {path}: 'pairs' must be a list of [input, output] non-empty strings")
    if len(pairs) < N_EXEMPLARS + 1:
        raise ValueError(f"few-shot task file {path}: {len(pairs)} pairs; a prompt needs {N_EXEMPLARS + 1}")
    return FewShotTask(name.strip(), [tuple(p) for p in pairs], d.get("groups"))


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _roundtrips(tokenizer, text: str, max_tokens: int) -> bool:
    ids = _encode(tokenizer, text)
    return 0 < len(ids) <= max_tokens and tokenizer.decode(ids) == text


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
                    and _roundtrips(tokenizer, w, max_word_tokens)):
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
            pairs = [(w, f(w)) for w in words if f(w) != w and _roundtrips(tokenizer, f(w), max_word_tokens)]
            task = FewShotTask(name, pairs)
        elif name == "copying":
            task = FewShotTask(name, [(w, w) for w in words])
        elif name == "successor":
            fam = {"word": list(zip(NUMBER_WORDS[:-1], NUMBER_WORDS[1:])),
                   "letter": [(chr(c), chr(c + 1)) for c in range(ord("a"), ord("z"))],
                   "digit": [(str(i), str(i + 1)) for i in range(9)]}
            pairs, groups = [], []
            for g, ps in fam.items():
                ps = [p for p in ps if all(_roundtrips(tokenizer, s, max_word_tokens) for s in p)]
                pairs += ps
                groups += [g] * len(ps)
            task = FewShotTask(name, pairs, groups)
        else:
            raise ValueError(f"unknown built-in few-shot task {name!r}; known: capitalisation, copying, successor")
        if task.pools():
            tasks.append(task)
    return tasks


def fewshot_text(exemplars, query_input: str, sep: str = ":", joiner: str = "\n") -> str:
    return joiner.join(f"{x}{sep}{y}" for x, y in exemplars) + f"{joiner}{query_input}{sep}"


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
            ids = _encode(tokenizer, text)
            full = _encode(tokenizer, text + pick[-1][1])
            if (1 + len(ids) > context_length or full[: len(ids)] != ids or len(full) == len(ids)
                    or tokenizer.decode(full[len(ids):]) != pick[-1][1]):
                continue
            out.append(Prompt("few-shot", [bos_id] + ids, full[len(ids)], task=task.name,
                              meta={"text": text, "answer": pick[-1][1]}))
            break
    return out


# ------------------------------------------------------------------ all four classes
def prompt_classes(pool, tokenizer, tracked, context_length: int, tokens: np.ndarray, doc_ids: np.ndarray, *,
                   n: int = 60, n_fewshot: int = 48, n_random: int = 12, seed: int = 0, builtin=BUILTIN_TASKS,
                   task_files=(), natural_length: int | None = None, sep: str = ":", joiner: str = "\n"
                   ) -> tuple[list[Prompt], dict]:
    """The prompts of Experiment 2 in class order: ``n`` induction, ``n_fewshot`` few-shot (shared over the
    built-in tasks ``builtin`` and the user's ``task_files``), ``n`` natural (from the eval windows ``tokens`` /
    ``doc_ids``) and the ``n`` matched random controls. ``pool``: the token ids with a mean field (query types;
    :func:`mfpipe.experiments.prompts.classes.queryable_types`), ``tracked`` the :class:`~mfpipe.corpus.tracked.TrackedSet` (BOS id,
    strings for the built-in tasks). Each class draws from its own generator of ``seed``. Also returns
    ``info``: per class the count, the task names and the number of pairs per task."""
    bos = int(tracked.bos_id)
    ind, rnd = induction_and_random_prompts(pool, bos, context_length, n, n_random=n_random,
                                            seed=np.random.default_rng([int(seed), 0]))
    nat = natural_prompts(tokens, doc_ids, pool, n, length=natural_length, seed=np.random.default_rng([int(seed), 1]))
    tasks = builtin_tasks(tokenizer, tracked.strings, tuple(builtin)) + [load_task_file(p) for p in task_files]
    few = fewshot_prompts(tokenizer, tasks, bos, context_length, n_fewshot, sep=sep, joiner=joiner,
                          seed=np.random.default_rng([int(seed), 2]))
    prompts = ind + few + nat + rnd
    info = {"counts": {c: sum(p.cls == c for p in prompts) for c in CLASSES},
            "tasks": {t.name: len(t.pairs) for t in tasks}}
    return prompts, info


def eval_windows(shards_dir, max_windows: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, doc_ids) of the first ``max_windows`` windows of the eval half (``<shards>/eval``, shard order)."""
    from mfpipe.corpus.windows import list_shards, read_shard

    toks, docs, have = [], [], 0
    for path in list_shards(Path(shards_dir) / "eval"):
        sh = read_shard(path)
        toks.append(sh.tokens[: max_windows - have])
        docs.append(sh.doc_ids[: max_windows - have])
        have += len(toks[-1])
        if have >= max_windows:
            break
    if not toks:
        raise FileNotFoundError(f"no eval-half shards under {Path(shards_dir) / 'eval'}; run the corpus stage first")
    return np.concatenate(toks), np.concatenate(docs)


# ------------------------------------------------------------------ Experiment 1
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
