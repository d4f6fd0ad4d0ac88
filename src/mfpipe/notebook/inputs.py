"""What the notebook API takes, checked once: the model (a ``transformers`` causal LM or an nnsight
``TransformersModel``, or the ``LanguageModel`` nnsight 0.8 deprecates for it), its tokenizer, the token windows
(texts tokenized and BOS-led as the pipeline does, or token ids) and the statistics (an in-memory Dataset, a store on
disk or an opened store). Bad input raises :class:`NotebookError` with one line saying what is wrong and what to do,
never a traceback of numpy, torch or the adapter."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["NotebookError", "resolve_model", "prepared", "bos_id_of", "text_windows", "token_windows", "by_length",
           "in_input_order", "check_fits", "as_stats", "check_stats", "tokens_fingerprint", "token_strings",
           "positive_int", "MODEL_CLASSES"]

# what the errors name as the model a call takes (nnsight 0.8 deprecates LanguageModel for TransformersModel)
MODEL_CLASSES = "a transformers causal LM (AutoModelForCausalLM.from_pretrained(...)) or nnsight.TransformersModel(...)"


class NotebookError(ValueError):
    """Bad input to the notebook API (the message says what to change)."""


def resolve_model(model, tokenizer=None) -> tuple[Any, Any]:
    """``(hf_model, tokenizer)`` of a ``transformers`` causal LM or an nnsight ``TransformersModel`` / ``LanguageModel``
    / ``NNsight`` wrapper (its wrapped module; its tokenizer unless one is given; weights loaded if it was created
    without them)."""
    inner = getattr(model, "_module", None)
    if inner is not None and type(model).__module__.startswith("nnsight"):
        if getattr(model, "dispatched", True) is False:
            model.dispatch()  # a TransformersModel made without its weights (meta tensors) loads them now
            inner = model._module
        tokenizer = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
        model = inner
    if getattr(getattr(model, "config", None), "model_type", None) is None or not hasattr(model, "forward"):
        raise NotebookError(f"{type(model).__name__} is not a transformers causal LM or an nnsight TransformersModel; "
                            f"pass {MODEL_CLASSES}")
    if tokenizer is not None and not callable(getattr(tokenizer, "decode", None)):
        raise NotebookError(f"tokenizer= is a {type(tokenizer).__name__}, not a tokenizer: pass "
                            "AutoTokenizer.from_pretrained(...) (the model's)")
    return model, tokenizer


def positive_int(name: str, value, allow_none: bool = False):
    """``value`` as an int >= 1 (None kept where ``allow_none``), else a NotebookError naming ``name``."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise NotebookError(f"{name}={value!r}: give a whole number >= 1")
    return int(value)


@contextmanager
def prepared(model, device=None) -> Iterator[Any]:
    """The adapter of ``model`` (placed by structure, :func:`mfpipe.models.adapters.get_adapter`: a model it cannot
    place raises its one-line error naming what did not match and ``mfpipe conformance``) with the model in eval
    mode, eager attention and on ``device``; all three are put back as they were on exit. A device that does not
    exist here or a model the adapter cannot place is one NotebookError line."""
    import torch

    from mfpipe.models.adapters import UnsupportedArchitectureError, get_adapter

    was_training = model.training
    impl = getattr(model.config, "_attn_implementation", None)
    home = next(model.parameters()).device
    if device is not None:
        _check_device(device)
    try:
        model.eval()
        if impl != "eager":
            model.set_attn_implementation("eager")  # the read site reads the attention probabilities
        if device is not None and torch.device(device) != home:
            model.to(device)
        try:
            adapter = get_adapter(model)
        except UnsupportedArchitectureError as e:
            raise NotebookError(f"mfpipe cannot analyse this {type(model).__name__}: {e}") from None
        yield adapter
    finally:
        if device is not None and torch.device(device) != home:
            model.to(home)
        if impl not in (None, "eager"):
            model.set_attn_implementation(impl)
        model.train(was_training)


def _check_device(device) -> None:
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise NotebookError(f"device={device!r} is no torch device ({e}): give e.g. 'cpu' or 'cuda:0'") from None
    cuda = torch.cuda.is_available() and (dev.index or 0) < torch.cuda.device_count()
    ok = {"cpu": True, "meta": False, "cuda": cuda, "mps": torch.backends.mps.is_available()}.get(dev.type, True)
    if not ok:
        raise NotebookError(f"device={device!r} is not available on this machine: give 'cpu' or a device that is "
                            "(torch.cuda.is_available())")


def bos_id_of(model, tokenizer, stats=None) -> int:
    """The id every window starts with: the statistics' (``bos_id``), else the tokenizer's as the corpus stage resolves
    it (BOS, else EOS), else the model config's."""
    if stats is not None and stats.attrs.get("bos_id") is not None:
        return int(stats.attrs["bos_id"])
    if tokenizer is not None:
        from mfpipe.corpus.windows import resolve_bos_id

        return resolve_bos_id(tokenizer)
    for tid in (getattr(model.config, "bos_token_id", None), getattr(model.config, "eos_token_id", None)):
        if isinstance(tid, int):
            return tid
    raise NotebookError("no BOS id: pass tokenizer= (its BOS or EOS token starts every window)")


