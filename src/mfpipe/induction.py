"""Induction-head scores (paper Sec. 6.1 Exp. 3; TransformerLens convention).

Test sequences are ``[BOS, r1..rk, r1..rk]`` with ``r`` drawn uniformly from the vocabulary
minus the special tokens. For each query position ``i`` in the second copy the induction target
is the position right after the first occurrence of the same token, ``i - k + 1``; a head's score
is its attention weight on that target, averaged over the ``k`` second-copy positions and over
sequences. Sequences are never longer than the context length: ``k = (context_length - 1) // 2``
(``context_length // 2`` when there is no BOS).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

__all__ = ["induction_metrics", "induction_scores", "induction_targets", "repeated_random_tokens", "induction_window",
           "training_window"]


def _allowed_ids(vocab_size: int, special_ids: Iterable[int] | None) -> np.ndarray:
    special = {int(s) for s in (special_ids or []) if s is not None}
    allowed = np.array([t for t in range(int(vocab_size)) if t not in special], dtype=np.int64)
    if allowed.size == 0:
        raise ValueError("no non-special token ids to draw from")
    return allowed


def repeated_random_tokens(
    n_sequences: int,
    k: int,
    vocab_size: int,
    special_ids: Iterable[int] | None = None,
    bos_id: int | None = None,
    seed: int | np.random.Generator = 0,
) -> np.ndarray:
    """Return int64 ``[n_sequences, (bos_id is not None) + 2k]`` rows ``[BOS, r, r]``.

    ``r`` (length ``k``) is drawn uniformly (with replacement) from ``range(vocab_size)`` minus
    ``special_ids``. Without a ``bos_id`` the rows are ``[r, r]``.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    allowed = _allowed_ids(vocab_size, special_ids)
    r = allowed[rng.integers(0, allowed.size, size=(int(n_sequences), int(k)))]
    parts = [r, r]
    if bos_id is not None:
        parts.insert(0, np.full((int(n_sequences), 1), int(bos_id), dtype=np.int64))
    return np.concatenate(parts, axis=1)


