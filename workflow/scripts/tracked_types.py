"""Snakemake script: the top-N tracked types on the stats half, with position coverage (App. F)."""
import _mfpipe_checkout  # noqa: F401,I001 (first: this checkout's src/ on sys.path)
import json
from pathlib import Path

from mfpipe.corpus.windows import list_shards, read_shard
from mfpipe.workflow.runner import run_logged
from mfpipe.workflow.logs import setup_logging
from mfpipe.models.loader import load_tokenizer
from mfpipe.corpus.tracked import count_types, select_tracked

sm = snakemake  # noqa: F821
log = setup_logging(sm.log[0])


def main() -> None:
    shards = Path(sm.input.shards)
    info = json.loads((shards / "fingerprint.json").read_text())
    spec = sm.params.model
    tokenizer = load_tokenizer(spec, results_dir=sm.params.results)
    counts = count_types((read_shard(p).tokens for p in list_shards(shards / "stats")), info["vocab_size"])
    tracked = select_tracked(
        counts, int(sm.params.n_tracked), info["bos_id"],
        decode=lambda i: tokenizer.decode([i]),
        meta={"model": spec["name"], "corpus": info["corpus"], "corpus_fingerprint": info["fingerprint"],
              "context_length": info["context_length"]},
    )
    if tracked.n < int(sm.params.n_tracked):
        log.warning("only %d types occur on the stats half; tracking all of them (asked for %d)", tracked.n, sm.params.n_tracked)
    tracked.save(sm.output[0])
    log.info("tracked %d types, position coverage %.4f, fingerprint %s", tracked.n, tracked.coverage, tracked.fingerprint)


run_logged(main, log)
