"""The mean field itself, shared by every experiment that runs the model (paper Sec. 3.2, Sec. 6, App. A).

- :mod:`mfpipe.meanfield.ccmf` — the context-conditional mean field ẑ_sX (eq:ctx-kernel, eq:ccmf) from a window's
  key buckets and a kernel, and the pair kernel Â of App. B.
- :mod:`mfpipe.meanfield.plan` — a batch's query rows laid out once (:func:`~mfpipe.meanfield.plan.query_plan`) and
  Â and ẑ at those rows per key type: the form the substitution and pass 2 run.
- :mod:`mfpipe.meanfield.kernel` — :class:`~mfpipe.meanfield.kernel.MeanFieldKernel`: W (or the calibrated U) and μ
  of a statistics half, ready to produce ẑ on the model's device (:func:`~mfpipe.meanfield.kernel.kernel_from_store`).
- :mod:`mfpipe.meanfield.calibrated` — the calibrated kernel U of App. B as a labelled store (written by the
  substitution experiment's calibration, read wherever a rule asks for ``kernel: calibrated``).
- :mod:`mfpipe.meanfield.deviation` — the deviation of a head's read from its mean field and its split into the
  covariance and contextualization terms (eq:deviation, eq:dev-decomp, eq:mcov-mctx), per occurrence and per corpus.
- :mod:`mfpipe.meanfield.forward` — the per-context deviation forward
  (:func:`~mfpipe.meanfield.forward.deviation_forward`): one traced forward of the model with the pass-2 meters of
  every head at every position (the prompt classes, the instance meter, the positional transport), and
  :func:`~mfpipe.meanfield.forward.kernel_for` (a kernel on the model's device).

This package imports none of its modules, so a job's code inputs stay the modules it uses.
"""
