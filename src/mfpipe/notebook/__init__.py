"""mfpipe in a notebook: statistics, the mean field, substitution and per-context deviation of a model already in
memory (a ``transformers`` causal LM or an nnsight ``TransformersModel``; the ``LanguageModel`` nnsight 0.8
deprecates is taken too), without the workflow. Exported by the package:
``mfpipe.collect_stats``, ``mfpipe.mean_field``, ``mfpipe.substitute``, ``mfpipe.context_deviation``, ``mfpipe.decode``
(each loaded on first use). Every function runs the pipeline's own code on the windows it is given, and returns
labelled xarray with provenance.

- :mod:`~mfpipe.notebook.inputs` — the model, tokenizer, windows and statistics a call takes, checked once
  (:class:`~mfpipe.notebook.inputs.NotebookError`).
- :mod:`~mfpipe.notebook.identity` — fingerprints of a model's weights and of a tokenizer, recorded by
  ``collect_stats`` and checked by every call that takes statistics, a J-lens store or a vector.
- :mod:`~mfpipe.notebook.stats` — :func:`~mfpipe.notebook.stats.collect_stats`, pass 1 in memory.
- :mod:`~mfpipe.notebook.meanfield` — :func:`~mfpipe.notebook.meanfield.mean_field`: W, μ and ẑ (eq:ccmf).
- :mod:`~mfpipe.notebook.analysis` — :func:`~mfpipe.notebook.analysis.substitute`,
  :func:`~mfpipe.notebook.analysis.context_deviation`, :func:`~mfpipe.notebook.analysis.decode`.

This package imports none of its modules.
"""
