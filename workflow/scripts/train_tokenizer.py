"""Snakemake script: train the mini suite's byte-level BPE tokenizer on the corpus's train split."""
import _mfpipe_checkout  # noqa: F401,I001 (first: this checkout's src/ on sys.path)
from mfpipe.corpus.documents import load_documents, split_documents
from mfpipe.workflow.io import atomic_dir
from mfpipe.workflow.runner import run_logged
from mfpipe.workflow.logs import setup_logging
from mfpipe.minisuite.tokenizer import train_tokenizer

sm = snakemake  # noqa: F821 (injected by Snakemake)
log = setup_logging(sm.log[0])


def main() -> None:
    corpus = dict(sm.params.corpus)
    docs = load_documents(corpus)
    train = split_documents(docs, int(corpus["reserve_train_every"]))["train"]
    texts = [d.text for d in train]
    log.info("tokenizer: %d of %d documents (train split), vocab_size %d, min_frequency %d",
             len(texts), len(docs), sm.params.vocab_size, sm.params.min_frequency)
    with atomic_dir(sm.output[0]) as tmp:
        train_tokenizer(texts, int(sm.params.vocab_size), int(sm.params.min_frequency), tmp)
    log.info("wrote %s", sm.output[0])


run_logged(main, log)