def _is_texts(x) -> bool:
    return isinstance(x, str) or (isinstance(x, Sequence) and len(x) > 0 and all(isinstance(t, str) for t in x))


def _tokenize(tokenizer, texts: Sequence[str]) -> list[list[int]]:
    if tokenizer is None:
        raise NotebookError("texts need a tokenizer: pass tokenizer= (an nnsight TransformersModel brings its own)")
    from mfpipe.corpus.windows import tokenize_documents

    return tokenize_documents(tokenizer, list(texts))


def text_windows(x, tokenizer, bos_id: int, context_length: int | None) -> list[np.ndarray]:
    """Windows ``[BOS, t1 …]`` of texts or token ids. Texts: each text is one window (``context_length`` None) or, as
    the corpus stage packs a half, all texts concatenated and cut into ``context_length`` windows; token ids: a
    ``[n, T]`` array, a list of such arrays, one sequence of ids or a list of sequences, each row checked to start
    with ``bos_id``. Returns a list of 2-D int arrays (one per given array; windows of one length each)."""
    if _is_texts(x):
        ids = _tokenize(tokenizer, [x] if isinstance(x, str) else list(x))
        if context_length is not None:
            from mfpipe.corpus.windows import pack_windows

            windows, _ = pack_windows(ids, list(range(len(ids))), bos_id, int(context_length))
            if not len(windows.tokens):
                raise NotebookError(f"the texts hold {sum(map(len, ids))} tokens, less than one window of "
                                    f"context_length={context_length}; give more text or a shorter context_length")
            return [windows.tokens.astype(np.int64)]
        empty = [i for i, t in enumerate(ids) if not len(t)]
        if empty:
            raise NotebookError(f"text #{empty[0]} holds no tokens: a window needs BOS and at least one token; "
                                "drop the empty texts")
        return [np.asarray([[bos_id, *t]], dtype=np.int64) for t in ids]
    if isinstance(x, Sequence) and any(isinstance(t, str) for t in x):
        raise NotebookError("the input mixes texts and token ids: give a list of texts or token ids, not both")
    return token_windows(x, bos_id)


def _as_array(b) -> np.ndarray:
    try:
        return np.asarray(b.detach().cpu().numpy() if hasattr(b, "detach") else b)
    except ValueError:  # numpy: a ragged nested list ("inhomogeneous shape")
        raise NotebookError("the windows are a ragged nested list: give a [n, T] array of one length, or a list of "
                            "1-D token-id sequences (one window each)") from None


def token_windows(x, bos_id: int) -> list[np.ndarray]:
    """Token-id windows as 2-D int64 arrays (see :func:`text_windows`), each row starting with ``bos_id``."""
    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    if isinstance(x, (str, bytes)) or not isinstance(x, (np.ndarray, Sequence)):
        raise NotebookError(f"cannot read windows from {type(x).__name__}: give texts, a [n, T] array of token ids "
                            "or a list of token-id sequences")
    if isinstance(x, Sequence) and not len(x):
        raise NotebookError("no windows: the list is empty; give texts or token ids")
    if isinstance(x, np.ndarray) or np.isscalar(x[0]):
        arr = _as_array(x)
        blocks = [arr[None] if arr.ndim == 1 else arr]
    else:
        blocks = [_as_array(b) for b in x]
        blocks = [b[None] if b.ndim == 1 else b for b in blocks]
    out = []
    for k, b in enumerate(blocks):
        if b.ndim != 2:
            raise NotebookError(f"windows #{k} have shape {b.shape}: give [n, T] token ids (a 2-D array) or 1-D "
                                "sequences")
        if b.size == 0:
            raise NotebookError(f"windows #{k} are empty (shape {b.shape}): give at least one window of BOS and a "
                                "token")
        if not np.issubdtype(b.dtype, np.integer):
            raise NotebookError(f"windows #{k} hold {b.dtype}, not integer token ids: give ids (e.g. .astype(int) of "
                                "whole numbers) or texts with tokenizer=")
        if b.min() < 0:
            i, j = (int(v[0]) for v in np.nonzero(b < 0))
            raise NotebookError(f"window {i} of #{k} holds token id {int(b[i, j])} at position {j}: ids are >= 0 "
                                "(-1 is the padding of results' token_id: drop it)")
        if b.shape[1] < 2:
            raise NotebookError(f"windows #{k} have length {b.shape[1]}: a window needs BOS and at least one token "
                                "(T >= 2)")
        bad = np.flatnonzero(b[:, 0] != bos_id)
        if bad.size:
            raise NotebookError(f"window {int(bad[0])} of #{k} starts with token {int(b[bad[0], 0])}, not BOS "
                                f"{bos_id}: windows are [BOS, t1 …]; prepend {bos_id} (texts get it added)")
        out.append(b.astype(np.int64))
    return out


