"""The exclusion arm (App. ``app:llama``, "Exclusion experiment: structural tokens are not the cause"): the whole
pipeline -- token selection, corpus statistics, rollout -- rerun with every newline / whitespace and pure-punctuation
type (and any type the user lists) excluded from the tracked vocabulary, compared side by side with the main set.

Selection (:func:`select_arm`): the SAME rule as the main tracked set (:func:`mfpipe.corpus.tracked.select_tracked`:
the top-N types by count on the ``stats`` half, ties broken by the smaller id, BOS and types that never occur never
tracked), applied to the vocabulary with the excluded types removed. So the arm is the main top-N minus its excluded
types, topped up with the next most frequent types that are not excluded, up to N (the paper's "top-1000 of the
remaining vocabulary"); a top-up type is itself never an excluded one. Its file is
results/corpus/<corpus>/<model>/tracked-excl.json; its statistics are the datasets ``excl/stats`` and ``excl/eval``
(the primary corpus's halves with that tracked set, :data:`mfpipe.stats.rules.EXCLUSION_ARM`), their own jobs.

Classes (config ``tracked.exclude.classes``), on a type's decoded string ``s``:

- ``newline_whitespace``: ``s`` is non-empty and every character is Unicode whitespace (``str.isspace``: newline,
  carriage return, tab, space, NBSP, the Unicode line and paragraph separators, ...).
- ``punctuation``: ``s`` stripped of leading and trailing whitespace is non-empty and every remaining character is
  Unicode punctuation (general category ``P*``) or a math, currency or modifier symbol (``Sm``, ``Sc``, ``Sk``), which
  covers all of ASCII's ``string.punctuation``; letters, digits, marks, other symbols (emoji, the replacement
  character of a partial UTF-8 byte) and inner whitespace make a type not pure punctuation (``").\\n\\n"`` is one,
  ``". ."`` is not).

The user's ``tracked.exclude.strings`` exclude types whose decoded string equals one of them exactly. Both lists empty:
no arm (:func:`arm_active`).

The side-by-side table (:func:`arm_summary`, :func:`side_by_side`): per arm the tracked-set size, the types excluded
(of the main top-N, with examples), the mean-field rollout's mean centred cosine over depths ``1..L``, the
teacher-forced accuracy (mean over layers of the teacher-forced centred cosine), the peak centred-magnitude ratio
(max over depths of the predicted over the true centred RMS norm of the centroid cloud) and the divergence
diagnostics' headline (:func:`divergence_headline`).
"""

from __future__ import annotations

import unicodedata
from collections.abc import Callable, Sequence

CLASSES = ("newline_whitespace", "punctuation")
# the general categories a pure-punctuation type's characters are in
PUNCTUATION_CATEGORIES = frozenset({"Pc", "Pd", "Ps", "Pe", "Pi", "Pf", "Po", "Sm", "Sc", "Sk"})
N_EXAMPLES = 8  # excluded types named by string in the table
# the divergence diagnostics' readings the table shows per arm (mfpipe.experiments.rollout.divergence.headline)
DIVERGENCE_KEYS = ("peak_amplification", "peak_layer", "peak_split", "top10_energy_share")


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
    """Whether config ``tracked.exclude`` asks for the arm (a class or a user string)."""
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


def centred_rms(cloud):
    """``[..., N, d]`` -> ``[...]``: the RMS over types of the norm of each type's centred vector."""
    import numpy as np

    c = np.asarray(cloud, dtype=np.float64)
    c = c - c.mean(axis=-2, keepdims=True)
    return np.sqrt((c ** 2).sum(-1).mean(-1))


