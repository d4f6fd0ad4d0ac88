# Where the run's time went (issue 31): every rule writes Snakemake's benchmark file (wall time, peak RSS, CPU time)
# under logs/benchmarks/<rule>/; this rule, run after every other target, sums them by rule and by stage (the
# rule file that defines the rule) into results/tables/run_costs.{csv,md}, a report table too.


rule run_costs:
    input:
        # every target of `rule all` but this table: a job that may still be running when it sums would be missing
        # from it (the function-vector and cross-model figures were, in a CI run where they finished last)
        targets=every_target() + EXPLORER_TARGETS,
        code=job("workflow", "run_costs"),
    output:
        csv=table_report(f"{R}/tables/run_costs.csv", "run costs"),
        md=f"{R}/tables/run_costs.md",
    params:
        benchmarks="logs/benchmarks",
        # rule -> its stage, the rule file that defines it
        stages=lambda wc: {r.name: Path(r.snakefile).stem for r in workflow.rules},
    localrule: True
    conda:
        ENV
    benchmark:
        "logs/benchmarks/run_costs/tables/run_costs.tsv",
    log:
        "logs/tables/run_costs.log",
    script:
        JOB_SCRIPT
