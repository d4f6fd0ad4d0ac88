"""Byte-level BPE tokenizer for the mini suite (GPT-2 style, ``<|endoftext|>`` = id 0)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

BOS_TOKEN = "<|endoftext|>"


def train_tokenizer(
    texts: Sequence[str],
    vocab_size: int,
    min_frequency: int,
    out_dir: str | os.PathLike,
) -> None:
    """Train a byte-level BPE on ``texts`` and save it as a HF fast tokenizer in ``out_dir``.

    The tokenizer is GPT-2 style: byte-level pre-tokenisation (no prefix space), the byte-level
    decoder, and a single special token ``<|endoftext|>`` with id 0 that serves as BOS, EOS and
    UNK. It is wrapped in :class:`transformers.PreTrainedTokenizerFast` and written with
    ``save_pretrained`` so that ``AutoTokenizer.from_pretrained(out_dir)`` loads it. It adds no
    special tokens when encoding (callers prepend BOS themselves, see docs/conventions.md).

    Training is deterministic for a given list of texts (BPE merges are chosen by count with
    deterministic tie-breaking; the trainer does not sample).
    """
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    if not texts:
        raise ValueError("train_tokenizer: no training texts")
    if vocab_size < 257:
        raise ValueError(f"train_tokenizer: vocab_size must be >= 257 (256 bytes + BOS), got {vocab_size}")

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=int(vocab_size),
        min_frequency=int(min_frequency),
        special_tokens=[BOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer=trainer, length=len(texts))
    assert tok.token_to_id(BOS_TOKEN) == 0

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=BOS_TOKEN,
        unk_token=BOS_TOKEN,
        model_max_length=int(1e30),
        clean_up_tokenization_spaces=False,
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