def by_length(blocks: list[np.ndarray]) -> tuple[list[np.ndarray], np.ndarray]:
    """The windows of ``blocks`` regrouped by length (first appearance order; one forward batch has one length) and
    ``order``: the place in the input (``blocks`` concatenated) of each window of the groups concatenated, for
    :func:`in_input_order`."""
    groups: dict[int, list[np.ndarray]] = {}
    places: dict[int, list[np.ndarray]] = {}
    n = 0
    for b in blocks:
        groups.setdefault(b.shape[1], []).append(b)
        places.setdefault(b.shape[1], []).append(np.arange(n, n + len(b)))
        n += len(b)
    return [np.concatenate(g) for g in groups.values()], np.concatenate([np.concatenate(p) for p in places.values()])


def in_input_order(x: np.ndarray, order: np.ndarray) -> np.ndarray:
    """Rows of ``x`` (windows in :func:`by_length`'s group order) put back in the input's order."""
    out = np.empty_like(x)
    out[order] = x
    return out


def check_fits(model, blocks: list[np.ndarray]) -> None:
    """Refuse windows longer than the model's positions or holding ids outside its vocabulary (torch would fail deep in
    an embedding)."""
    cfg = model.config
    n_pos = getattr(cfg, "max_position_embeddings", None)
    T = max(b.shape[1] for b in blocks)
    if isinstance(n_pos, int) and T > n_pos:
        raise NotebookError(f"windows of {T} tokens exceed the {n_pos} positions of the model: give shorter texts or "
                            f"context_length <= {n_pos}")
    top = max(int(b.max()) for b in blocks)
    if isinstance(getattr(cfg, "vocab_size", None), int) and top >= cfg.vocab_size:
        raise NotebookError(f"token id {top} is outside the model's vocabulary of {cfg.vocab_size}: the tokens come from "
                            "another tokenizer")


def as_stats(stats):
    """A :class:`~mfpipe.stats.api.MeanFieldStats` of an in-memory Dataset (:func:`mfpipe.collect_stats`,
    ``mfpipe.open_results("stats", ...)``), a store path or an opened store."""
    import xarray as xr

    from mfpipe.stats.api import MeanFieldStats, open_stats

    if isinstance(stats, MeanFieldStats):
        return stats
    if isinstance(stats, xr.Dataset):
        if "P" not in stats or "mu" not in stats:
            raise NotebookError("this Dataset is not a statistics store (no P / mu): pass mfpipe.collect_stats(...) "
                                "or mfpipe.open_results('stats', model, revision)")
        return MeanFieldStats(stats)
    if isinstance(stats, (str, Path)):
        try:
            return open_stats(stats)
        except (OSError, ValueError) as e:  # missing, incomplete or not a statistics store: the reader's one line
            raise NotebookError(f"{e}; or pass mfpipe.collect_stats(model, texts)") from None
    raise NotebookError(f"statistics must be a Dataset, a store path or mfpipe.open_stats(...), not {type(stats).__name__}")


def check_stats(adapter, st, tracked=None) -> None:
    """Refuse statistics of another model (type, shape) or, where ``tracked`` (a TrackedSet or tracked.json) is given,
    of another tracked set."""
    from mfpipe.stats.api import ProvenanceError
    from mfpipe.stats.halves import check_model

    where = st.path or f"(in memory, model {st.attrs.get('model')!r})"
    try:
        check_model(adapter, st)
    except ProvenanceError as e:
        raise NotebookError(str(e).replace("statistics store None", f"statistics {where}")) from None
    if tracked is not None:
        from mfpipe.corpus.tracked import TrackedSet

        ts = tracked if isinstance(tracked, TrackedSet) else TrackedSet.load(tracked)
        have = st.attrs.get("tracked_fingerprint")
        if have != ts.fingerprint:
            raise NotebookError(f"statistics {where} were computed with tracked set {have!r}, not the given "
                                f"{ts.fingerprint!r} (N={ts.n}): pass the statistics of this tracked set")


def tokens_fingerprint(blocks: list[np.ndarray]) -> str:
    """A short fingerprint of the windows (provenance of every result)."""
    from mfpipe.corpus.windows import fingerprint_arrays

    return fingerprint_arrays(blocks)


def token_strings(tokenizer, ids: np.ndarray) -> np.ndarray:
    """The string of every id of ``ids`` (any shape; -1, padding, is ""), each distinct id decoded once (the tokenizer
    decodes one id at a time: a held-out sample of 100,000 tokens holds a few thousand distinct ones)."""
    ids = np.asarray(ids)
    uniq, inverse = np.unique(ids, return_inverse=True)
    names = np.asarray([("" if i < 0 else tokenizer.decode([int(i)]) if tokenizer is not None else str(int(i)))
                        for i in uniq], dtype=object)
    return names[inverse].reshape(ids.shape)
