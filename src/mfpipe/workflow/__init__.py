"""The workflow's plumbing: what runs the science as Snakemake jobs, none of the science itself.

- :mod:`~mfpipe.workflow.config` — the config's JSON-schema validation and cross-checks.
- :mod:`~mfpipe.workflow.preflight` — the inputs checked when the DAG is built (architectures, files, hub commits).
- :mod:`~mfpipe.workflow.revisions` — revision names (``step<k>``) and the mini suite's checkpoints.
- :mod:`~mfpipe.workflow.codedeps` — each job script's library files, from its imports (the rules' code inputs).
- :mod:`~mfpipe.workflow.settings` — every rule's params by name as one more param (Snakemake compares their values
  as a set: a value swapped or equal to another's was no change).
- :mod:`~mfpipe.workflow.scheduling` — Snakemake's scheduler wake-ups, one pending at a time.
- :mod:`~mfpipe.workflow.runner` — how a rule's job runs: the job function found, handed the
  :class:`~mfpipe.workflow.runner.Job`, a failure reported in one line; a job's model load.
- :mod:`~mfpipe.workflow.plan` — the run's plan (models, revisions, corpora, shards) that every slice plans on.
- :mod:`~mfpipe.workflow.paths` — where every store lives, spelt once (the rules and the reading API take it).
- :mod:`~mfpipe.workflow.context` — :class:`~mfpipe.workflow.context.ForwardJob`: what a forward-pass job starts
  from (tracked set, statistics half, the model checked against it, the kernel).
- :mod:`~mfpipe.workflow.logs` — a job's log file.
- :mod:`~mfpipe.workflow.heap` — the C allocator's settings for a job.
- :mod:`~mfpipe.workflow.numerics` — pinned CPU numerics (the same bits on every machine) and their record.
- :mod:`~mfpipe.workflow.io` — atomic files and folders (no half-written output).
- :mod:`~mfpipe.workflow.tables` — tables written as CSV and Markdown.
- :mod:`~mfpipe.workflow.plots` — figures written as PDF and PNG.
- :mod:`~mfpipe.workflow.costs` — where a run's time went (the benchmark files summed).
- :mod:`~mfpipe.workflow.jobs` — the workflow's own job: the run's cost table (rule ``run_costs``).

This package imports none of its modules: a job script imports ``mfpipe.workflow.heap`` first of all, and a job's
code inputs stay the modules it uses.
"""
