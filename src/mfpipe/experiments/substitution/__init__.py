"""Mean-field substitution across training checkpoints (paper Sec. 5, App. B, M, N).

- :mod:`~mfpipe.experiments.substitution.substitute` — every head's read replaced by ẑ_sX: ΔL and D_MF per
  (model, revision), its result store and the sweep tables across checkpoints.
- :mod:`~mfpipe.experiments.substitution.calibration` — the bias of Â and the calibrated kernel U (App. B; its store is
  :mod:`mfpipe.meanfield.calibrated`, read by pass 2 too).
- :mod:`~mfpipe.experiments.substitution.recompute` — the body results recomputed with U beside W (App. B sec:U2M):
  the head ranking, ΔL and D_MF, Exp. 1 and Exp. 2 in one table.
- :mod:`~mfpipe.experiments.substitution.kernel_dynamics` — the kernel's change across checkpoints (Sec. 5.3, App. N).
- :mod:`~mfpipe.experiments.substitution.figures` — the waypoint, top-N, CKA and spread figures.
- :mod:`~mfpipe.experiments.substitution.jobs` — the jobs of workflow/rules/substitution.smk, one function per
  rule; :mod:`~mfpipe.experiments.substitution.rules` — its targets and input functions.
"""
