"""Function vectors from mean-field deviation (paper Sec. 6.4, eq:taskresid; App. fv).

- :mod:`~mfpipe.experiments.fv.prompts` — the task's pairs, splits, clean / label-shuffled / zero-shot prompts.
- :mod:`~mfpipe.experiments.fv.heads` — the heads' reads at the cue (one forward per prompt), the corpus null,
  the task deviation r, the MFA / raw-magnitude / random selections and Todd et al.'s AIE.
- :mod:`~mfpipe.experiments.fv.inject` — the summed (residual) and per-head injection protocols.
- :mod:`~mfpipe.experiments.fv.experiment` — one task end to end: sweep, held-out evaluation, category analysis.
- :mod:`~mfpipe.experiments.fv.tables`, :mod:`~mfpipe.experiments.fv.figures` — Tables fv-matrix-body /
  fv-matrix, stability and categories; Fig. fv.
- :mod:`~mfpipe.experiments.fv.jobs` — the jobs of workflow/rules/fv.smk, one function per rule;
  :mod:`~mfpipe.experiments.fv.rules` — its targets and input functions.
"""
