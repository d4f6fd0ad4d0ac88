"""Rollout and error accounting (paper Sec. 4, App. D–K): Alg. 1 with every kernel of Table 1 scored against the
held-out centroids, the nested estimators of Sec. 4.3 and the descriptive diagnostics.

- :mod:`~mfpipe.experiments.rollout.algorithm` — the open-loop rollout (Alg. 1) and the teacher-forced estimators.
- :mod:`~mfpipe.experiments.rollout.kernels` — the kernels of Table 1 (mean field and its ablations).
- :mod:`~mfpipe.experiments.rollout.layered` — a kernel computed one layer at a time (the store's P read per layer).
- :mod:`~mfpipe.experiments.rollout.metrics` — scores of a predicted centroid cloud against the true one.
- :mod:`~mfpipe.experiments.rollout.diagnostics` — per-layer clustering and value-map diagnostics (App. D, H, K).
- :mod:`~mfpipe.experiments.rollout.runs` — from stores to long score tables; the cross-corpus matrix (App. G).
- :mod:`~mfpipe.experiments.rollout.accounting` — the error accounting (Sec. 4.3, App. D, F, H, K).
- :mod:`~mfpipe.experiments.rollout.divergence` — the divergence diagnostics (App. llama): per-step amplification
  split into attention update and MLP, the curvature test, the MLP's nonlinear excess over its units, per-token
  amplification, the centred magnitude, capitalisation pairs.
- :mod:`~mfpipe.experiments.rollout.localized` — layer-localized kernel substitution (tab:qwen-layers), the rogue
  dimensions and every kernel pinned vs unpinned (tab:rogue-dims, tab:qwen-pinned).
- :mod:`~mfpipe.experiments.rollout.tables` — cross-layer summaries (Table 1 and its kin) and their Markdown.
- :mod:`~mfpipe.experiments.rollout.figures` — the rollout figures, drawn from those tables.
- :mod:`~mfpipe.experiments.rollout.exclusion` — the exclusion arm (App. llama; config section ``exclusion``,
  workflow/rules/exclusion.smk): its side-by-side table and targets; its tracked set (the same selection with newline /
  whitespace, punctuation and listed types skipped) is the corpus stage's, :mod:`mfpipe.corpus.exclusion`.
- :mod:`~mfpipe.experiments.rollout.jobs` — the jobs of workflow/rules/rollout.smk, one function per rule (one
  for all the figures); :mod:`~mfpipe.experiments.rollout.rules` — its targets, figures and output paths.

Held-out protocol (Sec. 4.1, App. E): every corpus quantity a prediction uses -- the kernel ``P``, the
co-occurrence counts, ``mu``, the measured reads ``zbar``, the centroids fed to the teacher-forced
estimators, the rogue dimensions -- comes from the ``stats`` half; the truth a prediction is scored against
(the centroids ``c^l``, the measured ``sum_h zbar``) comes from the ``eval`` half. The descriptive
diagnostics (clustering and Jensen gap, App. D; anisotropy, App. H; MLP gap, App. K) describe one half,
the ``eval`` half by default. Attention-mass coverage (App. F) describes the kernel, i.e. the ``stats`` half.

Evaluation set: the tracked types with at least ``min_count`` occurrences in the statistics half AND in the
evaluation half (:func:`eval_types`); on the primary corpus that is every tracked type. A type with no
occurrence in the statistics half (possible for a cross corpus, App. G) has no kernel row; it is given the
average row of the others (``P``'s mean over the defined rows, so ``meanq`` is unchanged) so the rollout
stays finite, and it is never scored.

Tables are long-format :class:`pandas.DataFrame` s (one row per kernel / estimator, depth and metric); the
``*_summary`` functions reduce them to the cross-layer mean and standard error over layers (Table 1).
Depths: a residual depth ``l`` (``0..L``; ``L`` = final residual before the last norm) is the input of block
``l``; the rollout is scored at depths ``1..L``; per-block quantities (teacher-forced attention, MLP gap,
Jensen gap) are indexed by the block ``layer = 0..L-1``. ``frac_depth`` is ``depth / L`` for residual depths
and ``(layer + 1) / L`` (the depth the block writes to) for per-block quantities.
"""