def arm_summary(adapter, setup, divergence: Callable | None = None) -> dict:
    """One arm's row (a :class:`mfpipe.experiments.rollout.runs.RolloutSetup`): the mean-field rollout's mean centred
    cosine over depths ``1..L`` (``rollout_cosine``, Table 1's mean_field row), the teacher-forced accuracy
    (``teacher_forced_cosine``), the peak centred-magnitude ratio and its depth; ``divergence(setup, kernel)`` -> the
    divergence diagnostics' headline dict, merged in when given."""
    import numpy as np

    from mfpipe.experiments.rollout import accounting as AC
    from mfpipe.experiments.rollout import algorithm as R
    from mfpipe.experiments.rollout import kernels as K
    from mfpipe.experiments.rollout import metrics as M

    L, types = adapter.n_layers, setup.types
    kernel = K.mean_field(setup.P)
    pred = R.rollout(adapter, kernel, setup.bos, init=setup.init)
    cos = M.score_layers(pred[1:, types], setup.truth[1:, types], ("cosine",))["cosine"]
    ratio = centred_rms(pred[1:, types]) / centred_rms(setup.truth[1:, types])
    tf = AC.teacher_forced_table(adapter, setup)
    row = {"n_tracked": int(len(setup.type_ids)), "n_scored": int(types.size), "rollout_cosine": float(np.mean(cos)),
           "teacher_forced_cosine": float(tf.loc[tf["metric"] == "cosine", "value"].mean()),
           "peak_magnitude_ratio": float(ratio.max()), "peak_magnitude_depth": int(np.argmax(ratio)) + 1,
           "n_layers": int(L)}
    if divergence is not None:
        head = dict(divergence(setup, kernel))
        row.update({f"div_{k}": head.get(k) for k in DIVERGENCE_KEYS})
        row["div_top_tokens"] = ", ".join(repr(t) for t in head.get("top_tokens", []))
    return row


def divergence_headline(adapter, model, cfg: dict, seed: int = 0, rogue_factor: float = 15.0) -> Callable:
    """``(setup, mean_field) -> headline``: the divergence diagnostics of one arm
    (:func:`mfpipe.experiments.rollout.divergence.run` and ``headline``) with config ``rollout.divergence`` ``cfg``
    (its kernel -- the mean field by default, the one :func:`arm_summary` rolls out -- its pinning, curvature grid,
    units and seed), as the job ``rollout_divergence`` runs them on the main set: the main arm's readings are that
    job's headline."""

    def diagnose(setup, mean_field):
        from mfpipe.experiments.rollout import divergence as DV
        from mfpipe.experiments.rollout import runs as RO

        kernel = mean_field if cfg["kernel"] == "mean_field" else RO.build_kernel(cfg["kernel"], setup, model=model,
                                                                                  seed=seed)
        pin = RO.pinning(setup, rogue_factor) if cfg["pin"] else None
        if pin is not None and not pin[0].size:
            pin = None  # no rogue dimension at that factor: unpinned, as rollout_divergence does
        return DV.headline(DV.run(adapter, setup, kernel, alphas=tuple(cfg["alphas"]), top_k=int(cfg["top_k"]),
                                  n_random=int(cfg["n_random"]), seed=int(cfg["seed"]), pin=pin,
                                  n_top=int(cfg["n_top"])))

    return diagnose


def excluded_examples(tracked_meta: dict, k: int = N_EXAMPLES) -> str:
    """The first ``k`` excluded types of the main top-N, most frequent first, by string (``repr``: newlines shown)."""
    return ", ".join(repr(e["string"]) for e in tracked_meta.get("excluded", [])[:k])


def side_by_side(main: dict, arm: dict, arm_meta: dict):
    """The two arms' rows as one table (:class:`pandas.DataFrame`, rows ``main`` and ``exclusion``): the arm's row
    says how many types of the main top-N were excluded, by which rule, and names a few."""
    import pandas as pd

    ex = arm_meta.get("exclude", {})
    rows = [{"arm": "main", "n_excluded": 0, "excluded_examples": "", **main},
            {"arm": "exclusion", "n_excluded": int(arm_meta.get("n_excluded_of_main", 0)),
             "excluded_examples": excluded_examples(arm_meta),
             "rule": "+".join(list(ex.get("classes", [])) + (["strings"] if ex.get("strings") else [])), **arm}]
    df = pd.DataFrame(rows)
    first = ["arm", "n_tracked", "n_excluded", "rule", "excluded_examples"]
    return df[first + [c for c in df.columns if c not in first]]


def side_by_side_markdown(df, title: str) -> str:
    """The table transposed (a quantity per row, an arm per column), to read the two arms side by side."""
    from mfpipe.workflow.tables import to_markdown

    wide = df.set_index("arm").T.reset_index().rename(columns={"index": "quantity"})
    wide = wide.astype(object).where(wide.notna(), "")
    wide = wide.map(lambda v: v.replace("|", "\\|") if isinstance(v, str) else v)  # a `|` type would split a cell
    return f"**{title}**\n\n" + to_markdown(wide) + "\n"


def targets(plan) -> list[str]:
    """Per model and rollout revision, the side-by-side table, when config ``tracked.exclude`` asks for the arm."""
    if not arm_active(plan.config["tracked"].get("exclude")):
        return []
    R = plan.results
    return [f"{R}/tables/exclusion_{m}_{rev}.{e}" for m in plan.models for rev in plan.rollout_revisions[m]
            for e in ("csv", "md")]
