"""Snakemake script: where the run's time went, from every job's benchmark file -> run_costs.csv (by rule, with its
stage) and run_costs.md (by stage and by rule)."""
import _mfpipe_checkout  # noqa: F401,I001 (first: this checkout's src/ on sys.path)
from mfpipe.workflow.costs import cost_tables, costs_markdown, read_benchmarks
from mfpipe.workflow.runner import run_logged
from mfpipe.workflow.logs import setup_logging
from mfpipe.workflow.tables import write_table, write_text

sm = snakemake  # noqa: F821
log = setup_logging(sm.log[0])


def main() -> None:
    jobs = read_benchmarks(sm.params.benchmarks)
    by_rule, by_stage = cost_tables(jobs, dict(sm.params.stages))
    write_table(by_rule, csv=sm.output.csv)
    write_text(costs_markdown(by_rule, by_stage), sm.output.md)
    log.info("%d jobs, %.0f job-seconds; by stage:\n%s", len(jobs), jobs["wall_s"].sum(),
             by_stage[["stage", "jobs", "wall_s"]].to_string(index=False))


run_logged(main, log)
