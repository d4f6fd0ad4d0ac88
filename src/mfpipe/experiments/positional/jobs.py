"""The positional slice's jobs, one function per rule of workflow/rules/positional.smk (run by
mfpipe.workflow.runner.run_job). Each imports what it runs inside its own body, so its code inputs are its own."""

from __future__ import annotations


def _load(job):
    """The forward job, its eval-half windows (enough for the natural sample's token budget, the repeated sequences
    and the ablation's windows) and the model's pieces: (fj, windows, O [L,H,dh,d], W_pos or None)."""
    import numpy as np

    from mfpipe.corpus.windows import eval_windows
    from mfpipe.workflow.context import open_forward_job

    fj = open_forward_job(job)
    c = job.params.positional
    T = int(fj.corpus["context_length"])
    n = max(-(-int(c["tokens"]) // T), int(c["ablation_windows"]), int(c["repeated"]["n_sequences"]))
    windows = eval_windows(fj.shards, n_windows=n)[0]
    ad = fj.adapter
    # float32 holds the weights exactly (every use widens a head's slice to float64): half of a float64 O, 8.4 GB at
    # Qwen3-14B's shape
    O = np.stack([ad.out_proj_slices(l).detach().float().cpu().numpy() for l in range(ad.n_layers)])
    W = ad.position_table()
    W_pos = None if W is None else W.detach().double().cpu().numpy()[: windows.shape[1]]
    return fj, windows, O, W_pos


def positional(job) -> None:
    """App. positional for one (model, revision): query occurrences of the eval half (Δ = z − z̄_s, D, a(p), offsets),
    every head's posVar and (W_pos models) code share and decode, the positional cluster's readings, the repeated-text
    condition and the type-class test -> the tables, the figure's curves and the ablation's subspace S.

    input.stats, shards, tracked, model   as every forward job; input.deviation: the revision's deviation store (S̄,
                                           per-type D for the class test)
    output.heads / heads_md                the positional table (every head; the cluster's readings in the Markdown)
    output.cluster, overlaps, curves       the cluster's rows, pairwise overlaps, the figure's curves (CSV)
    output.classes / classes_md            the type-class test; output.repeated / repeated_md: natural vs repeated
    output.subspace                        S, the carriers and the cluster (npz) for the ablation job
    params.positional                      the config section (mfpipe.experiments.positional.analysis.DEFAULTS)"""
    import json

    import numpy as np
    import torch

    from mfpipe.deviation.store import open_deviation
    from mfpipe.experiments.positional import cells as Ce
    from mfpipe.experiments.positional import collect as C
    from mfpipe.experiments.positional import stream as Sm
    from mfpipe.experiments.positional import tables as Tb
    from mfpipe.workflow.io import atomic_savez, atomic_write_text
    from mfpipe.workflow.tables import write_table

    p, out, log = job.params, job.output, job.log
    cfg = dict(p.positional)
    fj, windows, O, W_pos = _load(job)
    name, revision, ad, T = fj.name, fj.revision, fj.adapter, windows.shape[1]
    dev = open_deviation(job.input.deviation, {"model": name, "revision": revision})
    kernel = fj.kernel()
    zbar = torch.as_tensor(fj.stats.zbar().transpose("query", "layer", "head", "head_dim").values, dtype=torch.float32)
    lut = fj.tracked.query_bucket_lut()
    win, pos = C.sample_occurrences(len(windows), T, stride=int(cfg["stride"]), min_position=int(cfg["min_position"]),
                                    budget=int(cfg["tokens"]), seed=int(cfg["seed"]))
    # streamed (issue 58): Δ is never held whole, only summed per position and cell (modules stream, cells)
    prepared = C.prepare(ad, kernel, zbar, windows, lut, win, pos)
    S_bar = dev["S_bar"].transpose("layer", "head").values
    occ, heads, cl, carriers, ctab, sums = Sm.analyse(ad, prepared, O, W_pos, S_bar, T, cfg,
                                                      batch_size=int(p.batch_size), progress=True)
    log.info("%s @ %s: %d occurrences (%d valid) of %d eval windows, W_pos %s", name, revision, len(occ),
             int(occ.valid.sum()), len(np.unique(win)), "present" if W_pos is not None else "absent (rotary)")
    heads["cluster"] = [(l, h) in cl for l, h in zip(heads["layer"], heads["head"])]
    heads["carrier"] = [(l, h) in carriers for l, h in zip(heads["layer"], heads["head"])]
    S, share = Ce.union_subspace(ctab["fits"], carriers, int(cfg["ablation_dim"]), O.shape[-1])
    log.info("cluster %s, carriers %s; S: %d dimensions holding %.3f of the carriers' positional writes",
             [f"L{l}H{h}" for l, h in cl], [f"L{l}H{h}" for l, h in carriers], S.shape[1], share)
    write_table(heads, csv=out.heads)
    atomic_write_text(out.heads_md, Tb.positional_markdown(heads, ctab, share, S.shape[1], name, revision, cfg))
    write_table(ctab["rows"], csv=out.cluster)
    write_table(ctab["overlaps"], csv=out.overlaps)
    write_table(Ce.curves(sums, ctab["fits"], cl, cfg), csv=out.curves)
    atomic_savez(out.subspace, S=S, share=np.float64(share), carriers=np.asarray(carriers, np.int64).reshape(-1, 2),
                 cluster=np.asarray(cl, np.int64).reshape(-1, 2))
    _readings(job, fj, ad, kernel, windows, occ, dev, cfg, log)
    atomic_write_text(out.info, json.dumps({"model": name, "revision": revision, "n_occurrences": len(occ),
                                            "cluster": [f"L{l}H{h}" for l, h in cl], "S_dim": int(S.shape[1]),
                                            "S_share": share, "wpos": W_pos is not None}, indent=1) + "\n")


def _readings(job, fj, ad, kernel, windows, occ, dev, cfg, log) -> None:
    """The repeated-text condition and the type-class test of :func:`positional`."""
    import numpy as np

    from mfpipe.experiments.positional import analysis as An
    from mfpipe.experiments.positional import collect as C
    from mfpipe.experiments.positional import readings as Rd
    from mfpipe.experiments.positional import tables as Tb
    from mfpipe.workflow.io import atomic_write_text
    from mfpipe.workflow.tables import write_table

    out, name, revision = job.output, fj.name, fj.revision
    rp = cfg["repeated"]
    T = windows.shape[1]
    k = int(rp["chunk_length"] or (T - 1) // 2)
    seqs = C.repeated_sequences(windows, min(int(rp["n_sequences"]), len(windows)), k, bos_id=fj.tracked.bos_id,
                                seed=int(cfg["seed"]))
    rep = C.repeated_deviation(ad, kernel, seqs, fj.tracked.query_bucket_lut(), min_position=int(cfg["min_position"]),
                               max_other=float(cfg["max_other"]), batch_size=int(job.params.batch_size))
    keep = An.head_masks(occ, cfg["min_position"], cfg["max_other"])
    n_nat = keep.sum(0)
    with np.errstate(invalid="ignore", divide="ignore"):
        D_nat = np.where(n_nat > 0, np.where(keep, occ.D, 0).sum(0) / n_nat, np.nan)
    table = Rd.repeated_table(D_nat, n_nat, rep["D_repeated"], rep["n_repeated"])
    write_table(table, csv=out.repeated)
    atomic_write_text(out.repeated_md, Tb.repeated_markdown(table, rep, name, revision))
    top = table.sort_values("rise_rank").head(4)
    log.info("repeated text: largest rises %s", ", ".join(f"L{r.layer}H{r.head} {r.rise:+.3f}"
                                                           for r in top.itertuples()))
    cls = cfg["class_types"]
    types = C.class_types(fj.tokenizer(), fj.tracked, cls["strings"])
    # the types pass 2 scored (at least its min_occurrences in every layer): a rarer type's mean is noise
    scored = dev["count"].sum("half").min("layer").values >= int(dev.attrs.get("min_occurrences", 1))
    D_type = np.where(scored[None, None, :], dev["D_type"].transpose("layer", "head", "query").values, np.nan)
    ct = Rd.class_test(D_type, types, occ.D, occ.query_type, keep, name=str(cls["name"]))
    write_table(ct, csv=out.classes)
    atomic_write_text(out.classes_md, Tb.classes_markdown(ct, cls["strings"], name, revision))
    log.info("type class %s: %d tracked types; heads with Bonferroni p < 0.05: %d", cls["name"], len(types),
             int((ct["p_type_bonferroni"] < 0.05).sum()))


def positional_ablation(job) -> None:
    """The dereferencing ablation (App. positional) of one (model, revision): S (input.subspace, from the positional
    job) projected out of the carriers' summed write mid-forward, against the same S out of the same layers' other
    heads and random subspaces of its dimension, on eval windows: loss increases, by token category, consumers."""
    import json

    import numpy as np

    from mfpipe.experiments.positional import ablation as Ab
    from mfpipe.experiments.positional import tables as Tb
    from mfpipe.workflow.io import atomic_write_text
    from mfpipe.workflow.tables import write_table

    p, out, log = job.params, job.output, job.log
    cfg = dict(p.positional)
    fj, windows, _, _ = _load(job)
    name, revision, ad = fj.name, fj.revision, fj.adapter
    sub = np.load(job.input.subspace)
    S, carriers = sub["S"], [tuple(x) for x in sub["carriers"].tolist()]
    rng = np.random.default_rng([int(cfg["seed"]), 0xAB])
    n = min(int(cfg["ablation_windows"]), len(windows))
    wins = windows[np.sort(rng.choice(len(windows), size=n, replace=False))]
    arms = Ab.ablation_arms(carriers, ad.n_layers, ad.n_heads, S, int(cfg["n_random"]), int(cfg["seed"]))
    if not carriers:
        log.info("%s @ %s: no carriers, so no subspace: every arm removes nothing (zero increases)", name, revision)
    res = Ab.run_ablation(ad, wins, arms, batch_size=int(p.batch_size))
    tabs = Tb.ablation_tables(res, arms, Ab.token_categories(fj.tokenizer(), wins), ad.n_layers, ad.n_heads)
    info = dict(dim=int(S.shape[1]), carriers=" ".join(f"L{l}H{h}" for l, h in carriers) or "none",
                non_carriers=" ".join(f"L{l}H{h}" for l, hs in arms[1][1].items() for h in hs) or "none",
                windows=int(n), n_random=int(cfg["n_random"]))
    for key in ("arms", "categories", "consumers"):
        write_table(tabs[key], csv=getattr(out, key))
    atomic_write_text(out.md, Tb.ablation_markdown(tabs, info, name, revision))
    for r in tabs["arms"].itertuples():
        log.info("%-12s loss %+.5f (draws %d, sd %.5f)", r.arm, r.loss_increase, r.draws, r.sd)
    atomic_write_text(out.info, json.dumps({"model": name, "revision": revision, **info}, indent=1) + "\n")


def figure_positional(job) -> None:
    """Fig. positional from the positional table and its curves (no model) -> output.pdf / output.png."""
    import pandas as pd

    from mfpipe.experiments.positional.figures import plot_positional

    plot_positional(pd.read_csv(job.input.heads), pd.read_csv(job.input.curves), job.output.pdf,
                    title=str(job.params.title))
    job.log.info("wrote %s and %s", job.output.pdf, job.output.png)
