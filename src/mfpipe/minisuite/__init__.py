"""Offline "mini model suite": a byte-level BPE tokenizer and tiny GPT-2 / GPT-NeoX models
trained on CPU on the embedded corpus, with log-spaced HF checkpoints (a miniature Pythia suite).

- :mod:`mfpipe.minisuite.tokenizer` — :func:`~mfpipe.minisuite.tokenizer.train_tokenizer`, the suite's BPE tokenizer
- :mod:`mfpipe.minisuite.data` — the training rows (the document stream; ``[BOS, text…]``, repeated-chunk and
  few-shot rows)
- :mod:`mfpipe.minisuite.tasks` — the few-shot tasks the suite learns (fixed random mappings of its own vocabulary)
  and their few-shot / zero-shot accuracy
- :mod:`mfpipe.minisuite.model` — :func:`~mfpipe.minisuite.model.build_model` from a recipe
- :mod:`mfpipe.minisuite.train` — :func:`~mfpipe.minisuite.train.train_mini_model`, with checkpoints at
  :func:`mfpipe.workflow.revisions.checkpoint_steps`
- :mod:`mfpipe.minisuite.rules` — the targets and input functions of workflow/rules/minisuite.smk
- :mod:`mfpipe.minisuite.jobs` — the jobs of workflow/rules/minisuite.smk, one function per rule

This package imports none of its modules, so a job's code inputs stay the modules it uses (and the workflow reads
its planning without importing torch).
"""
