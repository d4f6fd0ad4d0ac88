"""One package per experiment of the paper, each holding its computation, its store I/O, its tables and its figures
(docs/architecture.md, "Adding an experiment"). Below them the core they share: :mod:`mfpipe.corpus`,
:mod:`mfpipe.stats`, :mod:`mfpipe.models`, :mod:`mfpipe.meanfield` and the plumbing (:mod:`mfpipe.workflow.io`,
:mod:`mfpipe.workflow.config`, :mod:`mfpipe.workflow.revisions`, :mod:`mfpipe.workflow.logs`, :mod:`mfpipe.workflow.tables`, :mod:`mfpipe.workflow.plots`).
An experiment imports the core and never another experiment.

- :mod:`mfpipe.experiments.rollout` — Alg. 1 and the error accounting (Sec. 4, App. D–K).
- :mod:`mfpipe.experiments.substitution` — mean-field substitution across training checkpoints, the calibrated
  kernel and the kernel dynamics (Sec. 5, App. B, M, N).
- :mod:`mfpipe.experiments.ranking` — head ranking by the deviation of every head on the corpus (pass 2,
  :mod:`mfpipe.deviation`) and the behavioural head scores (Sec. 6.1 Exp. 3, Sec. 6.3, App. O).
- :mod:`mfpipe.experiments.prompts` — prompt classes, the instance meter and the lenses (Sec. 6.1–6.2, App. P).
- :mod:`mfpipe.experiments.positional` — positional transport: posVar, the positional cluster, what it moves, the BOS
  gate, the dereferencing ablation; natural against repeated text and the type-class test (App. positional, App.
  readings).
- :mod:`mfpipe.experiments.fv` — function vectors from mean-field deviation: MFA against AIE head selection, raw
  and deviation vectors, injection into zero-shot prompts, the category analysis (Sec. 6.4, App. fv).
- :mod:`mfpipe.experiments.crossmodel` — models side by side: the comparison table and the cross-model waypoint
  figure (App. waypoint-olmo, fig:crossmodel).
"""
