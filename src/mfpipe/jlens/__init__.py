"""The J-lens of App. P (Lens "vocabulary-space decode"): the average same-position Jacobian of the final residual
with respect to a layer's residual, the readout the lenses and the function vectors decode through.

- :mod:`mfpipe.jlens.lens` — estimate it (:func:`~mfpipe.jlens.lens.estimate_jlens`), store it
  (:func:`~mfpipe.jlens.lens.write_jlens`), open it checked against its provenance
  (:func:`~mfpipe.jlens.lens.open_jlens`) and decode through it (:func:`~mfpipe.jlens.lens.jlens_decode`)
- :mod:`mfpipe.jlens.jvp` — the same decode without J, through Jacobian-vector products on the store's sampled
  positions (:class:`~mfpipe.jlens.jvp.JLensSample`, :func:`~mfpipe.jlens.jvp.lens_logits`)
- :mod:`mfpipe.jlens.checks` — the estimate's checks on its own position sample (split halves, nested prefixes) and
  the checks table of the job (:func:`~mfpipe.jlens.checks.checks_table`)
- :mod:`mfpipe.jlens.agreement` — where the raw logit lens and the J-lens agree, by layer
  (:func:`~mfpipe.jlens.agreement.decode_agreement`)
- :mod:`mfpipe.jlens.jobs` — the job of workflow/rules/jlens.smk (rule ``jlens``)
- :mod:`mfpipe.jlens.rules` — its planning (the checks tables the default target asks for; how each consumer decodes,
  config ``jlens.decode``)

This package imports none of its modules, so a job's code inputs stay the modules it uses.
"""
