"""The rollout stage's jobs, one function per rule of workflow/rules/rollout.smk (run by
mfpipe.workflow.runner.run_job; the figure rules, made in a loop, share :func:`plot_figure` through
``params.job_function``). Each imports what it runs inside its own body, so its code inputs are its own."""

from __future__ import annotations


def rollout_scores(job) -> None:
    """Alg. 1 with every configured kernel for one (model, revision), scored per depth against the held-out
    centroids -> results/rollout/<model>/<revision>/scores.csv (long table)."""
    import time

    from mfpipe.experiments.rollout import runs as RO
    from mfpipe.experiments.rollout import tables as RT
    from mfpipe.workflow import tables as T

    p, log = job.params, job.log
    model, adapter = job.model()
    t0 = time.perf_counter()
    df = RO.run_rollouts(model, adapter, job.input.stats, job.input.eval, kernels=list(p.kernels), seed=int(p.seed),
                         pin=bool(p.pin_rogue), rogue_factor=float(p.rogue_factor), init=str(p.init),
                         min_count=int(p.min_count), model_name=p.model_spec["name"], revision=p.revision)
    log.info("%d kernels%s in %.1f s", len(p.kernels), " (+ pinned)" if p.pin_rogue else "", time.perf_counter() - t0)
    T.write_csv(df, job.output[0])
    log.info("\n%s", RT.summary_markdown(RT.rollout_summary(df)))


def rollout_table(job) -> None:
    """Table 1 (cross-layer mean and SE over layers per kernel) from one rollout's scores."""
    import pandas as pd

    from mfpipe.experiments.rollout import tables as RT
    from mfpipe.workflow import tables as T

    summary = RT.rollout_summary(pd.read_csv(job.input.scores))
    T.write_csv(summary, job.output.csv)
    md = RT.summary_markdown(summary, title=f"Rollout fidelity: {job.wildcards.model} @ {job.wildcards.revision}")
    T.write_text(md, job.output.md)
    job.log.info("\n%s", md)


def error_accounting(job) -> None:
    """The error accounting of Sec. 4.3 and App. D, H, K for one (model, revision): teacher-forced attention, the
    nested estimators (a)(b)(c), the MLP gap, within-type clustering with the value-map Jensen gap, and anisotropy
    -> one CSV (+ Markdown) each under results/tables/."""
    from mfpipe.deviation.store import open_deviation
    from mfpipe.experiments.rollout import accounting as AC
    from mfpipe.experiments.rollout import runs as RO
    from mfpipe.experiments.rollout import tables as RT
    from mfpipe.stats import halves as S
    from mfpipe.workflow import tables as T

    p, out, log = job.params, job.output, job.log
    tag = f"{p.model_spec['name']} @ {p.revision}"
    st, ev = S.open_pair(job.input.stats, job.input.eval, model=p.model_spec["name"], revision=p.revision)
    model, adapter = job.model()  # after the stores: a foreign store is refused before the weights are read
    setup = RO.prepare(adapter, st, ev, min_count=int(p.min_count))
    diag = ev if p.diagnostics_half == "eval" else st

    tf = AC.teacher_forced_table(adapter, setup)
    T.write_csv(tf, out.teacher_forced)
    T.write_text(RT.wide_markdown(RT.long_to_wide(tf, "layer"), "layer", ["frac_depth", "cosine", "rsa", "rel_error",
                 "norm_ratio"], title=f"Teacher-forced attention (sum_h zhat vs measured sum_h zbar): {tag}"),
                 out.teacher_forced_md)

    ed = AC.error_decomposition_table(adapter, setup, open_deviation(job.input.deviation, {
        "model": p.model_spec["name"], "revision": str(p.revision)}))
    T.write_csv(ed, out.error_decomposition)
    T.write_text(RT.error_decomposition_markdown(ed, tag), out.error_decomposition_md)

    mg = AC.mlp_gap_table(adapter, diag, min_count=int(p.min_count))
    T.write_csv(mg, out.mlp_gap)
    T.write_text(RT.wide_markdown(mg, "layer", ["cosine", "rel_error", "rsa", "norm_ratio"],
                                  title=f"MLP gap (MLP at the mean input vs occurrence-mean MLP), {p.diagnostics_half} "
                                        f"half: {tag}"), out.mlp_gap_md)

    cl = AC.clustering_table(adapter, diag, min_count=int(p.min_count))
    T.write_csv(cl, out.clustering)
    T.write_text(RT.wide_markdown(cl, "depth", ["rel_rms_median", "eta2", "eta2_z", "jensen_rel_median",
                                                "jensen_dir_median"], digits=4,
                                  title=f"Within-type clustering and value-map Jensen gap, {p.diagnostics_half} half: "
                                        f"{tag}"), out.clustering_md)

    an = AC.anisotropy_table(diag, min_count=int(p.min_count))
    T.write_csv(an, out.anisotropy)
    T.write_text(RT.wide_markdown(an, "depth", ["norm_mean", "mean_dist", "ratio"],
                                  title=f"Anisotropy of the type-centroid cloud, {p.diagnostics_half} half: {tag}"),
                 out.anisotropy_md)
    log.info("teacher-forced:\n%s", RT.long_to_wide(tf, "layer").to_string())
    log.info("error decomposition:\n%s", RT.long_to_wide(ed, "layer", by="estimator").to_string())


