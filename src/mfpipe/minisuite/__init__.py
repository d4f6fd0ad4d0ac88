"""Offline "mini model suite": a byte-level BPE tokenizer and tiny GPT-2 / GPT-NeoX models
trained on CPU on the embedded corpus, with log-spaced HF checkpoints (a miniature Pythia suite).

- :func:`mfpipe.minisuite.tokenizer.train_tokenizer`
- :mod:`mfpipe.minisuite.data` — the training rows (the document stream; ``[BOS, text…]``, repeated-chunk and
  few-shot rows)
- :mod:`mfpipe.minisuite.tasks` — the few-shot tasks the suite learns (fixed random mappings of its own vocabulary)
  and their few-shot / zero-shot accuracy
- :func:`mfpipe.minisuite.train.train_mini_model`, :func:`~mfpipe.minisuite.model.build_model`,
  :func:`mfpipe.workflow.revisions.checkpoint_steps`
"""

from mfpipe.minisuite.model import DEFAULT_CONFIG, build_model, resolve_config
from mfpipe.minisuite.tokenizer import BOS_TOKEN, train_tokenizer
from mfpipe.minisuite.train import train_mini_model
from mfpipe.workflow.revisions import checkpoint_steps

__all__ = [
    "BOS_TOKEN",
    "DEFAULT_CONFIG",
    "build_model",
    "checkpoint_steps",
    "resolve_config",
    "train_mini_model",
    "train_tokenizer",
]
