"""Snakemake script: App. G cross-corpus matrix for one (model, revision): the mean-field rollout with each
corpus's statistics scored against each corpus's held-out centroids (+ the context-free baseline)."""
import _mfpipe_checkout  # noqa: F401,I001 (first: this checkout's src/ on sys.path)
from mfpipe.workflow import tables as T
from mfpipe.experiments.rollout import tables as RT
from mfpipe.experiments.rollout import runs as RO
from mfpipe.workflow.runner import load_job_model, run_logged
from mfpipe.workflow.logs import setup_logging

sm = snakemake  # noqa: F821
log = setup_logging(sm.log[0])


def main() -> None:
    p = sm.params
    model, adapter = load_job_model(p, sm.threads)
    stats, evals = list(sm.input.stats), list(sm.input.eval)
    corpora = {c: (s, e) for c, s, e in zip(p.corpora, stats, evals)}
    df = RO.cross_corpus(model, adapter, corpora, p.primary, init=str(p.init), min_count=int(p.min_count),
                        model_name=p.model_spec["name"], revision=p.revision)
    T.write_csv(df, sm.output.scores)
    summary = RT.cross_corpus_summary(df)
    T.write_csv(summary, sm.output.csv)
    tag = f"{p.model_spec['name']} @ {p.revision}"
    md = RT.matrix_markdown(summary, "cosine", title=f"Cross-corpus matrix, centered cosine: {tag}")
    md += "\n" + RT.matrix_markdown(summary, "rel_error", title=f"Cross-corpus matrix, centered rel. error: {tag}")
    T.write_text(md, sm.output.md)
    log.info("\n%s", md)


run_logged(main, log)
