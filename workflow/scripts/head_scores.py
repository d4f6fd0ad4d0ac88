"""Snakemake script: the behavioural head scores of one (model, revision) (App. P tab:bottom, Sec. 6.1 Exp. 3):
induction, previous-token, duplicate-token and BOS-sink attention shares of every head on repeated random
sequences [BOS; c; c], measured from attention alone (no mean field) -> head_scores.csv."""
import _mfpipe_checkout  # noqa: F401,I001 (first: this checkout's src/ on sys.path)
import time

from mfpipe.experiments.ranking.head_scores import head_scores, scores_table, write_head_scores
from mfpipe.workflow.runner import load_job_model, run_logged
from mfpipe.workflow.logs import setup_logging
from mfpipe.models.loader import load_tokenizer
from mfpipe.workflow.tables import to_markdown

sm = snakemake  # noqa: F821 (injected by Snakemake)
log = setup_logging(sm.log[0])


def main() -> None:
    p = sm.params
    spec = dict(p.model_spec)
    name, revision = spec["name"], str(p.revision)
    model, adapter = load_job_model(p, sm.threads)
    # the draw is over the tokenizer's ids (the embedding matrix may be padded beyond them), specials excluded;
    # the BOS prefix is the tokenizer's, else the model config's
    tok = load_tokenizer(spec, results_dir=p.results)
    bos = tok.bos_token_id if tok.bos_token_id is not None else "auto"
    log.info("%s @ %s (%r on %s): %d sequences, context %d, vocabulary %d, BOS %s, seed %d",
             name, revision, adapter, adapter.device, int(p.n_sequences), int(p.context_length), len(tok), bos,
             int(p.seed))
    t0 = time.perf_counter()
    ds = head_scores(adapter, len(tok), tok.all_special_ids, int(p.context_length), int(p.n_sequences),
                     int(p.seed), bos_id=bos, batch_size=int(p.batch_size))
    write_head_scores(ds, sm.output.csv, name, revision)
    top = scores_table(ds).sort_values("induction", ascending=False).head(5)
    log.info("%.1f s (k = %d); top induction heads:\n%s", time.perf_counter() - t0, ds.attrs["k"],
             to_markdown(top))


run_logged(main, log)
