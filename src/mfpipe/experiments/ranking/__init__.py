"""Deviation and head ranking (paper Sec. 6.1 Exp. 3, Sec. 6.3, App. O): pass 2 over the statistics half, every
head's mean-field deviation split into covariance and contextualization terms, and the heads ranked by it.

- :mod:`~mfpipe.experiments.ranking.queries` — the per-context deviation terms at the query positions only.
- :mod:`~mfpipe.experiments.ranking.pass2` — the pass-2 reducer (additive sums per shard).
- :mod:`~mfpipe.experiments.ranking.deviation_pass` — pass 2 end to end: a shard's sums, the merge, the
  deviation store.
- :mod:`~mfpipe.experiments.ranking.store` — the deviation store's reader (no torch).
- :mod:`~mfpipe.experiments.ranking.head_scores` — behavioural head scores (induction, previous token, …).
- :mod:`~mfpipe.experiments.ranking.heads` — the ranking tables and their split-half stability.
- :mod:`~mfpipe.experiments.ranking.figures` — Exp. 3's correlation and the ccmf scatter.
"""
