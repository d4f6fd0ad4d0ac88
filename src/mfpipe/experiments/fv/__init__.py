"""Function vectors from mean-field deviation (paper Sec. 6.4, eq:taskresid; App. fv).

- :mod:`~mfpipe.experiments.fv.prompts` — the task's pairs, splits, clean / label-shuffled / zero-shot prompts.
- :mod:`~mfpipe.experiments.fv.heads` — the heads' reads at the cue (one forward per prompt), the corpus null,
  the task deviation r, the MFA / raw-magnitude / random selections, head lists and Todd et al.'s AIE.
- :mod:`~mfpipe.experiments.fv.inject` — the summed (residual) and per-head injection protocols.
- :mod:`~mfpipe.experiments.fv.sweeps` — each split's tuning sweep, the raw-magnitude control over the whole grid,
  MFA·r against the number of clean prompts.
- :mod:`~mfpipe.experiments.fv.decode` — the decode populations, every head's vector and per-prompt residual under
  the lenses.
- :mod:`~mfpipe.experiments.fv.experiment` — one task end to end: selections, sweeps, held-out evaluation, decodes.
- :mod:`~mfpipe.experiments.fv.tables`, :mod:`~mfpipe.experiments.fv.analysis`,
  :mod:`~mfpipe.experiments.fv.details`, :mod:`~mfpipe.experiments.fv.figures` — Tables fv-matrix-body /
  fv-matrix, the head lists' recovery, the protocol tests and tallies, stability and categories, the clean-prompt
  table; Fig. fv and Fig. fv-clean.
- :mod:`~mfpipe.experiments.fv.jobs` — the jobs of workflow/rules/fv.smk, one function per rule;
  :mod:`~mfpipe.experiments.fv.rules` — its targets, input functions and each model's settings.
"""
