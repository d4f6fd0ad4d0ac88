"""The models mfpipe analyses, shared by every experiment.

- :mod:`mfpipe.models.loader` — one loader for a hub name + ``revision`` (resolved to a commit), a local folder or a
  mini-suite checkpoint, and its tokenizer.
- :mod:`mfpipe.models.streamed` — a model too large for the memory loaded to run one block at a time
  (``runtime.stream_weights``): built on the meta device, each block's weights read from its safetensors files as the
  block runs (:mod:`mfpipe.models.adapters.streaming`).
- :mod:`mfpipe.models.adapters` — the adapter, built on where a model keeps its pieces (placed by structure, not by
  name): the one place that knows module paths, with the read/patch site every corpus pass and intervention goes
  through.
- :mod:`mfpipe.models.tiny` — tiny random models: the recipes of the verified architectures and a shrunk copy of
  any config (the test suite's models and the conformance command's).
- :mod:`mfpipe.models.shrink` — the shrunk copy of any decoder's config (re-exported by ``tiny``): sizes shrunk by
  what each field is, per-layer fields cut to the same layers with every kind kept, derived fields derived again.
- :mod:`mfpipe.models.defaults` — configs built through transformers' strict validators: a default config its own
  validator refuses, a shrunk one refused for a value the validator names.
- :mod:`mfpipe.models.census` — ``mfpipe census``: every causal-LM family of the installed transformers, placed
  and checked on a tiny copy of its default config, as one table (docs/architectures.md).
- :mod:`mfpipe.models.induction` — induction-head scores on repeated random sequences (TransformerLens convention)
  and the probes the head scores share.

This package imports none of its modules.
"""
