"""The exclusion arm's tracked set (paper App. ``app:llama``, "Exclusion experiment: structural tokens are not the
cause"): the main tracked set's selection rerun with every newline / whitespace and pure-punctuation type (and any type
the user lists) left out. The arm is one config section (``exclusion``), one rule file (workflow/rules/exclusion.smk)
and one test file (tests/test_exclusion.py) over two modules named for it: this one, the corpus stage's part, and
:mod:`mfpipe.experiments.rollout.exclusion`, the rollout's part (its side-by-side table and targets). The selection
lives with the corpus so that its job reads nothing else: editing the rollout's code reruns no statistics of the arm.

Selection (:func:`select_arm`): the SAME rule as the main tracked set (:func:`mfpipe.corpus.tracked.select_tracked`:
the top-N types by count on the ``stats`` half, ties broken by the smaller id, BOS and types that never occur never
tracked), applied to the vocabulary with the excluded types removed. So the arm is the main top-N minus its excluded
types, topped up with the next most frequent types that are not excluded, up to N (the paper's "top-1000 of the
remaining vocabulary"); a top-up type is itself never an excluded one. Its file is
results/corpus/<corpus>/<model>/tracked-excl.json; its statistics are the datasets ``excl/stats`` and ``excl/eval``
(the primary corpus's halves with that tracked set, :data:`mfpipe.stats.rules.EXCLUSION_ARM`), their own jobs.

Classes (config ``exclusion.classes``), on a type's decoded string ``s``:

- ``newline_whitespace``: ``s`` is non-empty and every character is Unicode whitespace (``str.isspace``: newline,
  carriage return, tab, space, NBSP, the Unicode line and paragraph separators, ...).
- ``punctuation``: ``s`` stripped of leading and trailing whitespace is non-empty and every remaining character is
  Unicode punctuation (general category ``P*``) or a math, currency or modifier symbol (``Sm``, ``Sc``, ``Sk``), which
  covers all of ASCII's ``string.punctuation``; letters, digits, marks, other symbols (emoji, the replacement
  character of a partial UTF-8 byte) and inner whitespace make a type not pure punctuation (``").\\n\\n"`` is one,
  ``". ."`` is not).

The user's ``exclusion.strings`` exclude types whose decoded string equals one of them exactly. Both lists empty:
no arm (:func:`arm_active`).

"""

from __future__ import annotations

import unicodedata
from collections.abc import Callable, Sequence

__all__ = ["CLASSES", "PREDICATES", "N_EXAMPLES", "is_newline_whitespace", "is_punctuation", "exclusion_reason",
           "arm_active", "select_arm", "arm_tracked", "excluded_examples"]

CLASSES = ("newline_whitespace", "punctuation")
# the general categories a pure-punctuation type's characters are in
PUNCTUATION_CATEGORIES = frozenset({"Pc", "Pd", "Ps", "Pe", "Pi", "Pf", "Po", "Sm", "Sc", "Sk"})
N_EXAMPLES = 8  # excluded types named by string in the table


def is_newline_whitespace(s: str) -> bool:
    """Whether ``s`` is non-empty and only whitespace / newlines (Unicode-aware: ``str.isspace``)."""
    return bool(s) and s.isspace()


def is_punctuation(s: str) -> bool:
    """Whether ``s`` is pure punctuation, optionally with leading / trailing whitespace (module docstring)."""
    core = s.strip()
    return bool(core) and all(unicodedata.category(ch) in PUNCTUATION_CATEGORIES for ch in core)


PREDICATES = {"newline_whitespace": is_newline_whitespace, "punctuation": is_punctuation}


def exclusion_reason(s: str, classes: Sequence[str] = CLASSES, strings: Sequence[str] = ()) -> str | None:
    """Why type string ``s`` is excluded (a class name, or ``"string"`` for a user string), or None."""
    unknown = set(classes) - set(PREDICATES)
    if unknown:
        raise ValueError(f"unknown exclusion class(es) {sorted(unknown)}; known: {list(CLASSES)}")
    if s in set(strings):
        return "string"
    for name in classes:
        if PREDICATES[name](s):
            return name
    return None


def arm_active(exclude: dict | None) -> bool:
    """Whether config section ``exclusion`` asks for the arm (a class or a user string)."""
    return bool(exclude and (exclude.get("classes") or exclude.get("strings")))


def select_arm(counts, n: int, bos_id: int, decode: Callable[[int], str], classes: Sequence[str] = CLASSES,
               strings: Sequence[str] = (), meta: dict | None = None):
    """The arm's tracked set (:class:`mfpipe.corpus.tracked.TrackedSet`): :func:`~mfpipe.corpus.tracked.select_tracked`
    with every excluded type met walking down the frequency order left out (module docstring). Only the types that
    walk meets are decoded. ``meta`` gains ``exclude`` (the classes and strings), ``excluded`` (every type skipped:
    id, string, count, main-order rank, reason) and ``n_excluded_of_main`` (how many of the main top-``n`` are
    excluded)."""
    import numpy as np

    from mfpipe.corpus.tracked import select_tracked

    counts = np.asarray(counts, dtype=np.int64)
    eligible = counts.copy()
    eligible[bos_id] = 0
    order = np.lexsort((np.arange(len(eligible)), -eligible))
    excluded, kept = [], 0
    for rank, i in enumerate(order.tolist()):
        if kept == n or eligible[i] <= 0:
            break
        s = decode(int(i))
        reason = exclusion_reason(s, classes, strings)
        if reason is None:
            kept += 1
        else:
            excluded.append({"id": int(i), "string": s, "count": int(counts[i]), "rank": rank, "reason": reason})
    meta = {**(meta or {}), "exclude": {"classes": list(classes), "strings": list(strings)}, "excluded": excluded,
            "n_excluded_of_main": sum(e["rank"] < n for e in excluded)}
    return select_tracked(counts, n, bos_id, decode, exclude_ids=[e["id"] for e in excluded], meta=meta)


def arm_tracked(shards_dir, model_spec: dict, results: str, n: int, classes: Sequence[str], strings: Sequence[str]):
    """The arm's tracked set of a model's corpus shards (the ``stats`` half's counts, as the main set's job counts
    them: :func:`mfpipe.corpus.jobs.tracked_types`), with its tokenizer decoding each type."""
    import json
    from pathlib import Path

    from mfpipe.corpus.tracked import count_types
    from mfpipe.corpus.windows import list_shards, read_shard
    from mfpipe.models.loader import load_tokenizer

    shards = Path(shards_dir)
    info = json.loads((shards / "fingerprint.json").read_text())
    tokenizer = load_tokenizer(model_spec, results_dir=results)
    counts = count_types((read_shard(x).tokens for x in list_shards(shards / "stats")), info["vocab_size"])
    return select_arm(counts, int(n), info["bos_id"], lambda i: tokenizer.decode([i]), classes, strings,
                      meta={"model": model_spec["name"], "corpus": info["corpus"],
                            "corpus_fingerprint": info["fingerprint"], "context_length": info["context_length"],
                            "arm": "exclusion"})


def excluded_examples(tracked_meta: dict, k: int = N_EXAMPLES) -> str:
    """The first ``k`` excluded types of the main top-N, most frequent first, by string (``repr``: newlines shown)."""
    return ", ".join(repr(e["string"]) for e in tracked_meta.get("excluded", [])[:k])
