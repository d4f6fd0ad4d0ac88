"""Models side by side (paper App. waypoint-olmo, fig:crossmodel): every model of a run on one training-token axis,
and one comparison row per model. It reads the other experiments' finished tables (by their columns; it imports no
other experiment).

- :mod:`mfpipe.experiments.crossmodel.compare` — the comparison table: rollout accuracy, ΔL and D_MF at the last
  revision and at their peak, the top heads by S̄ with their roles.
- :mod:`mfpipe.experiments.crossmodel.figures` — the cross-model waypoint figure.
- :mod:`mfpipe.experiments.crossmodel.rules` — its targets and what its rules read.
- :mod:`mfpipe.experiments.crossmodel.jobs` — the jobs of workflow/rules/crossmodel.smk, one function per rule.
"""
