"""Snakemake script: the instance meter of one (model, revision) (Sec. 6.1 Experiment 1): eval-half chunks c
presented as [BOS; c; c], per query position the mean next-token loss and mean D_MF, the head whose deviation rises
most across the copy boundary, and the in-context loss reduction binned by the deviation rise -> the tables Fig. icl-meter is drawn from (rule figure_icl_meter).

input.stats      the revision's statistics-half store; input.shards: the corpus shards (chunks from the eval
                 half); input.tracked: tracked.json; input.model: dependency only (mini-suite checkpoints)
output.curves    per position: copy, loss (valid positions), loss_all, D_MF, n_valid, top_head_D (CSV)
output.heads     per head: mean D over copy 1 and copy 2, rise (CSV)
output.bins      loss reduction binned by deviation rise, equal-count bins, mean ± s.e.m. (CSV)
output.summary, output.summary_md  one row: top head and its rise, copy means, Spearman of the pairs
params           n_sequences, chunk_length (the paper: 128; cut to (T-1)//2 where [BOS; c; c] does not fit the T-token
                 windows; null: (T-1)//2), n_bins, seed, min_count, batch_size, model_params()
"""
import _mfpipe_checkout  # noqa: F401,I001 (first: this checkout's src/ on sys.path)
import time

from mfpipe.experiments.prompts import meter as IM
from mfpipe.experiments.prompts import sets as P
from mfpipe.workflow.context import open_forward_job
from mfpipe.workflow.runner import run_logged
from mfpipe.workflow.logs import setup_logging
from mfpipe.workflow.tables import write_table

sm = snakemake  # noqa: F821 (injected by Snakemake)
log = setup_logging(sm.log[0])


def main() -> None:
    p, n = sm.params, int(sm.params.n_sequences)
    job = open_forward_job(sm)
    name, revision = job.name, job.revision
    tokens, doc_ids = P.eval_windows(job.shards, 4 * n)
    want = None if p.chunk_length in (None, "", "null") else int(p.chunk_length)
    k, cut = P.meter_chunk_length(want, tokens.shape[1])
    if cut:
        log.info("chunk_length %d cut to %d: [BOS; c; c] needs 2k+1 <= T = %d tokens", want, k, tokens.shape[1])
    seqs, spanning = P.meter_sequences(tokens, doc_ids, n, k, bos_id=job.tracked.bos_id, seed=int(p.seed))
    if len(seqs) < n:
        log.warning("the eval half has only %d windows: %d of %d sequences", len(tokens), len(seqs), n)
    log.info("%s @ %s: %d sequences [BOS; c; c], k=%d (%d chunks span a document boundary), W on C >= %d",
             name, revision, len(seqs), (seqs.shape[1] - 1) // 2, spanning, int(p.min_count))
    t0 = time.perf_counter()
    res = IM.instance_meter(job.adapter, job.kernel(int(p.min_count)), seqs, batch_size=int(p.batch_size), progress=True,
                            desc=f"icl meter {name}@{revision}")
    tabs = IM.meter_tables(res, n_bins=int(p.n_bins))
    summary = tabs["summary"]
    summary.insert(0, "revision", revision)
    summary.insert(0, "model", name)
    write_table(tabs["curves"], csv=sm.output.curves)
    write_table(tabs["heads"], csv=sm.output.heads)
    write_table(tabs["bins"], csv=sm.output.bins)
    write_table(summary, csv=sm.output.summary, md=sm.output.summary_md)
    s = summary.iloc[0]
    log.info("in %.1f s: loss copy 1 %.3f -> copy 2 %.3f, D_MF %.3f -> %.3f; top-rising head L%dH%d (+%.3f); "
             "Spearman(rise, loss reduction) %.3f over %d pairs", time.perf_counter() - t0, s["loss_copy1"],
             s["loss_copy2"], s["D_MF_copy1"], s["D_MF_copy2"], s["top_layer"], s["top_head"], s["top_head_rise"],
             s["spearman_rho"], s["n_pairs"])


run_logged(main, log)
