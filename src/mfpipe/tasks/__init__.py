"""Word-pair tasks for few-shot (in-context) prompts: the paper's tasks as vendored data, and the user's own files.

A task (:class:`FewShotTask`) is a list of ``(input, output)`` string pairs, optionally grouped (a prompt then
draws all its pairs from one group), with the ``source`` it came from. :func:`fewshot_text` writes the prompt text
the experiments encode: five exemplars and the query input, ``x1:y1\\nx2:y2\\n…\\nxq:``.

Vendored data (``data/``, package data: a wheel ships it)
---------------------------------------------------------
Todd et al.'s function-vector datasets (``github.com/ericwtodd/function_vectors``, MIT licence; ``data/LICENSE``,
``data/SOURCE.md`` with the commit), the files byte for byte as published. Each is a JSON list of
``{"input": ..., "output": ...}`` objects; :func:`load_task` keeps their order, strips whitespace and drops exact
duplicate pairs. Names (:func:`vendored_tasks`): ``antonym``, ``capitalize``, ``country-capital``,
``country-currency``, ``english-french``, ``landmark-country``, ``present-past``, ``singular-plural``.

* :data:`PAPER_ICL_TASKS`: the few-shot class of the paper's Exp. 2 (antonym, country-capital, present-past,
  singular-plural, capitalize);
* :data:`PAPER_FV_TASKS`: the function-vector tasks (antonym, country-capital, present-past, country-language,
  country-currency, english-french). The source has no country-language dataset; ``landmark-country`` (the
  closest one: a geographic look-up with a country on one side) stands in for it (:data:`STAND_INS`).

``data/unrelated-words.txt`` (:func:`unrelated_words`): generic everyday nouns, the function-vector category
analysis's "unrelated words" population (this package's list, not from the source).

A user's own task is a JSON file::

    {"name": "antonym", "pairs": [["hot", "cold"], ["big", "small"], ...]}

``name`` a non-empty string, ``pairs`` at least six ``[input, output]`` pairs of non-empty strings, optional
``"groups"`` (one label per pair) and ``"source"`` (a string; default the file's path).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

__all__ = ["FewShotTask", "N_EXEMPLARS", "PAPER_ICL_TASKS", "PAPER_FV_TASKS", "STAND_INS", "SOURCE_REPO",
           "SOURCE_COMMIT", "vendored_tasks", "vendored_path", "load_task", "load_task_file", "fewshot_text",
           "zeroshot_text", "encode_text", "encode_fewshot", "encodes_back", "TASK_FILE_FORMAT", "unrelated_words"]

#: exemplars per few-shot prompt (a prompt draws ``N_EXEMPLARS + 1`` distinct pairs: the exemplars and the query)
N_EXEMPLARS = 5

#: the few-shot class of the paper's Exp. 2
PAPER_ICL_TASKS = ("antonym", "country-capital", "present-past", "singular-plural", "capitalize")
#: the paper's function-vector tasks; ``landmark-country`` stands in for country-language (:data:`STAND_INS`)
PAPER_FV_TASKS = ("antonym", "country-capital", "present-past", "landmark-country", "country-currency",
                  "english-french")
#: a paper task the source does not have -> the vendored task that stands in for it
STAND_INS = {"country-language": "landmark-country"}

SOURCE_REPO = "ericwtodd/function_vectors"
SOURCE_COMMIT = "fb9eac7b6dc707ea1475a717379916007fe448d5"
SOURCE_DIR = "dataset_files/abstractive"

TASK_FILE_FORMAT = ('a JSON file {"name": "...", "pairs": [["input", "output"], ...]} with at least '
                    f'{N_EXEMPLARS + 1} pairs of non-empty strings (optional "groups": one label per pair)')

_DATA = resources.files(__package__).joinpath("data")


@dataclass
class FewShotTask:
    """A word-pair task: ``pairs`` of (input, output) strings; ``groups`` (optional, one label per pair): each
    prompt draws its pairs from one group; ``source``: where the pairs come from."""

    name: str
    pairs: list[tuple[str, str]]
    groups: list[str] | None = None
    source: str = ""

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


def fewshot_text(exemplars, query_input: str, sep: str = ":", joiner: str = "\n") -> str:
    """The few-shot prompt text: ``x1{sep}y1{joiner}…{joiner}xq{sep}`` (no BOS; the caller prepends it as a token)."""
    return joiner.join(f"{x}{sep}{y}" for x, y in exemplars) + f"{joiner}{query_input}{sep}"


def zeroshot_text(query_input: str, sep: str = ":") -> str:
    """The zero-shot prompt text: ``xq{sep}`` (no exemplars, no joiner before it; no BOS)."""
    return f"{query_input}{sep}"


def encode_text(tokenizer, text: str) -> list[int]:
    """``text``'s token ids without special tokens (the caller prepends BOS as a token)."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def encode_fewshot(tokenizer, text: str, answer: str, *, max_tokens: int | None = None,
                   exact: bool = False) -> tuple[list[int], int] | None:
    """A prompt text (:func:`fewshot_text`, :func:`zeroshot_text`) encoded, with the token its answer starts with:
    ``(ids of text, first token of answer)``, where ``text + answer`` encodes as ``text``'s tokens followed by at
    least one more (the answer continues the prompt's tokens). None where it does not, where ``text`` takes more
    than ``max_tokens`` tokens, or (``exact``) where the answer's tokens do not decode back to ``answer``. The one
    place the experiments encode and check a few-shot prompt (Exp. 2's class, function vectors, the mini suite)."""
    ids = encode_text(tokenizer, text)
    if max_tokens is not None and len(ids) > int(max_tokens):
        return None
    full = encode_text(tokenizer, text + answer)
    if len(full) <= len(ids) or full[: len(ids)] != ids:
        return None
    if exact and tokenizer.decode(full[len(ids):]) != answer:
        return None
    return ids, int(full[len(ids)])


