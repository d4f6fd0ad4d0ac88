"""Sums pass 1 derives instead of summing per position: a statistic that is an affine map of another one's rows,
``y = x W + b``, has bucket sums ``(sum x) W + n b`` (n: the bucket's positions). The per-head values are such a
map of the attention-input norm's output (``Adapter.value_weights``); the attention output, where no norm follows
the output projection, of the per-head reads (``Adapter.attn_out_weights``). Computed once per shard in float64."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from .errors import StatsError

Weights = Callable[[int], tuple[torch.Tensor, torch.Tensor | None]]


def check_layout(weights: Weights, name: str, w_shape: tuple, b_shape: tuple, advice: str) -> None:
    """Refuse ``weights(0)`` of another layout than ``W w_shape`` / ``b b_shape`` before a shard's forward passes
    (``name`` and ``advice`` go into the message)."""
    w, b = weights(0)
    if tuple(w.shape) != w_shape or (b is not None and tuple(b.shape) != b_shape):
        raise StatsError(f"{name}(0) gives W {tuple(w.shape)} and b {None if b is None else tuple(b.shape)}, expected "
                         f"W {w_shape} and b {b_shape}: {advice}")


def affine_sums(x_sums: np.ndarray, w: torch.Tensor, b: torch.Tensor | None, counts: np.ndarray) -> np.ndarray:
    """``(sum x) W + n b``: bucket sums ``x_sums [K, din]`` of ``counts [K]`` rows each through ``w [din, dout]`` and
    ``b [dout]`` (or None), in float64 (one matmul, torch's: numpy's BLAS starts threads of its own, which after the
    forward contend with torch's still-spinning ones: a mini layer's 0.35 ms took 1.8 ms, torch's 0.6 ms)."""
    out = (torch.from_numpy(np.ascontiguousarray(x_sums, dtype=np.float64))
           @ w.detach().to("cpu", torch.float64)).numpy()
    if b is not None:
        out += counts[:, None] * b.detach().to("cpu", torch.float64).numpy()[None, :]
    return out


def value_sums(ln_in: np.ndarray, weights: Weights, key_count: np.ndarray, H: int, dh: int) -> np.ndarray:
    """[L,H,K,dh] per-head value sums from the norm's sums ``ln_in [L,K,d]`` and ``weights(l)`` = (W [H,d,dh],
    b [H,dh] | None)."""
    L, K, d = ln_in.shape
    out = []
    for l in range(L):
        w, b = weights(l)
        if tuple(w.shape) != (H, d, dh):
            raise StatsError(f"value_weights({l}) has shape {tuple(w.shape)}, expected {(H, d, dh)}")
        v = affine_sums(ln_in[l], w.permute(1, 0, 2).reshape(d, H * dh), None if b is None else b.reshape(H * dh),
                        key_count)
        out.append(v.reshape(K, H, dh).transpose(1, 0, 2))
    return np.stack(out)


def attn_out_sums(reads: np.ndarray, weights: Weights, key_count: np.ndarray) -> np.ndarray:
    """[L,K,d] attention-output sums from the read sums ``reads [L,K,H*dh]`` (head-major) and ``weights(l)`` =
    (W [H,dh,d], b [d] | None)."""
    out = []
    for l in range(reads.shape[0]):
        w, b = weights(l)
        out.append(affine_sums(reads[l], w.reshape(-1, w.shape[-1]), b, key_count))
    return np.stack(out)
