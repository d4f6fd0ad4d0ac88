"""`mfpipe estimate`: what a config's run will cost, before it starts (issue 49).

- :mod:`~mfpipe.estimate.jobs` — the config, the corpus halves' predicted sizes and every job of Snakemake's dry run.
- :mod:`~mfpipe.estimate.calibrate` — a few batches of each pass of one model at its real shape on this device.
- :mod:`~mfpipe.estimate.timing` — the calibration's timed work: the passes, the stores, the kernels, the J-lens.
- :mod:`~mfpipe.estimate.weights` — a model streamed one block at a time: one block's memory, its blocks' reads.
- :mod:`~mfpipe.estimate.costs` — the cost model: each job's seconds, peak memory and disk from the calibration.
- :mod:`~mfpipe.estimate.prompts` — the prices of the jobs on prompts and sampled positions: head scores, J-lens,
  lenses, the ICL classes and meter, function vectors.
- :mod:`~mfpipe.estimate.corpus_memory` — the corpus stage's memory: the corpus job's own code run at two budgets.
- :mod:`~mfpipe.estimate.slices` — the prices of the positional slice, the token counts and the start-up-only jobs.
- :mod:`~mfpipe.estimate.notes` — what the numbers are not: the device measured, the unpriced rules and corpora, the
  knobs of a job that does not fit.
- :mod:`~mfpipe.estimate.report` — the console command: the plan, the calibrations, the tables and what will not fit.
"""
