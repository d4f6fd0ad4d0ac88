"""Sums pass 1 derives instead of summing per position (and the capture then does not read), computed once per
shard in float64 from the sums it does accumulate (:func:`position_sums`):

- A statistic that is an affine map of another one's rows, ``y = x W + b``, has bucket sums ``(sum x) W + n b`` (n:
  the bucket's positions). The per-head values are such a map of the attention-input norm's output
  (``Adapter.value_weights``); the attention output, where no norm follows the output projection, of the per-head
  reads (``Adapter.attn_out_weights``). They agree with the summed ones to float32 rounding (another order of
  operations).
- In a float32 model (``Adapter.mlp_out_from_resid``) a block adds ``attn_out + mlp_out`` to the residual, so the
  mlp_out sums are ``resid_sum[l+1] - resid_sum[l] - attn_out_sum`` (``resid_sum[L]``: the final residual). The
  difference carries the forward's rounding of the two residual additions, ``<= u (|resid_mid| + |resid_out|)`` per
  position and element (``u = 2^-24``), and the float32 rounding of three batch sums at the residual's scale instead
  of one at mlp_out's (``<= m u sum |x|`` each over the ``m`` rows of a bucket in a batch, as for every per-position
  sum): far below the mean's own sampling spread (tests/test_stats_reference.py compares it with the captured
  mlp_out at the brute-force tolerance, 1e-5 of its scale, on all six architectures; measured 1-3e-7). Not reading
  the MLP's output saves the capture's copy of it (measured: benchmarks/HISTORY.md).
- ``resid_mid = resid_in + attn_out`` (the adapters' definition) is never accumulated.

Derived lazily (``lazy=True``, the statistics job's partial): each derived sum is a
:class:`~mfpipe.stats.layered.LayerDerived` that computes one layer when indexed, so writing the partial (which goes
layer by layer) holds one layer of them, not all of them at once beside the accumulators (~200 MB a layer for a
7B-class model at N = 1000: benchmarks/README.md, "The statistics job's memory at scale")."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from mfpipe.stats.errors import StatsError
from mfpipe.stats.layered import LayerDerived

Weights = Callable[[int], tuple[torch.Tensor, torch.Tensor | None]]


def no_attention(P: torch.Tensor, pos: dict[str, torch.Tensor], layers, H: int) -> None:
    """NaN (in place) in the kernel sums ``P [N*K, L*H]`` and the per-position sums ``pos`` other than the residual's
    of ``layers``: a hybrid's layers of another mixer than attention, which have no probabilities, values, reads or
    branch outputs (NaN, never 0: the partials are merged by addition, where NaN stays NaN)."""
    for l in layers:
        P[:, l * H:(l + 1) * H] = float("nan")
        for name, t in pos.items():
            if name not in ("resid", "resid_sq"):
                t[l] = float("nan")


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
    forward contend with torch's still-spinning ones and made it several times slower)."""
    out = (torch.from_numpy(np.ascontiguousarray(x_sums, dtype=np.float64))
           @ w.detach().to("cpu", torch.float64)).numpy()
    if b is not None:
        out += counts[:, None] * b.detach().to("cpu", torch.float64).numpy()[None, :]
    return out


def _built(x, lazy: bool):
    return x if lazy else np.asarray(x)


def value_sums(ln_in: np.ndarray, weights: Weights, key_count: np.ndarray, H: int, dh: int, lazy: bool = False):
    """[L,H,K,dh] per-head value sums from the norm's sums ``ln_in [L,K,d]`` and ``weights(l)`` = (W [H,d,dh],
    b [H,dh] | None); ``lazy``: a :class:`LayerDerived`."""
    L, K, d = ln_in.shape

    def layer(l: int) -> np.ndarray:
        w, b = weights(l)
        if tuple(w.shape) != (H, d, dh):
            raise StatsError(f"value_weights({l}) has shape {tuple(w.shape)}, expected {(H, d, dh)}")
        v = affine_sums(ln_in[l], w.permute(1, 0, 2).reshape(d, H * dh), None if b is None else b.reshape(H * dh),
                        key_count)
        return np.ascontiguousarray(v.reshape(K, H, dh).transpose(1, 0, 2))

    return _built(LayerDerived((L, H, K, dh), layer), lazy)


def attn_out_sums(reads: np.ndarray, weights: Weights, key_count: np.ndarray, lazy: bool = False):
    """[L,K,d] attention-output sums from the read sums ``reads [L,K,H*dh]`` (head-major) and ``weights(l)`` =
    (W [H,dh,d], b [d] | None); ``lazy``: a :class:`LayerDerived`."""

    def layer(l: int) -> np.ndarray:
        w, b = weights(l)
        return affine_sums(reads[l], w.reshape(-1, w.shape[-1]), b, key_count)

    d = weights(0)[0].shape[-1]
    return _built(LayerDerived((reads.shape[0], reads.shape[1], d), layer), lazy)


def position_sums(col: dict[str, np.ndarray], key_count: np.ndarray, H: int, dh: int,
                  attn_out_weights: Weights | None, value_weights: Weights | None,
                  lazy: bool = False) -> dict[str, np.ndarray]:
    """Pass 1's per-position sums (see :mod:`mfpipe.stats.pass1`) from its accumulators ``col`` (name -> float64
    [depth, K, width]: ``resid`` and ``resid_sq`` of depth L + 1, ``reads`` [L, K, H*dh] head-major, and those of
    ``attn_out``, ``mlp_out``, ``ln_in``, ``values`` that were summed), deriving the others: attn_out from the read
    sums through ``attn_out_weights``, mlp_out from the residual and attn_out sums, the values from the ln1(x) sums
    through ``value_weights``; ``ln_in_sum`` is NaN where no norm was summed. Summed ones are returned as they are
    (views, no copies); ``lazy``: the derived ones as :class:`~mfpipe.stats.layered.LayerDerived` (one layer
    computed when indexed)."""
    resid = col["resid"]
    L, K, d = col["reads"].shape[0], resid.shape[1], resid.shape[2]
    if "attn_out" in col:
        attn_out = col["attn_out"]
    else:
        attn_out = attn_out_sums(col["reads"], attn_out_weights, key_count, lazy=lazy)
    ln_in = col["ln_in"] if "ln_in" in col else np.full((L, K, d), np.nan)
    if "values" in col:
        value_sum = col["values"].reshape(L, K, H, dh).transpose(0, 2, 1, 3)
    else:
        value_sum = value_sums(ln_in, value_weights, key_count, H, dh, lazy=lazy)
    if "mlp_out" in col:
        mlp_out = col["mlp_out"]
    else:  # a block adds attn_out + mlp_out to the residual
        mlp_out = _built(LayerDerived((L, K, d), lambda l: resid[l + 1] - resid[l] - attn_out[l]), lazy)
    return {
        "resid_sum": resid,
        "resid_sq_sum": col["resid_sq"],
        "attn_out_sum": attn_out,
        # resid_mid = resid_in + attn_out (the adapter's definition)
        "resid_mid_sum": _built(LayerDerived((L, K, d), lambda l: resid[l] + attn_out[l]), lazy),
        "mlp_out_sum": mlp_out,
        "ln_in_sum": ln_in,
        "value_sum": value_sum,
        "read_sum": col["reads"].reshape(L, K, H, dh).transpose(0, 2, 1, 3),
    }