def attention_coverage(job) -> None:
    """App. F attention-mass coverage (tracked / position 0 / other, tracked share of non-sink attention) from each
    model's statistics-half kernel P."""
    from mfpipe.experiments.rollout import accounting as AC
    from mfpipe.workflow import tables as T
    from mfpipe.workflow.tables import to_markdown

    df = AC.attention_coverage(list(job.input.stats), expect={"half": "stats"})
    T.write_csv(df, job.output.csv)
    md = "**Attention-mass coverage (App. F): mean over layers, heads and tracked query types**\n\n" + to_markdown(df)
    T.write_text(md, job.output.md)
    job.log.info("\n%s", md)


def cross_corpus(job) -> None:
    """App. G cross-corpus matrix for one (model, revision): the mean-field rollout with each corpus's statistics
    scored against each corpus's held-out centroids (+ the context-free baseline)."""
    from mfpipe.experiments.rollout import runs as RO
    from mfpipe.experiments.rollout import tables as RT
    from mfpipe.workflow import tables as T

    p, out = job.params, job.output
    model, adapter = job.model()
    stats, evals = list(job.input.stats), list(job.input.eval)
    corpora = {c: (s, e) for c, s, e in zip(p.corpora, stats, evals)}
    df = RO.cross_corpus(model, adapter, corpora, p.primary, init=str(p.init), min_count=int(p.min_count),
                         model_name=p.model_spec["name"], revision=p.revision)
    T.write_csv(df, out.scores)
    summary = RT.cross_corpus_summary(df)
    T.write_csv(summary, out.csv)
    tag = f"{p.model_spec['name']} @ {p.revision}"
    md = RT.matrix_markdown(summary, "cosine", title=f"Cross-corpus matrix, centered cosine: {tag}")
    md += "\n" + RT.matrix_markdown(summary, "rel_error", title=f"Cross-corpus matrix, centered rel. error: {tag}")
    T.write_text(md, out.md)
    job.log.info("\n%s", md)


def rollout_divergence(job) -> None:
    """The divergence diagnostics of App. llama for one (model, revision): the configured kernel's rollout
    (``rollout.divergence``) and the held-out truth tracked together -> the per-step amplification (+ Markdown of every
    table), the curvature test, the MLP units, per-token amplification and the most amplified types, the centred
    magnitude and the capitalisation pairs, one CSV each under results/tables/."""
    from mfpipe.experiments.rollout import divergence as DV
    from mfpipe.experiments.rollout import runs as RO
    from mfpipe.experiments.rollout.runs import build_kernel, pinning
    from mfpipe.stats import halves as S
    from mfpipe.workflow import tables as T

    p, out, log = job.params, job.output, job.log
    cfg = p.divergence
    st, ev = S.open_pair(job.input.stats, job.input.eval, model=p.model_spec["name"], revision=p.revision)
    model, adapter = job.model()  # after the stores: a foreign store is refused before the weights are read
    setup = RO.prepare(adapter, st, ev, init=str(p.init), min_count=int(p.min_count))
    kernel = build_kernel(cfg["kernel"], setup, model=model, seed=int(p.seed))
    pin = pinning(setup, float(p.rogue_factor)) if cfg["pin"] else None
    if pin is not None and not pin[0].size:
        log.warning("divergence.pin: no rogue dimension at factor %g; the rollout is unpinned", p.rogue_factor)
        pin = None
    tables = DV.run(adapter, setup, kernel, alphas=tuple(cfg["alphas"]), top_k=int(cfg["top_k"]),
                    n_random=int(cfg["n_random"]), seed=int(cfg["seed"]), pin=pin, n_top=int(cfg["n_top"]))
    for key in ("steps", "curvature", "units", "tokens", "top_tokens", "magnitude", "pairs", "pairs_summary"):
        T.write_csv(tables[key], out[key])
    md = DV.markdown(tables, f"Rollout divergence ({cfg['kernel']}{', pinned' if pin else ''}): "
                             f"{p.model_spec['name']} @ {p.revision}")
    T.write_text(md, out.md)
    log.info("headline: %s\n%s", DV.headline(tables), md)


