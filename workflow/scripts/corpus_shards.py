"""Snakemake script: tokenize the corpus with the model's tokenizer and write the shards."""
import _mfpipe_checkout  # noqa: F401,I001 (first: this checkout's src/ on sys.path)
from mfpipe.corpus.windows import resolve_bos_id, write_corpus
from mfpipe.workflow.io import atomic_dir
from mfpipe.workflow.runner import run_logged
from mfpipe.workflow.logs import setup_logging
from mfpipe.models.loader import load_tokenizer

sm = snakemake  # noqa: F821 (injected by Snakemake)
log = setup_logging(sm.log[0])


def main() -> None:
    spec, cfg = sm.params.model, dict(sm.params.corpus)
    tokenizer = load_tokenizer(spec, results_dir=sm.params.results)
    bos_id = resolve_bos_id(tokenizer, spec.get("bos_token"))
    log.info("corpus %s for model %s: BOS id %d (%r), T=%d, budget %d tokens per half",
             cfg["name"], spec["name"], bos_id, tokenizer.convert_ids_to_tokens(bos_id), cfg["context_length"], cfg["tokens_per_half"])
    with atomic_dir(sm.output[0]) as tmp:
        info = write_corpus(cfg, tokenizer, bos_id, tmp, tokenizer_name=spec.get("hub_id") or spec["name"], progress=log.info,
                            tokenizer_revision=spec.get("tokenizer_revision") or ("main" if spec["source"] == "hub" else None),
                            tokenizer_commit=spec.get("tokenizer_commit"))
    log.info("fingerprint %s", info["fingerprint"])


run_logged(main, log)
