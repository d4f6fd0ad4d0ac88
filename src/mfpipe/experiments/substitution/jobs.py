"""The training sweep's jobs, one function per rule of workflow/rules/substitution.smk (run by
mfpipe.workflow.runner.run_job). Each imports what it runs inside its own body, so its code inputs are its own."""

from __future__ import annotations


def substitution(job) -> None:
    """Mean-field substitution of one (model, revision) (Sec. 5.1): every head's read at tracked query positions
    replaced by ẑ_sX from the statistics half, on held-out windows of the eval half ->
    results/substitution/<model>/<revision>/substitution.zarr (L_model, L_MF, ΔL, D_MF, per-head deviation)."""
    import time
    from pathlib import Path

    from mfpipe.experiments.substitution import substitute as SU
    from mfpipe.corpus.windows import eval_windows
    from mfpipe.workflow.context import open_forward_job
    from mfpipe.workflow.io import atomic_dir
    from mfpipe.workflow.numerics import numerics_info

    p, log = job.params, job.log
    fj = open_forward_job(job)
    name, revision, adapter, info = fj.name, fj.revision, fj.adapter, fj.corpus
    kernel = fj.kernel(int(p.min_count))
    tokens, _, used = eval_windows(fj.shards, n_tokens=int(p.eval_tokens))
    log.info("%s @ %s: substitution with %s (C >= %d) on %d eval windows x T=%d (%d tokens, shards %s)",
             name, revision, kernel.attrs["kernel"], int(p.min_count), tokens.shape[0], tokens.shape[1], tokens.size,
             ", ".join(used))
    t0 = time.perf_counter()
    sums = SU.substitution_pass(adapter, kernel, tokens, batch_size=int(p.batch_size), progress=True,
                                desc=f"substitution {name}@{revision}")
    dt = time.perf_counter() - t0
    ds = SU.substitution_result(sums, kernel.attrs, model=name, revision=revision, corpus=info, tokens=tokens,
                                shards=used)
    ds.attrs["numerics"] = numerics_info()
    with atomic_dir(Path(job.output[0])) as tmp:
        ds.to_zarr(tmp, mode="w", zarr_format=3, consolidated=False)
    s = sums.summary()
    log.info("L_model %.4f  L_MF %.4f  ΔL %.4f  D_MF %.4f  (%.1f%% of predictions substituted) in %.1f s",
             s["L_model"], s["L_MF"], s["delta_L"], s["D_MF"], 100 * s["substituted_share"], dt)


def substitution_topn(job) -> None:
    """App. M: :func:`substitution` with the top-n tracked set of an arm of ``substitution.top_n`` (always with W)."""
    substitution(job)


def substitution_table(job) -> None:
    """The training sweep of one model (Sec. 5.2): one row per revision of L_model, L_MF, ΔL, D_MF and coverage (CSV
    + Markdown), and the per-head deviation at every checkpoint (long CSV)."""
    from mfpipe.experiments.substitution import substitute as SU
    from mfpipe.workflow import tables as T

    p, out = job.params, job.output
    revisions, steps = list(p.revisions), [None if s is None else int(s) for s in p.steps]
    df = SU.sweep_table(list(job.input.results), revisions, steps, str(p.model))
    T.write_csv(df, out.csv)
    T.write_text(T.to_markdown(df, floatfmt="{:.4f}"), out.md)
    heads = SU.head_deviation_table(list(job.input.results), revisions, steps, str(p.model))
    T.write_csv(heads, out.heads)
    job.log.info("\n%s", T.to_markdown(df[["revision", "step", "L_model", "L_MF", "delta_L", "D_MF",
                                           "substituted_share"]], floatfmt="{:.4f}"))


def substitution_topn_table(job) -> None:
    """App. M: the sweep of every tracked-set size, one block of rows per size (``params.arms``: [N, revision, step]
    per result of input.results) -> CSV + Markdown."""
    from mfpipe.experiments.substitution import substitute as SU
    from mfpipe.workflow import tables as T

    p, out = job.params, job.output
    df = SU.topn_table(list(job.input.results), [tuple(a) for a in p.arms], str(p.model))
    T.write_csv(df, out.csv)
    T.write_text(T.to_markdown(df, floatfmt="{:.4f}"), out.md)
    job.log.info("\n%s", T.to_markdown(df[["n_tracked", "revision", "delta_L", "D_MF", "substituted_share"]],
                                       floatfmt="{:.4f}"))


