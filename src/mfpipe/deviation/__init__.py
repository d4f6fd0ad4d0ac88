"""Pass 2 (paper Sec. 6, App. O): every head's mean-field deviation over the statistics half, split into the
covariance and contextualization terms, with its top-deviation contexts; and the deviation store. Core, not an
experiment: the head ranking, the prompt experiments and the rollout's error accounting all read it.

- :mod:`~mfpipe.deviation.queries` — the per-context deviation terms at the query positions only.
- :mod:`~mfpipe.deviation.pass2` — the pass-2 reducer (additive sums per shard).
- :mod:`~mfpipe.deviation.shards` — pass 2 end to end: a shard's sums, its partial, the merge, the deviation store.
- :mod:`~mfpipe.deviation.store` — the deviation store's reader and its check against the statistics half (no torch).
- :mod:`~mfpipe.deviation.jobs` — the jobs of workflow/rules/deviation.smk, one function per rule;
  :mod:`~mfpipe.deviation.rules` — its targets and input functions.
- :mod:`~mfpipe.deviation.contexts` — pass 2's per-context meters kept per position (not summed), for the notebook
  API's :func:`mfpipe.context_deviation`, which sits above this package and is reached from here by nothing.

This package imports none of its modules, so a job's code inputs stay the modules it uses.
"""
