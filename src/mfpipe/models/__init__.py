"""The models mfpipe analyses, shared by every experiment.

- :mod:`mfpipe.models.loader` — one loader for a hub name + ``revision`` (resolved to a commit), a local folder or a
  mini-suite checkpoint, and its tokenizer.
- :mod:`mfpipe.models.adapters` — the per-architecture adapters: the one place that knows module paths, with the
  read/patch site every corpus pass and intervention goes through.
- :mod:`mfpipe.models.induction` — induction-head scores on repeated random sequences (TransformerLens convention)
  and the probes the head scores share.

This package imports none of its modules.
"""
