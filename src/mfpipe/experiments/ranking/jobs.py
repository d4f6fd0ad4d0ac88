"""The head ranking's jobs, one function per rule of workflow/rules/ranking.smk (run by
mfpipe.workflow.runner.run_job). Each imports what it runs inside its own body, so its code inputs are its own."""

from __future__ import annotations


def head_scores(job) -> None:
    """The behavioural head scores of one (model, revision) (App. P tab:bottom, Sec. 6.1 Exp. 3): induction,
    previous-token, duplicate-token and BOS-sink attention shares of every head on repeated random sequences
    [BOS; c; c], measured from attention alone (no mean field) -> head_scores.csv."""
    import time

    from mfpipe.experiments.ranking.head_scores import head_scores as measure, scores_table, write_head_scores
    from mfpipe.models.loader import load_tokenizer
    from mfpipe.workflow.tables import to_markdown

    p, log = job.params, job.log
    spec = dict(p.model_spec)
    name, revision = spec["name"], str(p.revision)
    model, adapter = job.model()
    # the draw is over the tokenizer's ids (the embedding matrix may be padded beyond them), specials excluded;
    # the BOS prefix is the tokenizer's, else the model config's
    tok = load_tokenizer(spec, results_dir=p.results)
    bos = tok.bos_token_id if tok.bos_token_id is not None else "auto"
    log.info("%s @ %s (%r on %s): %d sequences, context %d, vocabulary %d, BOS %s, seed %d",
             name, revision, adapter, adapter.device, int(p.n_sequences), int(p.context_length), len(tok), bos,
             int(p.seed))
    t0 = time.perf_counter()
    ds = measure(adapter, len(tok), tok.all_special_ids, int(p.context_length), int(p.n_sequences), int(p.seed),
                 bos_id=bos, batch_size=int(p.batch_size))
    write_head_scores(ds, job.output.csv, name, revision)
    top = scores_table(ds).sort_values("induction", ascending=False).head(5)
    log.info("%.1f s (k = %d); top induction heads:\n%s", time.perf_counter() - t0, ds.attrs["k"],
             to_markdown(top))


def exp3_correlation(job) -> None:
    """Sec. 6.1 Experiment 3 (fig:e15-correlation) for one model: at every training checkpoint the cross-head
    Spearman correlation between the mean-field deviation S_bar (per-revision deviation store) and the behavioural
    induction score (per-revision head_scores.csv) -> table (CSV) and figure (PDF + PNG)."""
    from mfpipe.experiments.ranking.exp3 import exp3_rows, exp3_table
    from mfpipe.experiments.ranking.figures import exp3_figure
    from mfpipe.models.induction import training_window
    from mfpipe.workflow import tables as T

    p, inp = job.params, job.input
    df = exp3_table(exp3_rows(str(p.model), list(inp.deviation), list(inp.heads), p.revisions, p.steps))
    T.write_csv(df, job.output.csv)
    training = getattr(inp, "training", None) or []  # [training.json] for a mini model, else []
    training = [training] if isinstance(training, str) else list(training)
    band = tuple(getattr(p, "band", None) or (0.1, 0.8))
    window = training_window(getattr(p, "window", None), training[0] if training else None, band)
    exp3_figure(df, job.output.png, window=window, title=getattr(p, "title", None))
    job.log.info("induction window: %s\n%s", window, T.to_markdown(df, floatfmt="{:.3g}"))


