"""Pass 2 (paper Sec. 6, App. O): every head's mean-field deviation over the statistics half, split into the
covariance and contextualization terms, with its top-deviation contexts; and the deviation store. Core, not an
experiment: the head ranking, the prompt experiments and the rollout's error accounting all read it.

- :mod:`~mfpipe.deviation.queries` — the per-context deviation terms at the query positions only.
- :mod:`~mfpipe.deviation.pass2` — the pass-2 reducer (additive sums per shard).
- :mod:`~mfpipe.deviation.shards` — pass 2 end to end: a shard's sums, its partial, the merge, the deviation store.
- :mod:`~mfpipe.deviation.store` — the deviation store's reader and its check against the statistics half (no torch).
- :mod:`~mfpipe.deviation.jobs` — the jobs of workflow/rules/deviation.smk, one function per rule;
  :mod:`~mfpipe.deviation.rules` — its targets and input functions.

This package imports none of its modules, so a job's code inputs stay the modules it uses.

Calling the package, ``mfpipe.deviation(model, stats, tokens)``, is the notebook API's per-context deviation
(:func:`mfpipe.notebook.analysis.deviation`): a function of that name could not sit beside the package in ``mfpipe``
(importing any module of the package binds ``mfpipe.deviation`` to it), so the package's module class is callable.
"""

import sys
import types


class _CallablePackage(types.ModuleType):
    def __call__(self, model, stats, tokens_or_texts, **kwargs):
        # through mfpipe's lazy export, not an import here: the notebook API sits above this package, and pass 2's
        # jobs must not depend on it (mfpipe.workflow.codedeps)
        return getattr(sys.modules["mfpipe"], "_notebook_deviation")(model, stats, tokens_or_texts, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
