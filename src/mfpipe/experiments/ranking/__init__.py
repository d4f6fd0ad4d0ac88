"""Head ranking (paper Sec. 6.1 Exp. 3, Sec. 6.3, App. O): the heads ranked by the mean-field deviation that pass 2
(:mod:`mfpipe.deviation`, core: the prompt and rollout experiments read it too) measured over the statistics half.

- :mod:`~mfpipe.experiments.ranking.head_scores` — behavioural head scores (induction, previous token, …).
- :mod:`~mfpipe.experiments.ranking.heads` — the ranking tables, their split-half stability and the heads' roles.
- :mod:`~mfpipe.experiments.ranking.roles` — each behavioural role's top heads and their place in the ranking.
- :mod:`~mfpipe.experiments.ranking.exp3` — Exp. 3's correlation across training (and at one revision), as a table.
- :mod:`~mfpipe.experiments.ranking.figures` — Exp. 3's figure and the ccmf scatter.
- :mod:`~mfpipe.experiments.ranking.jobs` — the jobs of workflow/rules/ranking.smk, one function per rule;
  :mod:`~mfpipe.experiments.ranking.rules` — its targets and input functions.
"""
