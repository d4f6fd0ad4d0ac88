"""The corpus and its tracked type set, the first stage every experiment shares (paper Sec. 3.1, App. E).

- :mod:`mfpipe.corpus.documents` — a corpus's documents (the embedded plays, local files, ``datasets`` corpora) and
  their split into the ``stats`` / ``eval`` (/ ``train``) halves.
- :mod:`mfpipe.corpus.windows` — documents → BOS-led windows → fixed-size token shards, and reading them back.
- :mod:`mfpipe.corpus.tracked` — the tracked type set: the top-N token types by frequency on the ``stats`` half.
- :mod:`mfpipe.corpus.exclusion` — the exclusion arm's tracked set (App. llama): the same selection with newline /
  whitespace, punctuation and listed types skipped (config ``exclusion``; the arm's table is
  :mod:`mfpipe.experiments.rollout.exclusion`).
- :mod:`mfpipe.corpus.zipf` — the tokenizers' rank-frequency curves on the ``stats`` half and the tracked cutoff
  (``fig:zipf``).
- :mod:`mfpipe.corpus.rules` — the targets of workflow/rules/corpus.smk.
- :mod:`mfpipe.corpus.jobs` — the jobs of workflow/rules/corpus.smk (and the exclusion arm's tracked set of
  workflow/rules/exclusion.smk), one function per rule.

This package imports none of its modules, so a job's code inputs stay the modules it uses.
"""
