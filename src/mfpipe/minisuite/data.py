"""Training rows for the mini suite: the document stream and rows ``[BOS, text…]`` or ``[BOS, r, r, text…]``
(a random block repeated once, the induction task), with their loss masks (docs/conventions.md)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class RowSampler:
    """Draws training rows (int64 ``[batch, T]``) and loss masks from a token stream."""

    def __init__(self, stream: np.ndarray, cfg: dict, vocab_size: int, special_ids, bos_id: int, rng):
        self.stream = stream
        self.T = int(cfg["context_length"])
        if stream.size < self.T:
            raise ValueError(f"training stream has {stream.size} tokens, fewer than context_length {self.T}")
        self.cfg = cfg
        special = {int(s) for s in special_ids}
        self.allowed = np.array([t for t in range(vocab_size) if t not in special], dtype=np.int64)
        self.bos = int(bos_id)
        self.rng = rng

    def text_rows(self, n: int, rng=None) -> np.ndarray:
        rng = self.rng if rng is None else rng
        L = self.T - 1
        starts = rng.integers(0, self.stream.size - L + 1, size=n)
        rows = np.empty((n, self.T), dtype=np.int64)
        rows[:, 0] = self.bos
        rows[:, 1:] = self.stream[starts[:, None] + np.arange(L)[None, :]]
        return rows

    def sample(self, n: int) -> tuple[np.ndarray, np.ndarray]:
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