def _training_json(job) -> str | None:
    """The mini model's training.json (input.training: [training.json] for a mini model, else []), or None."""
    training = getattr(job.input, "training", None) or []
    training = [training] if isinstance(training, str) else list(training)
    return training[0] if training else None


def _training_figure(job) -> None:
    """The training-waypoint figure of one model from its sweep table, or with params.kind = topn its top-N
    sensitivity, with the induction window shaded (configured, or from the mini model's recorded induction-score
    curve)."""
    from mfpipe.experiments.substitution import figures as F
    from mfpipe.models.induction import training_window

    p = job.params
    window = training_window(p.window, _training_json(job), tuple(p.band))
    job.log.info("induction window: %s", window)
    draw = F.topn_figure if getattr(p, "kind", "waypoint") == "topn" else F.waypoint_figure
    draw(job.input.table, job.output.pdf, job.output.png, window=window, title=str(p.title))


def figure_waypoint(job) -> None:
    """The training-waypoint figure (fig:mfgap) of one model from its sweep table (input.table), the induction window
    shaded (params.window, else from input.training; params.band) -> output.pdf / output.png, titled params.title."""
    _training_figure(job)


def figure_topn(job) -> None:
    """The top-N sensitivity figure (fig:vocab-robustness, params.kind = topn) of one model from its top-N table
    (input.table), the induction window shaded as in :func:`figure_waypoint`."""
    _training_figure(job)


def kernel_revision(job) -> None:
    """One checkpoint's kernel summary for the kernel dynamics (Sec. 5.3, App. N) -- the column-centred rank-r
    factors of W = P / nbar on the C >= min_count support and the row spread per head -- from its statistics store,
    as a labelled zarr store (written atomically) carrying the store's provenance.

    input.stats      the revision's statistics-half store (stats.zarr)
    output[0]        kernel.zarr (directory): factor (layer, head, query, rank), spread (layer, head), rank_energy,
                     support_size; attrs: the store's provenance + min_count, rank, support_fingerprint
    params.model, params.revision (checked against the store), params.min_count (20), params.rank (96)
    """
    import torch  # the factors' Gram products and eigendecompositions: on the job's threads, not torch's default

    from mfpipe.experiments.substitution.kernel_dynamics import kernel_dataset
    from mfpipe.stats import open_stats
    from mfpipe.stats.store import write_store

    torch.set_num_threads(int(job.threads))
    p = job.params
    model, revision = str(p.model), str(p.revision)
    stats = open_stats(job.input.stats, expect={"model": model, "revision": revision})
    ds = kernel_dataset(stats, min_count=int(p.min_count), rank=int(p.rank))
    write_store(ds, job.output[0])
    job.log.info("%s @ %s: kernel factors (L=%d, H=%d, N=%d, rank %d) on %d supported pairs; mean row spread %.3f, "
                 "rank-%d energy >= %.4f; wrote %s", model, revision, ds.sizes["layer"], ds.sizes["head"],
                 ds.sizes["query"], ds.attrs["rank"], ds.attrs["support_size"], float(ds["spread"].mean()),
                 ds.attrs["rank"], float(ds["rank_energy"].min()), job.output[0])


