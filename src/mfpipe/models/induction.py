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
           "training_window", "induction_summary", "as_adapter", "probe_sequences", "attention_on_targets"]


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

    adapter = as_adapter(model)
    tokens, k, offset = probe_sequences(adapter, vocab_size, special_ids, context_length, n_sequences, seed, bos_id)
    q, tgt = induction_targets(k, offset)
    # positions of the second copy that predict a token of the second copy (r2..rk)
    pred_pos = torch.as_tensor(q[:-1])
    loss_sum = 0.0

    def add_loss(ids, logits) -> None:
        nonlocal loss_sum
        lp = torch.log_softmax(logits[:, pred_pos], dim=-1)
        nxt = ids.to(lp.device)[:, pred_pos + 1]
        loss_sum += float(-lp.gather(-1, nxt[..., None]).sum())

    scores = attention_on_targets(adapter, tokens, q, tgt[None], batch_size,
                                  on_logits=add_loss if adapter.has_lm_head else None)[0]
    loss = loss_sum / (tokens.shape[0] * (k - 1)) if adapter.has_lm_head else float("nan")
    return scores, loss


def as_adapter(model):
    """``model`` itself when it is an :class:`~mfpipe.models.adapters.Adapter`, else its adapter."""
    from mfpipe.models.adapters import Adapter, get_adapter

    return model if isinstance(model, Adapter) else get_adapter(model)


def probe_sequences(adapter, vocab_size: int, special_ids: Iterable[int] | None, context_length: int,
                    n_sequences: int, seed: int, bos_id: int | None | str = "auto") -> tuple[np.ndarray, int, int]:
    """The repeated random test sequences of every attention probe: ``(tokens, k, offset)`` with
    ``tokens`` from :func:`repeated_random_tokens`, ``k = (context_length - offset) // 2`` and ``offset``
    1 with a BOS prefix (``bos_id="auto"``: the model config's), 0 without. The BOS is excluded from the draw."""
    if bos_id == "auto":
        bos_id = _default_bos(adapter.model)
    offset = 0 if bos_id is None else 1
    k = (int(context_length) - offset) // 2
    if k < 2:
        raise ValueError(f"context_length {context_length} too short for induction sequences")
    specials = set(int(s) for s in (special_ids or []) if s is not None)
    if bos_id is not None:
        specials.add(int(bos_id))
    return repeated_random_tokens(n_sequences, k, vocab_size, specials, bos_id, seed), k, offset


def attention_on_targets(adapter, tokens: np.ndarray, queries: np.ndarray, targets: np.ndarray,
                         batch_size: int = 16, on_logits=None) -> np.ndarray:
    """Every head's attention weight from each query position to its target position, averaged over
    the queries and the sequences: float64 ``[n_targets, n_layers, n_heads]``.

    ``queries``: ``[n_q]`` positions; ``targets``: ``[n_targets, n_q]``, one row per kind of target
    (so several scores come from one forward per batch). ``on_logits(ids, logits)``, when given, is
    called with each batch's logits (the forward then computes them). The model is put in eval mode
    for the measurement and returned to its previous mode."""
    import torch

    targets = np.asarray(targets)
    if targets.ndim != 2 or targets.shape[1] != len(queries):
        raise ValueError(f"targets must be [n_targets, {len(queries)}], got {targets.shape}")
    q_np, t_np = np.asarray(queries), targets
    total = np.zeros((targets.shape[0], adapter.n_layers, adapter.n_heads))

    def add_layer(cap) -> None:
        probs = cap.attn_probs  # [batch, head, query, key]
        if probs is None:  # a hybrid's layer of another mixer: no attention, no score (NaN)
            total[:, cap.layer] = np.nan
            return
        q = torch.as_tensor(q_np, device=probs.device)
        t = torch.as_tensor(t_np, device=probs.device)
        # one gather for every target kind: [batch, head, n_targets, n_q], summed over sequences and queries
        total[:, cap.layer] += probs[:, :, q, t].double().sum(dim=(0, 3)).T.cpu().numpy()

    model = adapter.model
    was_training = model.training
    model.eval()
    try:
        for start in range(0, tokens.shape[0], int(batch_size)):
            ids = torch.from_numpy(tokens[start : start + int(batch_size)])
            res = adapter.run(ids, select=("attn_probs",), on_layer=add_layer, logits=on_logits is not None)
            if on_logits is not None:
                on_logits(ids, res.logits)
    finally:
        model.train(was_training)
    return total / (tokens.shape[0] * len(q_np))


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


def induction_summary(induction_csvs) -> "pd.DataFrame":  # noqa: F821 (pandas is imported where the table is made)
    """Max-over-heads induction score per model and checkpoint step (and where it is), from the training runs'
    induction CSVs (:func:`induction_metrics` rows)."""
    import pandas as pd

    df = pd.concat([pd.read_csv(p) for p in induction_csvs], ignore_index=True)
    idx = df.groupby(["model", "step"])["score"].idxmax()
    best = df.loc[idx, ["model", "step", "layer", "head", "score"]].rename(columns={"score": "max_score"})
    return best.sort_values(["model", "step"]).reset_index(drop=True)
