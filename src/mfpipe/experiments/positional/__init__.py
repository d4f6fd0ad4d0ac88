"""Positional transport (paper App. positional: layer-1 heads re-encoding the query's position) and the lens survey's
repeated-text and type-class readings (App. protocol, App. readings).

- :mod:`~mfpipe.experiments.positional.collect` — query occurrences of the eval half in one forward per batch (the
  within-type write deviation Δ = z − z̄_s, the deviation D, the attention on BOS, the attended-key offset, the
  share on untracked keys); the repeated-text condition; the type class's tracked types.
- :mod:`~mfpipe.experiments.positional.stream` — the job's occurrences streamed in two passes (issue 58): per-position
  sums and scatters of Δ for every head's posVar and W_pos share, per-fold moments for the decode; Δ never held.
- :mod:`~mfpipe.experiments.positional.cells` — the cluster's readings, curves and S from the second pass's sums per
  (position, offset bin) cell of the cluster's heads.
- :mod:`~mfpipe.experiments.positional.fits` — posVar, the W_pos share, the position decode, principal angles and
  the other regressions and subspace measures, on arrays.
- :mod:`~mfpipe.experiments.positional.analysis` — every head's readings, the positional cluster and its carriers,
  the cluster's readings (what is moved, the BOS gate, magnification, geometry) and the ablation's subspace S.
- :mod:`~mfpipe.experiments.positional.readings` — natural against repeated text, the type-class test.
- :mod:`~mfpipe.experiments.positional.ablation` — the dereferencing ablation through the site's ``patch_out``, its
  controls, the token categories.
- :mod:`~mfpipe.experiments.positional.tables`, :mod:`~mfpipe.experiments.positional.figures` — the tables and Fig.
  positional.
- :mod:`~mfpipe.experiments.positional.jobs` — the jobs of workflow/rules/positional.smk, one function per rule;
  :mod:`~mfpipe.experiments.positional.rules` — its targets and input functions.
"""
