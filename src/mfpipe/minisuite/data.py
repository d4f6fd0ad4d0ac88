"""Training rows for the mini suite: the document stream and rows ``[BOS, text…]`` or ``[BOS, r, r, text…]``
(a random block repeated once, the induction task), with their loss masks (docs/conventions.md); with
``fewshot_fraction > 0`` also few-shot rows ``[BOS, x, sep, y, nl, x, sep, y, nl, …]`` of one task of
:mod:`mfpipe.minisuite.tasks` (loss on the answers ``y`` only), after step ``fewshot_start``."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class RowSampler:
    """Draws training rows (int64 ``[batch, T]``) and loss masks from a token stream."""

    def __init__(self, stream: np.ndarray, cfg: dict, vocab_size: int, special_ids, bos_id: int, rng,
                 fewshot: tuple[Sequence[np.ndarray], int, int] | None = None):
        """``fewshot``: the tasks' token pairs, separator id and joiner id (:func:`mfpipe.minisuite.tasks.task_token_pairs`),
        needed when ``cfg["fewshot_fraction"] > 0``."""
        self.stream = stream
        self.T = int(cfg["context_length"])
        if stream.size < self.T:
            raise ValueError(f"training stream has {stream.size} tokens, fewer than context_length {self.T}")
        self.cfg = cfg
        special = {int(s) for s in special_ids}
        self.allowed = np.array([t for t in range(vocab_size) if t not in special], dtype=np.int64)
        self.bos = int(bos_id)
        self.rng = rng
        self.fewshot_fraction = float(cfg.get("fewshot_fraction", 0.0))
        if self.fewshot_fraction > 0 and not fewshot:
            raise ValueError(f"fewshot_fraction {self.fewshot_fraction} needs the few-shot tasks (none given)")
        self.fewshot = fewshot

    def fewshot_rows(self, n: int, rng=None) -> tuple[np.ndarray, np.ndarray]:
        """``n`` few-shot rows and their masks: BOS, then pairs ``x, sep, y, nl`` of one task (uniform per row),
        each pair uniform over the task's pairs (with replacement), cut at the context length; the answers ``y``
        are the only loss targets (not the first one when ``cfg["fewshot_mask_first"]``: nothing names the task
        before it)."""
        rng = self.rng if rng is None else rng
        pairs, sep, nl = self.fewshot
        T = self.T
        n_pairs = -(-(T - 1) // 4)
        task = rng.integers(0, len(pairs), size=n)
        rows = np.empty((n, 1 + 4 * n_pairs), dtype=np.int64)
        rows[:, 0] = self.bos
        rows[:, 2::4] = sep
        rows[:, 4::4] = nl
        for i in range(n):
            p = pairs[int(task[i])]
            pick = p[rng.integers(0, p.shape[0], size=n_pairs)]
            rows[i, 1::4] = pick[:, 0]
            rows[i, 3::4] = pick[:, 1]
        mask = np.zeros(rows.shape, dtype=bool)
        mask[:, 3::4] = True
        if self.cfg.get("fewshot_mask_first", True):
            mask[:, 3] = False
        return rows[:, :T], mask[:, :T]

    def text_rows(self, n: int, rng=None) -> np.ndarray:
        rng = self.rng if rng is None else rng
        L = self.T - 1
        starts = rng.integers(0, self.stream.size - L + 1, size=n)
        rows = np.empty((n, self.T), dtype=np.int64)
        rows[:, 0] = self.bos
        rows[:, 1:] = self.stream[starts[:, None] + np.arange(L)[None, :]]
        return rows

    def sample(self, n: int, step: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """``n`` rows and masks for optimizer step ``step`` (1-based; None: few-shot rows regardless of
        ``fewshot_start``)."""
        cfg, rng, T = self.cfg, self.rng, self.T
        rows = self.text_rows(n)
        mask = np.ones((n, T), dtype=bool)  # mask[:, j]: token j is a loss target
        mask[:, 0] = False
        is_rep = rng.random(n) < float(cfg["repeat_fraction"])
        ks = rng.integers(int(cfg["repeat_min"]), int(cfg["repeat_max"]) + 1, size=n)
        for i in np.flatnonzero(is_rep):
            k = int(ks[i])
            r = self.allowed[rng.integers(0, self.allowed.size, size=k)]
            # keep the text tail: shift the text right by 2k and put [r, r] in front
            rows[i, 1 + 2 * k :] = rows[i, 1 : T - 2 * k]
            rows[i, 1 : 1 + k] = r
            rows[i, 1 + k : 1 + 2 * k] = r
            if cfg["mask_first_copy"]:
                mask[i, 1 : 1 + k] = False
        if self.fewshot_fraction > 0 and (step is None or step > int(cfg.get("fewshot_start", 0))):
            # drawn after the rest, only from step fewshot_start + 1 on: until then (and with fraction 0) the rows
            # are those of a run without tasks, bit for bit; they replace rows of either kind, so the repeat rows
            # keep their share of the rest
            is_fs = np.flatnonzero(rng.random(n) < self.fewshot_fraction)
            if is_fs.size:
                rows[is_fs], mask[is_fs] = self.fewshot_rows(is_fs.size)
        return rows, mask


def token_stream(tokenizer, texts: Sequence[str], sep_id: int) -> np.ndarray:
    enc = tokenizer(list(texts), add_special_tokens=False)["input_ids"]
    parts = []
    for ids in enc:
        if ids:
            parts.append(np.asarray(ids, dtype=np.int32))
            parts.append(np.array([sep_id], dtype=np.int32))
    if not parts:
        raise ValueError("no training tokens")
    return np.concatenate(parts)
