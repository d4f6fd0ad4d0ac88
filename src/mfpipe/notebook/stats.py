"""Pass 1 of a model already in memory (:func:`collect_stats`): the statistics store's Dataset, computed by the
statistics jobs' own code (:func:`mfpipe.stats.shards.accumulate_shard` per shard, each shard's sums in the form a
partial stores them, :func:`mfpipe.stats.partials.merge_sums`, :func:`mfpipe.stats.store.finalize`), so the same
windows give the pipeline's store array for array."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from mfpipe.notebook.identity import identity_attrs
from mfpipe.notebook.inputs import (NotebookError, bos_id_of, check_fits, positive_int, prepared, resolve_model,
                                    text_windows, tokens_fingerprint)

__all__ = ["collect_stats", "select_tracked_types", "DEFAULT_N_TRACKED", "DEFAULT_CONTEXT_LENGTH"]

DEFAULT_N_TRACKED = 1000  # the paper's N
DEFAULT_CONTEXT_LENGTH = 128  # texts are packed into windows of this length (capped by the model's positions)


def select_tracked_types(blocks: list[np.ndarray], tokenizer, bos_id: int, vocab_size: int, *, n_tracked=None,
                         tracked=None, meta: dict | None = None):
    """The tracked set: ``tracked`` as given (a TrackedSet, a tracked.json path, or token ids / strings of the
    tokenizer), else the top ``n_tracked`` types of ``blocks`` by frequency, as the corpus stage selects them
    (:func:`mfpipe.corpus.tracked.select_tracked`: BOS never tracked, ties by smaller id)."""
    from mfpipe.corpus.tracked import TrackedSet, count_types, select_tracked

    decode = (lambda i: tokenizer.decode([i])) if tokenizer is not None else str
    counts = count_types(blocks, vocab_size)
    if isinstance(tracked, TrackedSet):
        ts = tracked
    elif isinstance(tracked, (str, Path)):
        ts = TrackedSet.load(tracked)
    elif tracked is not None:
        ids = [_tracked_id(tokenizer, t, vocab_size) for t in tracked]
        if bos_id in ids:
            raise NotebookError(f"tracked= holds the BOS id {bos_id}: BOS is never a tracked type")
        ts = TrackedSet(np.asarray(ids, dtype=np.int64), [decode(i) for i in ids], counts[ids], bos_id, vocab_size,
                        int(counts.sum()), dict(meta or {}))
    else:
        n = DEFAULT_N_TRACKED if n_tracked is None else int(n_tracked)
        if n_tracked is not None and (isinstance(n_tracked, bool) or n != n_tracked):
            raise NotebookError(f"n_tracked={n_tracked!r}: give a whole number of tracked types")
        ts = select_tracked(counts, n, bos_id, decode=decode, meta=meta) if n > 0 else None
    if ts is None or ts.n == 0:
        raise NotebookError("the tracked set is empty: give n_tracked >= 1 (and windows holding tokens other than BOS) "
                            "or a non-empty tracked=")
    absent = [int(i) for i in ts.type_ids if int(i) < len(counts) and counts[int(i)] == 0]
    if absent:  # no key of the type: its mean value μ_t is undefined, and 0 x NaN would reach every mean field
        raise NotebookError(f"tracked= holds {len(absent)} types that never occur in these windows "
                            f"({', '.join(repr(decode(i)) for i in absent[:5])}{', ...' if len(absent) > 5 else ''}): "
                            "their mean values are undefined; leave them out or give texts holding them")
    if ts.bos_id != bos_id:
        raise NotebookError(f"the tracked set's BOS id is {ts.bos_id}, the windows start with {bos_id}: it belongs to "
                            "another tokenizer")
    return ts


def _tracked_id(tokenizer, t, vocab_size: int) -> int:
    """The id of one entry of ``tracked=``: a token string of the tokenizer or an id below ``vocab_size``."""
    if isinstance(t, str):
        if tokenizer is None:
            raise NotebookError(f"tracked= holds the token {t!r}: token strings need tokenizer=, or give ids")
        tid = tokenizer.convert_tokens_to_ids(t)
        if tid is None or (tid == getattr(tokenizer, "unk_token_id", None) and t != tokenizer.unk_token):
            raise NotebookError(f"tracked= holds {t!r}, no token of the tokenizer: give its tokens as the tokenizer "
                                "spells them (tokenizer.convert_ids_to_tokens) or ids")
        return int(tid)
    if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= t < vocab_size:
        raise NotebookError(f"tracked= holds {t!r}: give token ids 0..{vocab_size - 1} or token strings")
    return int(t)


def collect_stats(model, tokens_or_texts, *, tokenizer=None, n_tracked: int | None = None, tracked=None,
                  context_length: int | None = None, batch_size: int = 8, device=None, progress: bool = True,
                  partial_mantissa_bits: int | None = None, name: str | None = None, revision: str | None = None):
    """The pass-1 statistics of ``model`` on ``tokens_or_texts``, as the pipeline's store has them (an in-memory
    :class:`xarray.Dataset`: ``P``, ``nbar``, ``centroid``, ``mu``, ... with the store's coordinates and attributes;
    ``source: in-memory`` and the windows' fingerprint as its corpus).

    ``tokens_or_texts``: texts (packed into ``context_length`` windows ``[BOS, t1 …]``, 128 by default, as the corpus
    stage packs a half), a ``[n, T]`` array of BOS-led token windows, or a list of such arrays (each summed as one
    shard, as the statistics jobs sum corpus shards). ``tracked``: a TrackedSet / tracked.json / token ids; else the
    top ``n_tracked`` types (1000) of the windows. ``partial_mantissa_bits``: round each shard's sums as the pipeline's
    ``stats.partial_mantissa_bits`` does. ``model``: a transformers causal LM or an nnsight TransformersModel (put in
    eval mode with eager attention, on ``device``, for the call). The provenance records the fingerprints of the
    model's weights and of the tokenizer (``weights_fingerprint``, ``tokenizer_fingerprint``:
    :mod:`mfpipe.notebook.identity`), so the other calls refuse another model of the same shape, another revision or
    another tokenizer.

    Example::

        ds = mfpipe.collect_stats(model, texts, tokenizer=tok, n_tracked=200, context_length=64)
        ds["P"].sel(layer=0, head=1)
    """
    from mfpipe.stats.partials import merge_sums, stored_form, with_derived
    from mfpipe.stats.shards import accumulate_shard
    from mfpipe.stats.store import finalize

    hf, tok = resolve_model(model, tokenizer)
    bos = bos_id_of(hf, tok)
    batch_size = positive_int("batch_size", batch_size)
    if partial_mantissa_bits is not None and (isinstance(partial_mantissa_bits, bool) or not isinstance(
            partial_mantissa_bits, (int, np.integer)) or not 1 <= partial_mantissa_bits <= 23):
        raise NotebookError(f"partial_mantissa_bits={partial_mantissa_bits!r}: give None (float32 partials) or a whole "
                            "number of mantissa bits 1..23")
    if context_length is None:
        context_length = min(DEFAULT_CONTEXT_LENGTH, int(getattr(hf.config, "max_position_embeddings", 0) or 1 << 30))
    elif positive_int("context_length", context_length) < 2:
        raise NotebookError("context_length=1: a window needs BOS and at least one token; give context_length >= 2")
    blocks = text_windows(tokens_or_texts, tok, bos, context_length)
    if len({b.shape[1] for b in blocks}) != 1:
        raise NotebookError(f"statistics need windows of one length, got {sorted({b.shape[1] for b in blocks})}; give "
                            "a [n, T] array or texts with context_length=")
    check_fits(hf, blocks)
    top = int(max(b.max() for b in blocks)) + 1
    # the tracked set's vocabulary as the corpus stage sizes it, the tokenizer's (its fingerprint holds it: a padded
    # embedding, Pythia's 50304 for 50277 tokens, gave another fingerprint than the run's); the config's without one
    vocab = len(tok) if tok is not None and top <= len(tok) else max(int(hf.config.vocab_size), top)
    ts = select_tracked_types(blocks, tok, bos, vocab, n_tracked=n_tracked, tracked=tracked)
    with prepared(hf, device) as adapter:
        parts = []
        for k, b in enumerate(blocks):
            sums = accumulate_shard(hf, adapter, b, ts, batch_size=batch_size, progress=progress,
                                    desc=f"stats {k + 1}/{len(blocks)}")
            parts.append(with_derived({key: stored_form(key, v, partial_mantissa_bits) for key, v in sums.items()
                                       if key != "resid_mid_sum"}))
        meta = _provenance(hf, adapter, blocks, name, revision, partial_mantissa_bits)
    meta.update(identity_attrs(hf, tok))  # what mean_field, substitute, context_deviation and decode check
    return finalize(merge_sums(parts), ts, meta)


def _provenance(hf, adapter, blocks: Sequence[np.ndarray], name, revision, bits) -> dict:
    """The store's provenance for an in-memory run: the model (its name or path, the commit transformers records),
    the windows' fingerprint as the corpus, the adapter's shape and the numerics this process runs under."""
    from mfpipe.stats.shards import layer_head_dims
    from mfpipe.workflow.numerics import numerics_info

    cfg = hf.config
    model = name or getattr(cfg, "_name_or_path", "") or type(hf).__name__
    meta = {"model": model, "revision": revision or getattr(cfg, "_commit_hash", None) or "in-memory",
            "half": "in-memory", "source": "in-memory (mfpipe.collect_stats)", "model_source": model,
            "corpus": "in-memory", "corpus_fingerprint": tokens_fingerprint(list(blocks)), "n_shards": len(blocks),
            "model_type": adapter.model_type, "dtype": str(adapter.dtype).replace("torch.", ""),
            "n_kv_heads": adapter.n_kv_heads, "parallel_residual": adapter.parallel_residual,
            "numerics": numerics_info()} | layer_head_dims(adapter)  # layers of several head widths: each one's
    if getattr(adapter, "layer_kinds", None):  # a hybrid's layers of another mixer (the store's `layer_kind`)
        meta["layer_kinds"] = list(adapter.layer_kinds)
    if bits is not None:
        meta["partial_mantissa_bits"] = int(bits)
    return meta