def encodes_back(tokenizer, text: str, max_tokens: int | None = None) -> bool:
    """Whether ``text`` encodes (no special tokens) to 1..``max_tokens`` tokens that decode back to ``text``."""
    ids = encode_text(tokenizer, text)
    return 0 < len(ids) <= (len(ids) if max_tokens is None else int(max_tokens)) and tokenizer.decode(ids) == text


def unrelated_words() -> list[str]:
    """The generic word list ``data/unrelated-words.txt``, in its order (comment lines dropped)."""
    text = _DATA.joinpath("unrelated-words.txt").read_text(encoding="utf-8")
    return [w.strip() for w in text.splitlines() if w.strip() and not w.lstrip().startswith("#")]


def vendored_tasks() -> list[str]:
    """The names of the vendored datasets (sorted)."""
    return sorted(p.name[: -len(".json")] for p in _DATA.iterdir() if p.name.endswith(".json"))


def vendored_path(name: str):
    """The packaged file of vendored task ``name`` (a :class:`~importlib.resources.abc.Traversable`)."""
    if name not in vendored_tasks():
        raise ValueError(_unknown(name))
    return _DATA.joinpath(f"{name}.json")


def _unknown(name: str) -> str:
    why = (f"; the source ({SOURCE_REPO}) has no such dataset, {STAND_INS[name]!r} stands in for it"
           if name in STAND_INS else "")
    return (f"unknown few-shot task {name!r}{why}: give a vendored dataset ({', '.join(vendored_tasks())}) or the "
            f"path of {TASK_FILE_FORMAT}")


def _filtered(pairs, tokenizer, max_tokens):
    if tokenizer is None:
        return pairs
    return [p for p in pairs if all(encodes_back(tokenizer, s, max_tokens) for s in p)]


def load_task(name_or_path, *, tokenizer=None, max_tokens: int | None = None) -> FewShotTask:
    """A vendored dataset by name (:func:`vendored_tasks`) or a user's task file by path (module docstring).

    Vendored pairs keep the file's order, stripped of surrounding whitespace, exact duplicates dropped. With a
    ``tokenizer`` only pairs whose input and output each encode to at least one (at most ``max_tokens``, default
    any number of) tokens that decode back to the string are kept. An unknown name raises ValueError naming it, the
    vendored names and the file format."""
    key = str(name_or_path)
    if key in vendored_tasks():
        items = json.loads(vendored_path(key).read_text(encoding="utf-8"))
        pairs = list(dict.fromkeys((str(d["input"]).strip(), str(d["output"]).strip()) for d in items))
        pairs = [p for p in pairs if p[0] and p[1]]
        source = f"{SOURCE_REPO}@{SOURCE_COMMIT}:{SOURCE_DIR}/{key}.json"
        return FewShotTask(key, _filtered(pairs, tokenizer, max_tokens), None, source)
    path = Path(key)
    if not (path.suffix == ".json" or path.exists() or "/" in key or "\\" in key):
        raise ValueError(_unknown(key))
    task = load_task_file(path)
    if tokenizer is not None:
        keep = [i for i, p in enumerate(task.pairs) if _filtered([p], tokenizer, max_tokens)]
        groups = None if task.groups is None else [task.groups[i] for i in keep]
        task = FewShotTask(task.name, [task.pairs[i] for i in keep], groups, task.source)
    return task


def load_task_file(path) -> FewShotTask:
    """A user's word-pair task (JSON, format in the module docstring)."""
    path = Path(path)
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"few-shot task file {path}: {e} (expected {TASK_FILE_FORMAT})") from None
    name, pairs = d.get("name") if isinstance(d, dict) else None, d.get("pairs") if isinstance(d, dict) else None
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"few-shot task file {path}: needs a non-empty string 'name'")
    ok = isinstance(pairs, list) and all(
        isinstance(p, list) and len(p) == 2 and all(isinstance(s, str) and s for s in p) for p in pairs)
    if not ok:
        raise ValueError(f"few-shot task file {path}: 'pairs' must be a list of [input, output] non-empty strings")
    if len(pairs) < N_EXEMPLARS + 1:
        raise ValueError(f"few-shot task file {path}: {len(pairs)} pairs; a prompt needs {N_EXEMPLARS + 1}")
    source = d.get("source") if isinstance(d.get("source"), str) and d.get("source") else str(path)
    return FewShotTask(name.strip(), [tuple(p) for p in pairs], d.get("groups"), source)
