"""Prompt classes, the instance meter and the lenses (paper Sec. 6.1–6.2, App. O, P).

- :mod:`~mfpipe.experiments.prompts.sets` — the prompt classes of Exp. 2 and the repeated chunks of Exp. 1.
- :mod:`~mfpipe.experiments.prompts.classes` — deviation and ΔL_perm per prompt; the class and separation tables.
- :mod:`~mfpipe.experiments.prompts.meter` — Exp. 1's instance meter on ``[BOS; c; c]``.
- :mod:`~mfpipe.experiments.prompts.lenses` — top-deviation contexts and the vocabulary-space decode (App. P).
- :mod:`~mfpipe.experiments.prompts.rerun` — the lenses' re-run of the recorded windows: pass 2's per-context math
  and the deviation vectors' decodes.
- :mod:`~mfpipe.experiments.prompts.figures` — Fig. icl and Fig. icl-meter, drawn from the tables.
- :mod:`~mfpipe.experiments.prompts.jobs` — the jobs of workflow/rules/prompts.smk, one function per rule;
  :mod:`~mfpipe.experiments.prompts.rules` — its targets and inputs.
"""