def kernel_dynamics(job) -> None:
    """Kernel dynamics of one model across its checkpoints (Sec. 5.3, App. N) -- linear CKA of W between every pair
    of checkpoints and between adjacent ones, the row spread per head -- as tables and the two figures (fig:cka,
    fig:spread), from the per-revision kernel stores of `kernel_revision`.

    input.kernels    the kernel.zarr of every revision, in revision order; input.training (optional): the mini
                     suite's training.json (its induction_curve gives the window when params.window is null)
    output.cka, output.adjacent (CSV: rev_a, rev_b, step_a, step_b, cka), output.spread (CSV: revision, step,
    layer, head, spread), output.cka_pdf, output.cka_png, output.spread_pdf, output.spread_png
    params.model, params.revisions (list), params.steps (list of int, same order), params.window (null or [start,
    stop])
    Refuses kernels of another model, tracked set, corpus sample, support or rank, or listed out of revision order.
    """
    from mfpipe.experiments.substitution.figures import cka_figure, spread_figure
    from mfpipe.experiments.substitution.kernel_dynamics import dynamics_tables, open_model_kernels
    from mfpipe.models.induction import training_window
    from mfpipe.workflow.tables import write_csv

    p, out = job.params, job.output
    model = str(p.model)
    revisions = [str(r) for r in p.revisions]
    steps = [int(s) for s in p.steps]
    datasets = open_model_kernels([str(k) for k in job.input.kernels], model, revisions, steps)
    matrix, cka, adjacent, spread = dynamics_tables(datasets, revisions, steps)
    # the same window as the waypoint figure: from config, else from the mini model's recorded induction curve
    band = tuple(getattr(p, "band", None) or (0.1, 0.8))
    window = training_window(getattr(p, "window", None), _training_json(job), band)
    write_csv(cka, out.cka)
    write_csv(adjacent, out.adjacent)
    write_csv(spread, out.spread)
    cka_figure(matrix, adjacent["cka"].to_numpy(), steps, out.cka_pdf, png=out.cka_png, window=window,
               title=f"{model}: how much the mean-field kernel W changes across training")
    spread_figure(spread, out.spread_pdf, png=out.spread_png, window=window,
                  title=f"{model}: how evenly each head divides its attention across token types")
    job.log.info("%s: %d checkpoints, adjacent CKA %s; induction window %s", model, len(revisions),
                 " ".join(f"{v:.3f}" for v in adjacent["cka"]), window)


def calibrate_kernel(job) -> None:
    """The bias of the context-conditional kernel Â and the calibrated kernel U of one (model, revision) (App. B:
    Table tab:ahat-empirical-bias, Alg. sinkhorn, Table tab:calib2M), from its statistics store and the shards of the
    half the store was measured on. U is written as a labelled zarr store (atomically) carrying the statistics
    store's provenance, so `mfpipe.meanfield.calibrated.load_calibrated(path, expect=...)` can check it.

    input.stats      the revision's statistics-half store; input.shards: that half's shard .npz files;
                     input.tracked: tracked.json (must be the store's tracked set)
    output.kernel    calibrated.zarr (directory): U (layer, head, query, key) float32, the store's coords and
                     provenance
    output.bias, output.bias_md          Table tab:ahat-empirical-bias per layer and "all" (CSV, Markdown)
    output.residuals, output.residuals_md  Table tab:calib2M per layer and iteration (CSV, Markdown)
    params.model, params.revision, params.min_count (20), params.iterations (5), params.alpha (1.0),
    params.batch_size; optional params.device ("cpu", "cuda", "auto"; default cpu) and params.dtype (of the passes;
    default float64)
    """
    import time

    import torch

    from mfpipe.corpus.tracked import TrackedSet
    from mfpipe.corpus.windows import read_shard
    from mfpipe.experiments.substitution.calibration import calibrate_stats, residual_markdown
    from mfpipe.meanfield.calibrated import calibrated_dataset, write_calibrated
    from mfpipe.stats import open_stats
    from mfpipe.workflow.tables import to_markdown, write_csv, write_text

    p, out, log = job.params, job.output, job.log
    model, revision = str(p.model), str(p.revision)
    if getattr(job.sm, "threads", None):
        torch.set_num_threads(int(job.threads))
    device = str(getattr(p, "device", "cpu") or "cpu")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, str(getattr(p, "dtype", None) or "float64"))  # of the passes; U is float64
    tracked = TrackedSet.load(job.input.tracked)
    stats = open_stats(job.input.stats, expect={"model": model, "revision": revision,
                                                "tracked_fingerprint": tracked.fingerprint})
    shards = sorted(str(s) for s in job.input.shards)
    tokens = [read_shard(s).tokens for s in shards]
    min_count, iterations = int(p.min_count), int(p.iterations)
    alpha, batch = float(p.alpha), int(p.batch_size)
    log.info("%s @ %s: calibrating W (min_count %d) over %d shards (%d windows), %d iterations, alpha %g, batch %d, "
             "%s, passes in %s", model, revision, min_count, len(shards), sum(t.shape[0] for t in tokens), iterations,
             alpha, batch, device, dtype)
    t0 = time.perf_counter()
    U, bias, res = calibrate_stats(stats, tokens, tracked, min_count=min_count, iterations=iterations, alpha=alpha,
                                   batch_size=batch, device=device, progress=True, log=log, dtype=dtype)
    for table in (bias, res):
        table.insert(0, "revision", revision)
        table.insert(0, "model", model)
    ds = calibrated_dataset(U, stats, {"min_count": min_count, "calibration_iterations": iterations,
                                       "calibration_dtype": str(dtype).replace("torch.", ""),
                                       "calibration_alpha": alpha, "calibration_shards": len(shards)})
    write_calibrated(ds, out.kernel)
    write_csv(bias, out.bias)
    write_text(f"### Bias of Â: {model} @ {revision}\n\n" + to_markdown(bias), out.bias_md)
    write_csv(res, out.residuals)
    write_text(residual_markdown(res, title=f"Calibration residuals: {model} @ {revision}"), out.residuals_md)
    allrow = bias[bias["layer"] == "all"].iloc[0]
    log.info("%s @ %s: E_s[N_X] %.3f, E_st[n_t] %.3f, ratio %.3f, %.1f%% of %d cells within 20%%, <bos> %.3f; "
             "wrote %s in %.0f s", model, revision, allrow["E_NX"], allrow["E_nt"], allrow["ratio"],
             100 * allrow["within_20pct"], allrow["n_cells"], allrow["bos_ratio"], out.kernel,
             time.perf_counter() - t0)