def induction_targets(k: int, offset: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Query positions of the second copy and their induction targets (``i - k + 1``).

    ``offset`` is the number of tokens before the first copy (1 with BOS, 0 without).
    """
    q = np.arange(offset + k, offset + 2 * k)
    return q, q - k + 1


def _default_bos(model) -> int | None:
    cfg = getattr(model, "config", None)
    bos = getattr(cfg, "bos_token_id", None)
    if isinstance(bos, (list, tuple)):
        bos = bos[0] if bos else None
    return None if bos is None else int(bos)


def induction_scores(*args, **kwargs) -> np.ndarray:
    """Induction score of every head: float64 ``[n_layer, n_head]``; the arguments are
    :func:`induction_metrics`'s.

    Works for any supported HF causal LM with eager attention (load or build it with
    ``attn_implementation="eager"``), or its :class:`~mfpipe.models.adapters.Adapter`.
    ``vocab_size`` is the number of ids to draw from (the tokenizer's, which may be smaller than the
    embedding matrix); ``special_ids`` are excluded. ``bos_id="auto"`` takes
    ``model.config.bos_token_id`` (and also excludes it from the draw); ``None`` means no BOS prefix.
    The same ``seed`` gives the same test sequences, so scores at different checkpoints are comparable.
    """
    return induction_metrics(*args, **kwargs)[0]


def induction_metrics(
    model,
    vocab_size: int,
    special_ids: Iterable[int] | None,
    context_length: int,
    n_sequences: int = 64,
    seed: int = 0,
    *,
    bos_id: int | None | str = "auto",
    batch_size: int = 16,
) -> tuple[np.ndarray, float]:
    """:func:`induction_scores` plus the in-context loss on the same sequences: the mean
    next-token cross entropy (nats) of predicting ``r2..rk`` inside the second copy, which only an
    in-context (induction) mechanism can bring below ``log(#allowed ids)``.

    ``model`` is an HF causal LM or its adapter (pass the adapter when calling repeatedly, e.g. during
    training, so the model is wrapped for tracing once). The attention probabilities are read through
    the adapter's site (:meth:`~mfpipe.models.adapters.Adapter.run`, only ``attn_probs`` selected);
    the loss is NaN when the adapter has no LM head (built on a bare base model). The model is put in
    eval mode for the measurement and returned to its previous mode.
    """
    import torch

    from mfpipe.models.adapters import Adapter, get_adapter

    adapter = model if isinstance(model, Adapter) else get_adapter(model)
    model = adapter.model
    if bos_id == "auto":
        bos_id = _default_bos(model)
    offset = 0 if bos_id is None else 1
    k = (int(context_length) - offset) // 2
    if k < 2:
        raise ValueError(f"context_length {context_length} too short for induction sequences")
    specials = set(int(s) for s in (special_ids or []) if s is not None)
    if bos_id is not None:
        specials.add(int(bos_id))
    tokens = repeated_random_tokens(n_sequences, k, vocab_size, specials, bos_id, seed)
    q_np, tgt_np = induction_targets(k, offset)
    q, tgt = torch.as_tensor(q_np), torch.as_tensor(tgt_np)
    # positions of the second copy that predict a token of the second copy (r2..rk)
    pred_pos = torch.as_tensor(q_np[:-1])

    total = np.zeros((adapter.n_layers, adapter.n_heads))
    loss_sum = 0.0

    def score_layer(cap) -> None:
        # [batch, head, q, k] -> attention on the induction target, summed over sequences and queries
        total[cap.layer] += cap.attn_probs[:, :, q, tgt].sum(dim=(0, 2)).double().cpu().numpy()

    was_training = model.training
    model.eval()
    try:
        for start in range(0, tokens.shape[0], int(batch_size)):
            ids = torch.from_numpy(tokens[start : start + int(batch_size)])
            res = adapter.run(ids, select=("attn_probs",), on_layer=score_layer, logits=adapter.has_lm_head)
            if res.logits is not None:
                lp = torch.log_softmax(res.logits[:, pred_pos], dim=-1)
                nxt = ids.to(lp.device)[:, pred_pos + 1]
                loss_sum += float(-lp.gather(-1, nxt[..., None]).sum())
    finally:
        model.train(was_training)
    loss = loss_sum / (tokens.shape[0] * (k - 1)) if adapter.has_lm_head else float("nan")
    return total / (tokens.shape[0] * k), loss


# ------------------------------------------------------------------ the induction window of a training run
DEFAULT_BAND = (0.1, 0.8)


def induction_window(curve, band: tuple[float, float] = DEFAULT_BAND) -> tuple[float, float] | None:
    """The training steps over which induction heads form, from a recorded induction-score curve (a mini
    model's ``training.json`` ``induction_curve``: records with ``step`` and ``max_induction``).

    ``[last step before the best head's score first reaches band[0], first step it reaches band[1]]``: the
    interval that contains the rise, bounded by recorded points. None when the curve never reaches ``band[1]``
    (no induction head formed) or is empty."""
    pts = sorted((int(r["step"]), float(r["max_induction"])) for r in curve)
    lo, hi = float(band[0]), float(band[1])
    end = next((s for s, v in pts if v >= hi), None)
    if end is None:
        return None
    start_i = next(i for i, (s, v) in enumerate(pts) if v >= lo)
    start = pts[max(start_i - 1, 0)][0]
    return float(start), float(end)


def training_window(window=None, training_json=None, band: tuple[float, float] = DEFAULT_BAND
                    ) -> tuple[float, float] | None:
    """The shaded induction window of the training figures: the configured ``[start, stop]`` (a model's
    ``induction_window``, e.g. Pythia's steps 1000-2000) when given, else from a mini model's recorded curve
    (``training_json``: path of its ``training.json``), else None."""
    if window:
        a, b = (float(x) for x in window)
        return a, b
    if training_json:
        import json
        from pathlib import Path

        rec = json.loads(Path(training_json).read_text())
        return induction_window(rec.get("induction_curve") or rec.get("checkpoints") or [], band)
    return None