def rollout_localized(job) -> None:
    """Where the kernel matters, for one (model, revision): the layer-localized substitution (tab:qwen-layers), the
    rogue dimensions (tab:rogue-dims) and every kernel unpinned vs pinned (tab:qwen-pinned) -> CSV + Markdown each."""
    from mfpipe.experiments.rollout import localized as LZ
    from mfpipe.experiments.rollout import runs as RO
    from mfpipe.experiments.rollout.runs import pinning
    from mfpipe.stats import halves as S
    from mfpipe.workflow import tables as T
    from mfpipe.workflow.tables import to_markdown

    p, out, log = job.params, job.output, job.log
    cfg, tag = p.localized, f"{p.model_spec['name']} @ {p.revision}"
    st, ev = S.open_pair(job.input.stats, job.input.eval, model=p.model_spec["name"], revision=p.revision)
    model, adapter = job.model()
    setup = RO.prepare(adapter, st, ev, init=str(p.init), min_count=int(p.min_count))
    pin = pinning(setup, float(p.rogue_factor)) if cfg["pin"] else None
    pin = pin if pin is not None and pin[0].size else None  # asked, but no dimension above the factor: unpinned
    lz = LZ.localized_table(adapter, setup, cfg["substitute"], cfg["layers"], pin=pin, seed=int(p.seed), model=model)
    rg = LZ.rogue_table(setup.stats_centroids[:, st.query_count().values > 0], float(p.rogue_factor))
    pt = LZ.pinning_table(model, adapter, setup, list(p.kernels), float(p.rogue_factor), seed=int(p.seed))
    pinned = ", pinned" if pin is not None else "; pinning asked, no dimension above the factor" if cfg["pin"] else ""
    for key, df, title in (
            ("localized", lz, f"Layer-localized substitution ({cfg['substitute']} on the listed layers, P elsewhere"
                              f"{pinned}): {tag}"),
            ("rogue", rg, f"Rogue dimensions (RMS over the type centroids / the depth's median; pinned above "
                          f"{p.rogue_factor:g}x): {tag}"),
            ("pinning", pt, f"Every kernel's rollout unpinned vs pinned (factor {p.rogue_factor:g}): {tag}")):
        T.write_csv(df, out[key])
        md = f"**{title}**\n\n" + to_markdown(df.round(4))
        T.write_text(md, out[f"{key}_md"])
        log.info("\n%s", md)


def figure_divergence(job) -> None:
    """The divergence figure (PDF + PNG) from the divergence tables (steps, curvature, tokens, magnitude)."""
    from mfpipe.experiments.rollout import figures as F

    i = job.input
    F.divergence_figure(i.steps, i.curvature, i.tokens, i.magnitude, job.output.pdf, job.output.png,
                        title=job.params.title)
    job.log.info("wrote %s and %s", job.output.pdf, job.output.png)


def plot_figure(job) -> None:
    """One rollout figure (PDF + PNG) from its result table (input.table); ``params.kind`` names the figure function
    (the rules figure_<kind>, made in a loop over mfpipe.experiments.rollout.rules.figures), params.title its title."""
    from mfpipe.experiments.rollout import figures as F

    funcs = {
        "rollout": F.rollout_figure,
        "teacher_forced": F.teacher_forced_figure,
        "error_decomposition": F.error_decomposition_figure,
        "clustering": F.clustering_figure,
        "cross_corpus": F.cross_corpus_figure,
        "curves": F.curves_figure,
    }
    fn = funcs[job.params.kind]
    fn(job.input.table, job.output.pdf, job.output.png, title=job.params.title)
    job.log.info("wrote %s and %s", job.output.pdf, job.output.png)


def exclusion_rollout(job) -> None:
    """The exclusion arm beside the main set for one (model, revision): the mean-field rollout, the teacher-forced
    accuracy, the peak centred-magnitude ratio and the divergence diagnostics' headline (params.divergence: config
    rollout.divergence, with params.seed and params.rogue_factor) on each arm's stores ->
    results/tables/exclusion_<model>_<revision>.{csv,md} (mfpipe.experiments.rollout.exclusion.side_by_side)."""
    from mfpipe.corpus.tracked import TrackedSet
    from mfpipe.experiments.rollout import exclusion as EX
    from mfpipe.experiments.rollout import runs as RO
    from mfpipe.stats import halves as S
    from mfpipe.workflow import tables as T

    p, i, log = job.params, job.input, job.log
    name, rev = p.model_spec["name"], str(p.revision)
    pairs = {arm: S.open_pair(s, e, model=name, revision=rev)
             for arm, s, e in (("main", i.stats, i.eval), ("exclusion", i.excl_stats, i.excl_eval))}
    model, adapter = job.model()  # after the stores: a foreign store is refused before the weights are read
    diagnose = EX.divergence_headline(adapter, model, dict(p.divergence), int(p.seed), float(p.rogue_factor))
    rows = {}
    for arm, (st, ev) in pairs.items():
        setup = RO.prepare(adapter, st, ev, init=str(p.init), min_count=int(p.min_count))
        rows[arm] = EX.arm_summary(adapter, setup, diagnose)
        log.info("%s arm: %s", arm, rows[arm])
    df = EX.side_by_side(rows["main"], rows["exclusion"], TrackedSet.load(i.tracked_excl).meta)
    T.write_csv(df, job.output.csv)
    md = EX.side_by_side_markdown(df, f"Exclusion arm beside the main tracked set: {name} @ {rev}")
    T.write_text(md, job.output.md)
    log.info("\n%s", md)