def calibrated_recompute(job) -> None:
    """App. B's recomputation with the calibrated kernel (sec:U2M) for one (model, revision): the head ranking, ΔL and
    D_MF, Exp. 1 and Exp. 2 with U beside W, from the outputs of the same jobs run once with each kernel -> one table
    (CSV + Markdown; mfpipe.experiments.substitution.recompute).

    input.w_deviation, input.u_deviation      pass 2's deviation stores (S̄ per head)
    input.w_substitution, input.u_substitution  the substitution results
    input.w_meter, input.u_meter              Exp. 1's one-row summaries (the icl_meter jobs' summary CSV)
    input.w_classes, input.u_classes          Exp. 2's class tables (the icl_classes jobs' table CSV)
    params.model, params.revision, params.top (k of the top-k overlap: min(top, heads))
    """
    import pandas as pd

    from mfpipe.deviation.store import open_deviation
    from mfpipe.experiments.substitution import recompute as RC
    from mfpipe.workflow.tables import write_csv, write_text

    p, inp, out, log = job.params, job.input, job.output, job.log
    model, revision = str(p.model), str(p.revision)
    expect = {"model": model, "revision": revision}
    arms = {}
    for arm in ("w", "u"):
        dev = open_deviation(getattr(inp, f"{arm}_deviation"), expect)
        sub = RC.open_substitution(getattr(inp, f"{arm}_substitution"), expect)
        for name, obj in (("deviation store", dev), ("substitution result", sub)):
            kernel = str(obj.attrs.get("kernel"))
            if (kernel == "W") != (arm == "w"):
                raise ValueError(f"the {arm.upper()} arm's {name} was computed with kernel {kernel!r}")
        arms[arm] = (dev["S_bar"].transpose("layer", "head").values, sub)
    (S_w, sub_w), (S_u, sub_u) = arms["w"], arms["u"]
    rows = RC.ranking_rows(S_w, S_u, top=int(p.top))
    rows += RC.substitution_rows(sub_w, sub_u)
    rows += RC.meter_rows(pd.read_csv(inp.w_meter), pd.read_csv(inp.u_meter))
    rows += RC.class_rows(pd.read_csv(inp.w_classes), pd.read_csv(inp.u_classes))
    df = RC.recompute_table(rows, model, revision)
    write_csv(df, out.csv)
    write_text(RC.recompute_markdown(df, title=f"Calibrated kernel U vs W: {model} @ {revision}"), out.md)
    log.info("%s @ %s:\n%s", model, revision, RC.recompute_markdown(df))


def figure_vocab_mfgap(job) -> None:
    """App. M fig:vocab-mfgap of one model: the waypoint (fig:mfgap's panels) at every tracked-set size N, from its
    top-N table (input.table), the induction window shaded as in :func:`figure_waypoint` -> output.pdf / output.png."""
    from mfpipe.experiments.substitution.figures import vocab_mfgap_figure
    from mfpipe.models.induction import training_window

    p = job.params
    window = training_window(p.window, _training_json(job), tuple(p.band))
    job.log.info("induction window: %s", window)
    vocab_mfgap_figure(job.input.table, job.output.pdf, job.output.png, window=window, title=str(p.title))