def ranking(job) -> None:
    """The head ranking of one (model, revision) (Sec. 6.3, App. P): every head by S̄ with M_cov, M_ctx and the
    behavioural scores, Tables ranking-cc (top) and bottom, split-half stability, Fig. ccmf-scatter."""
    import pandas as pd

    from mfpipe.deviation.store import open_deviation
    from mfpipe.experiments.ranking.figures import ccmf_scatter
    from mfpipe.experiments.ranking.heads import head_roles
    from mfpipe.experiments.ranking.head_scores import open_head_scores
    from mfpipe.experiments.ranking.heads import heads_table, merge_rises, split_half_stability, top_bottom
    from mfpipe.workflow import tables as T

    p, inp, out = job.params, job.input, job.output
    dev = open_deviation(inp.deviation, {"model": p.model, "revision": str(p.revision)})
    scores = open_head_scores(inp.heads)
    if scores.attrs.get("revision") not in (None, str(p.revision)):
        raise ValueError(f"{inp.heads} holds revision {scores.attrs['revision']}, expected {p.revision}")
    table = heads_table(dev, scores)
    table.insert(4, "role", head_roles(table))
    if len(getattr(inp, "rises", None) or []):  # App. readings: each head's rise under repetition, beside S̄
        table = merge_rises(table, pd.read_csv(inp.rises[0]))
    top, bottom = top_bottom(table, int(p.top), int(p.bottom))
    stability = pd.DataFrame([split_half_stability(table, int(p.top))])
    T.write_table(table, csv=out.heads)
    T.write_table(top, csv=out.top_csv, md=out.top_md)
    T.write_table(bottom, csv=out.bottom_csv, md=out.bottom_md)
    T.write_table(stability, csv=out.stability_csv, md=out.stability_md)
    ccmf_scatter(table, out.png, top=int(p.top), title=f"{p.model} @ {p.revision}: heads on the M_cov / M_ctx plane")
    job.log.info("top heads:\n%s\nbottom heads:\n%s\nsplit-half: %s",
                 T.to_markdown(top.head(10), floatfmt="{:.3f}"), T.to_markdown(bottom.head(10), floatfmt="{:.3f}"),
                 stability.iloc[0].to_dict())


def ranking_roles(job) -> None:
    """Sec. 6.3 "circuits straddle the ranking" for one (model, revision): each behavioural role's top heads
    (previous-token, induction, duplicate-token from the head scores; BOS-sink from the kernel P's <bos> column on
    the statistics half) with their rank and percentile in the S̄ ranking -> table (CSV + Markdown)."""
    import pandas as pd

    from mfpipe.experiments.ranking.roles import bos_sink_scores, role_ranks
    from mfpipe.stats import open_stats
    from mfpipe.workflow import tables as T

    p, inp, out = job.params, job.input, job.output
    table = pd.read_csv(inp.heads)
    st = open_stats(inp.stats, {"model": p.model, "revision": str(p.revision), "half": "stats"})
    P_bos = st.ds["P"].isel(key=st.bos_bucket).transpose("layer", "head", "query").values
    sink = bos_sink_scores(P_bos, st.query_count().values)
    table["bos_sink_corpus"] = sink[table["layer"].to_numpy(int), table["head"].to_numpy(int)]
    df = role_ranks(table, int(p.top))
    T.write_csv(df, out.csv)
    md = T.to_markdown(df.drop(columns=["model", "revision"]), floatfmt="{:.3f}")
    T.write_text(f"Behavioural roles in the S-bar ranking: {p.model} @ {p.revision} ({len(table)} heads)\n\n{md}",
                 out.md)
    med = df.groupby("role", sort=False)["percentile"].median() if len(df) else {}
    job.log.info("\n%s\nmedian percentile per role: %s", md, {k: round(float(v), 1) for k, v in med.items()})


def exp3_single(job) -> None:
    """Exp. 3's correlation at one revision (tab:gemma, any model, with or without a training sweep): the Spearman
    correlation over heads of S̄ and the induction score, from the ranking table -> table (CSV + Markdown)."""
    import pandas as pd

    from mfpipe.experiments.ranking.exp3 import single_revision_table
    from mfpipe.workflow import tables as T

    df = single_revision_table(pd.read_csv(job.input.heads))
    md = T.to_markdown(df, floatfmt="{:.3g}")
    T.write_csv(df, job.output.csv)
    T.write_text(md, job.output.md)
    job.log.info("\n%s", md)
