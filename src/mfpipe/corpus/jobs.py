"""The corpus stage's jobs, one function per rule of workflow/rules/corpus.smk (run by
mfpipe.workflow.runner.run_job). Each imports what it runs inside its own body, so its code inputs are its own."""

from __future__ import annotations


def corpus_shards(job) -> None:
    """Tokenize the corpus with the model's tokenizer and write the shards (the checkpoint corpus_shards).

    input.tokenizer   the mini suite's tokenizer, for a mini-suite model
    output[0]         the shards folder: stats/ and eval/ shards and fingerprint.json (written atomically)
    params.corpus     the corpus entry; params.model the model entry (model_spec()); params.results
    """
    from mfpipe.corpus.windows import resolve_bos_id, write_corpus
    from mfpipe.models.loader import load_tokenizer
    from mfpipe.workflow.io import atomic_dir

    log = job.log
    spec, cfg = job.params.model, dict(job.params.corpus)
    tokenizer = load_tokenizer(spec, results_dir=job.params.results)
    bos_id = resolve_bos_id(tokenizer, spec.get("bos_token"))
    log.info("corpus %s for model %s: BOS id %d (%r), T=%d, budget %d tokens per half",
             cfg["name"], spec["name"], bos_id, tokenizer.convert_ids_to_tokens(bos_id), cfg["context_length"],
             cfg["tokens_per_half"])
    with atomic_dir(job.output[0]) as tmp:
        info = write_corpus(cfg, tokenizer, bos_id, tmp, tokenizer_name=spec.get("hub_id") or spec["name"],
                            progress=log.info,
                            tokenizer_revision=spec.get("tokenizer_revision") or ("main" if spec["source"] == "hub"
                                                                                  else None),
                            tokenizer_commit=spec.get("tokenizer_commit"))
    log.info("fingerprint %s", info["fingerprint"])


def tracked_types(job) -> None:
    """The top-N tracked types on the stats half, with position coverage (App. F).

    input.shards      the model's corpus shards; input.tokenizer as corpus_shards
    output[0]         tracked.json (mfpipe.corpus.tracked.TrackedSet)
    params.n_tracked  N; params.model the model entry (model_spec()); params.results
    """
    import json
    from pathlib import Path

    from mfpipe.corpus.tracked import count_types, select_tracked
    from mfpipe.corpus.windows import list_shards, read_shard
    from mfpipe.models.loader import load_tokenizer

    p, log = job.params, job.log
    shards = Path(job.input.shards)
    info = json.loads((shards / "fingerprint.json").read_text())
    spec = p.model
    tokenizer = load_tokenizer(spec, results_dir=p.results)
    counts = count_types((read_shard(x).tokens for x in list_shards(shards / "stats")), info["vocab_size"])
    tracked = select_tracked(
        counts, int(p.n_tracked), info["bos_id"],
        decode=lambda i: tokenizer.decode([i]),
        meta={"model": spec["name"], "corpus": info["corpus"], "corpus_fingerprint": info["fingerprint"],
              "context_length": info["context_length"]},
    )
    if tracked.n < int(p.n_tracked):
        log.warning("only %d types occur on the stats half; tracking all of them (asked for %d)", tracked.n,
                    p.n_tracked)
    tracked.save(job.output[0])
    log.info("tracked %d types, position coverage %.4f, fingerprint %s", tracked.n, tracked.coverage,
             tracked.fingerprint)


def tracked_types_topn(job) -> None:
    """App. M: the tracked set of a top-N arm (substitution.top_n), the same selection with another N
    (``use rule tracked_types as tracked_types_topn``): output[0] tracked-N<n>.json, params.n_tracked the arm's N."""
    tracked_types(job)


def coverage_table(job) -> None:
    """App. F position-coverage table over the configured models.

    input.tracked     every model's tracked.json on the primary corpus
    output.csv, output.md   the table; params.models the models, in config order
    """
    from mfpipe.corpus.tracked import coverage_table as table
    from mfpipe.workflow.tables import to_markdown, write_table

    df = table(job.input.tracked, job.params.models)
    write_table(df, csv=job.output.csv, md=job.output.md)
    job.log.info("\n%s", to_markdown(df))


def rank_frequency(job) -> None:
    """App. F ``fig:zipf``: the rank-frequency table of the model's tokenizer on the corpus's stats half.

    input.shards      the model's corpus shards
    output[0]         rank_frequency.csv (rank, type_id, count, frequency; mfpipe.corpus.zipf.rank_frequency)
    """
    from mfpipe.corpus.zipf import rank_frequency as table
    from mfpipe.corpus.zipf import shard_counts
    from mfpipe.workflow.tables import write_csv

    counts, bos_id = shard_counts(job.input.shards)
    df = table(counts, bos_id)
    write_csv(df, job.output[0])
    job.log.info("%d types occur on the stats half (%d positions >= 1)", len(df), int(counts.sum()))


def zipf(job) -> None:
    """App. F ``fig:zipf`` over the configured models: the cutoff table (the rank-N frequency per model) and the
    cross-model rank-frequency figure.

    input.tables      every model's rank_frequency.csv on the primary corpus, in params.models order
    output.csv, output.md, output.pdf, output.png;  params.models, params.n_tracked (the cutoff N)
    """
    import pandas as pd

    from mfpipe.corpus.zipf import zipf_figure, zipf_summary
    from mfpipe.workflow.tables import to_markdown, write_csv, write_text

    tables = {m: pd.read_csv(t) for m, t in zip(job.params.models, job.input.tables)}
    n = int(job.params.n_tracked)
    df = zipf_summary(tables, n)
    md = to_markdown(df, floatfmt="{:.4g}")
    write_csv(df, job.output.csv)
    write_text(md, job.output.md)
    zipf_figure(tables, n, job.output.pdf, job.output.png)
    job.log.info("\n%s", md)


def tracked_types_excl(job) -> None:
    """The exclusion arm's tracked set (App. llama; mfpipe.corpus.exclusion.select_arm): the main set's
    top-N selection on the stats half with every excluded type skipped and the next most frequent filling up to N.

    input.shards      the model's corpus shards; input.tokenizer the mini suite's, for a mini-suite model
    output[0]         tracked-excl.json (mfpipe.corpus.tracked.TrackedSet; meta: the rule and every type skipped)
    params.n_tracked  N; params.classes, params.strings (config section exclusion); params.model, params.results
    """
    from mfpipe.corpus import exclusion as EX

    p, log = job.params, job.log
    ts = EX.arm_tracked(job.input.shards, p.model, p.results, int(p.n_tracked), list(p.classes), list(p.strings))
    ts.save(job.output[0])
    log.info("exclusion arm: %d types tracked, %d of the main top-%d excluded (%s), %d skipped in all; e.g. %s",
             ts.n, ts.meta["n_excluded_of_main"], int(p.n_tracked), "+".join(p.classes) or "strings",
             len(ts.meta["excluded"]), EX.excluded_examples(ts.meta))
