"""The workflow's own job, the one rule of workflow/rules/costs.smk (run by mfpipe.workflow.runner.run_job). It
imports what it runs inside its own body, so its code inputs are its own."""

from __future__ import annotations


def run_costs(job) -> None:
    """Where the run's time went, from every job's benchmark file -> run_costs.csv (by rule, with its stage) and
    run_costs.md (by stage and by rule) (mfpipe.workflow.costs).

    input.targets     every target of `rule all` but this table (so it sums once they are made)
    output.csv, output.md   the tables
    params.benchmarks the benchmark folder (logs/benchmarks); params.stages {rule: its stage, the rule file}
    """
    from mfpipe.workflow.costs import cost_tables, costs_markdown, read_benchmarks
    from mfpipe.workflow.tables import write_table, write_text

    jobs = read_benchmarks(job.params.benchmarks)
    by_rule, by_stage = cost_tables(jobs, dict(job.params.stages))
    write_table(by_rule, csv=job.output.csv)
    write_text(costs_markdown(by_rule, by_stage), job.output.md)
    job.log.info("%d jobs, %.0f job-seconds; by stage:\n%s", len(jobs), jobs["wall_s"].sum(),
                 by_stage[["stage", "jobs", "wall_s"]].to_string(index=False))
