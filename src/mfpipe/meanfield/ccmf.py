"""The context-conditional mean field (paper Sec. 3.2 eq:ctx-kernel / eq:ccmf, App. A eq:w-def-appendix).

For a query of type ``s`` at position ``j`` of a window, its context ``X_j`` is the causal prefix
``0..j`` (docs/conventions.md), ``n_t(X_j)`` the number of its keys in bucket ``t`` (tracked types,
``<bos>``, ``<other>``), and, per layer and head,

    Â_stX = n_t(X) W_st / Σ_t' n_t'(X) W_st'          (eq:w-def-appendix; N_X = the denominator)
    ẑ_sX  = Σ_t Â_stX μ_t                              (eq:ccmf)

with ``W = P / nbar`` on the ``C_st >= min_count`` support (0 elsewhere; :meth:`MeanFieldStats.W`) and
``μ_t`` the head's mean value of bucket ``t`` (head space, before the output projection).

The BOS and ``<other>`` columns are treated like any key type, as the paper does: ``<bos>`` is one key in
every context (n = 1) with its own W column and μ (the sink), ``<other>`` pools the untracked positions of
the prefix under one W column and one mean value. The query's own position is part of its context.

Two equivalent forms, one definition (tests tie them together and to a per-position loop):

* :func:`type_kernel` — Â itself, ``[B, T, H, K]``, from the dense prefix counts
  (:func:`mfpipe.stats.buckets.prefix_counts`) and a gather of W rows; memory ``B T H K``.
* :func:`pair_kernel` — the same weights spread over key *positions*: ``a[h, b, j, k] = W[h, s_j, kb_k] / N_X``
  for ``k <= j``, an attention-shaped ``[H, B, T, T]`` (Â_stX is its sum over the positions of bucket t).
  ẑ is then one batched matmul with the per-position mean values, like attention itself; memory ``H B T²``,
  independent of N. :func:`ccmf_reads` uses this form.

What the substitution and pass 2 run is a third form, :func:`mfpipe.meanfield.plan.ccmf_rows`: Â per key type at
the query rows only, ``[H, B, rows, U]`` with U the distinct buckets of the prefix (T / U times less work than the
pair form); tests tie it to :func:`ccmf_reads` and both to a per-position loop.

ẑ depends on the token types of the prefix only (not on the residual stream, not on the order of the prefix:
``Δẑ_perm = 0``), so one computation serves the clean and the substituted forward.

A query position is *substituted* (``valid``) when its type is tracked and its W row has mass in the prefix
(``N_X > 0`` and finite; a type never seen as a query in the statistics half has a NaN row). Elsewhere ẑ is 0
and callers keep the model's own read.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["pair_kernel", "type_kernel", "ccmf_reads", "ZHAT_CHUNK_ELEMENTS"]

# pair_kernel builds H*B*T*T weights at once; ccmf_reads splits the batch so one chunk stays below this
ZHAT_CHUNK_ELEMENTS = 1 << 26


def _kernel_rows(W: Tensor, qt: Tensor) -> tuple[Tensor, Tensor]:
    """(W rows of each position's query type [H, B, T, K] (zeros where not a query), query mask [B, T])."""
    q = qt >= 0
    rows = W[:, qt.clamp(min=0)]  # [H, B, T, K]
    return rows.masked_fill(~q[None, :, :, None], 0.0), q


def pair_kernel(W: Tensor, kb: Tensor, qt: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Â spread over key positions, for every query position of a batch.

    ``W [H, N, K]`` one layer's kernel (float; NaN rows allowed), ``kb [B, T]`` key buckets, ``qt [B, T]`` query
    types (-1: not a query), as from :func:`mfpipe.stats.buckets.window_buckets`.

    Returns ``(a [H, B, T, T], N_X [H, B, T], valid [B, T])``: ``a[h, b, j, k] = W[h, s_j, kb[b, k]] / N_X`` for
    ``k <= j`` (0 above the diagonal and at invalid rows), ``N_X = Σ_{k<=j} W[h, s_j, kb[b, k]]`` (the
    normalizer of eq:w-def-appendix; NaN / 0 where the row is empty), ``valid``: a query with finite, positive
    ``N_X`` in every head.
    """
    H, N, K = W.shape
    B, T = kb.shape
    q = qt >= 0
    # w[h, b, j, k] = W[h, s_j, kb_k]: a gather of the query type's row at the key positions' buckets
    idx = (qt.clamp(min=0) * K)[:, :, None] + kb[:, None, :]  # [B, T, T]
    w = W.reshape(H, N * K)[:, idx.reshape(-1)].reshape(H, B, T, T)
    causal = torch.ones(T, T, dtype=torch.bool, device=W.device).tril()
    w = w.masked_fill(~causal, 0.0)
    nx = w.sum(-1)  # [H, B, T]
    valid = q & torch.isfinite(nx).all(0) & (nx > 0).all(0)
    safe = torch.where(valid[None], nx, torch.ones_like(nx))
    a = (w / safe[..., None]).masked_fill(~valid[None, :, :, None], 0.0)
    return a, nx, valid


def type_kernel(W: Tensor, counts: Tensor, qt: Tensor) -> tuple[Tensor, Tensor]:
    """Â_stX per key type: ``[B, T, H, K]`` and ``valid [B, T]``.

    ``counts [B, T, K]`` are the prefix counts n_t(X_j) (:func:`mfpipe.stats.buckets.prefix_counts`).
    Rows of invalid positions are 0. Memory ``B T H K``: for tests and per-type analyses; the substitution
    uses the type-space plan (:meth:`mfpipe.meanfield.kernel.MeanFieldKernel.zhat`), the calibration and the
    deviation forward :func:`pair_kernel`.
    """
    rows, q = _kernel_rows(W, qt)  # [H, B, T, K]
    num = rows * counts.to(W.dtype)[None]
    nx = num.sum(-1)  # [H, B, T]
    valid = q & torch.isfinite(nx).all(0) & (nx > 0).all(0)
    safe = torch.where(valid[None], nx, torch.ones_like(nx))
    a = (num / safe[..., None]).masked_fill(~valid[None, :, :, None], 0.0)
    return a.permute(1, 2, 0, 3), valid


def ccmf_reads(W: Tensor, mu: Tensor, kb: Tensor, qt: Tensor, max_elements: int = ZHAT_CHUNK_ELEMENTS) -> tuple[Tensor, Tensor]:
    """ẑ_sX for every query position of a batch, one layer: ``([B, T, H, dh], valid [B, T])``.

    ``W [H, N, K]``, ``mu [H, K, dh]`` (the head's mean value per bucket, incl. ``<bos>`` and ``<other>``),
    ``kb``/``qt [B, T]``. Vectorized over the batch (chunks of windows keep ``H*b*T*T <= max_elements``).
    ẑ is 0 where not ``valid``.
    """
    H, N, K = W.shape
    B, T = kb.shape
    if mu.shape[:2] != (H, K):
        raise ValueError(f"mu has shape {tuple(mu.shape)}, expected [H={H}, K={K}, dh]")
    step = max(1, int(max_elements) // max(1, H * T * T))
    zs, vs = [], []
    for b0 in range(0, B, step):
        kbc, qtc = kb[b0 : b0 + step], qt[b0 : b0 + step]
        a, _, valid = pair_kernel(W, kbc, qtc)
        vbar = mu[:, kbc]  # [H, b, T, dh]: each key position's bucket mean value
        z = torch.matmul(a, vbar)  # [H, b, T, dh]
        zs.append(z.permute(1, 2, 0, 3))
        vs.append(valid)
    return torch.cat(zs), torch.cat(vs)
