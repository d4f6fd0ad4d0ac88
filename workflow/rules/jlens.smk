# The J-lens (paper App. P, Lens "vocabulary-space decode"; library mfpipe.jlens): per (model, revision) whose lenses
# are drawn, J_l = E[d h^L_t / d h^l_t], the average same-position Jacobian of the final residual with respect to
# the residual entering block l and to block l's attention output, over sampled positions of the statistics half.
# The lenses (prompts.smk) and the function-vector decodes read it.
#   snakemake --cores 2 results/jlens/mini-gpt2/final/jlens.zarr

JLENS = config["jlens"]


rule jlens:
    input:
        shards=f"{R}/corpus/{CORPUS}/{{model}}/shards",
        model=model_input,
        code=job("jlens", "jlens"),
    output:
        directory(STORE("jlens")),
    params:
        n_positions=JLENS["n_positions"],
        seed=JLENS["seed"],
        grad_chunk=JLENS["grad_chunk"],
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
