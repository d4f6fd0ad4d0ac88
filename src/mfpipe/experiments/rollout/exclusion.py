"""The exclusion arm (App. ``app:llama``, "Exclusion experiment: structural tokens are not the cause"): the whole
pipeline -- token selection, corpus statistics, rollout -- rerun with every newline / whitespace and pure-punctuation
type (and any type the user lists) excluded from the tracked vocabulary, compared side by side with the main set.

The arm is one config section (``exclusion``), one rule file (workflow/rules/exclusion.smk) and one test file
(tests/test_exclusion.py) over two modules named for it: this one, the rollout's part, and
:mod:`mfpipe.corpus.exclusion`, the corpus stage's: the selection, the classes and the arm's tracked set (its names are
re-exported here), apart so that editing the rollout's code reruns no statistics of the arm.
Its file is results/corpus/<corpus>/<model>/tracked-excl.json; its statistics are the datasets ``excl/stats`` and
``excl/eval`` (the primary corpus's halves with that tracked set, :data:`mfpipe.stats.rules.EXCLUSION_ARM`), their own
jobs.

The side-by-side table (:func:`arm_summary`, :func:`side_by_side`): per arm the tracked-set size, the types excluded
(of the main top-N, with examples), the mean-field rollout's mean centred cosine over depths ``1..L``, the
teacher-forced accuracy (mean over layers of the teacher-forced centred cosine), the peak centred-magnitude ratio
(max over depths of the predicted over the true centred RMS norm of the centroid cloud) and the divergence
diagnostics' headline (:func:`divergence_headline`).
"""

from __future__ import annotations

from collections.abc import Callable

from mfpipe.corpus.exclusion import (  # noqa: F401  (the arm's selection, re-exported)
    CLASSES,
    N_EXAMPLES,
    PREDICATES,
    arm_active,
    arm_tracked,
    excluded_examples,
    exclusion_reason,
    is_newline_whitespace,
    is_punctuation,
    select_arm,
)

# the divergence diagnostics' readings the table shows per arm (mfpipe.experiments.rollout.divergence.headline)
DIVERGENCE_KEYS = ("peak_amplification", "peak_layer", "peak_split", "top10_energy_share")


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
    from mfpipe.models.adapters.calls import row_tokens

    L, types = adapter.n_layers, setup.types
    kernel = K.mean_field(setup.P)
    with row_tokens(adapter, setup.type_ids):  # the rows are the arm's types (R.on_types)
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
    """Per model and rollout revision, the side-by-side table, when config section ``exclusion`` asks for the arm."""
    if not arm_active(plan.config["exclusion"]):
        return []
    R = plan.results
    return [f"{R}/tables/exclusion_{m}_{rev}.{e}" for m in plan.models for rev in plan.rollout_revisions[m]
            for e in ("csv", "md")]
