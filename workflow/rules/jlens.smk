# The J-lens (paper App. P, Lens "vocabulary-space decode"; library mfpipe.jlens): per (model, revision) whose lenses
# are drawn, J_l = E[d h^L_t / d h^l_t], the average same-position Jacobian of the final residual with respect to
# the residual entering block l and to block l's attention output, over sampled positions of the statistics half.
# The lenses (prompts.smk) and the function-vector decodes read it. The same job writes its checks table (mfpipe.jlens.checks,
# mfpipe.jlens.agreement): per (point, layer) the split-half and nested-prefix differences of J and the raw / J-lens
# decode agreement; the default target asks for it at every rollout revision (mfpipe.jlens.rules).
#   snakemake --cores 2 results/jlens/mini-gpt2/final/jlens.zarr
#   snakemake --cores 2 results/tables/jlens_checks_mini-gpt2_final.md

JLENS = config["jlens"]


rule jlens:
    input:
        shards=f"{R}/corpus/{CORPUS}/{{model}}/shards",
        model=model_input,
        code=job("jlens", "jlens"),
    output:
        directory(STORE("jlens")),
        table=table_report(f"{R}/tables/jlens_checks_{{model}}_{{revision}}.csv", "J-lens checks"),
        md=f"{R}/tables/jlens_checks_{{model}}_{{revision}}.md",
    params:
        n_positions=JLENS["n_positions"],
        seed=JLENS["seed"],
        grad_chunk=JLENS["grad_chunk"],
        check_rows=JLENS["check_rows"],
        sum_dtype=JLENS["sum_dtype"],
        n_decode=JLENS["n_decode"],
        batch_size=JLENS["batch_size"] or config["runtime"]["batch_size"],
        **model_params(),
    threads: model_threads
    resources:
        **cluster_resources("forward"),
    conda:
        ENV
    benchmark:
        "logs/benchmarks/jlens/jlens/{model}/{revision}.tsv",
    log:
        "logs/jlens/{model}/{revision}.log",
    script:
        JOB_SCRIPT
