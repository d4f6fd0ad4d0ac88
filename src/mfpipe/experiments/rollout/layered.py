"""A kernel ``[L, H, N, N+2]`` held one layer at a time.

Every consumer of a kernel (Alg. 1, the teacher-forced estimators, the divergence diagnostics) reads it one layer
at a time, ``kernel[l]``. A whole float64 kernel is ``8 L H N (N+2)`` bytes: 12.8 GB for Qwen3-14B at N = 1000,
and the rollout jobs held about four of them (the store's P, its filled copy, the kernel's copy, the row-sum check's
temporaries), more than a 24 GiB host for every preset from 3B up. A :class:`LayerKernel` computes layer ``l`` when
it is asked for (the statistics store's layer read from disk, then the kernel's own per-layer transform), so a
rollout holds one layer of it; the values are those of the whole-array kernels bit for bit
(tests/test_rollout_kernels.py).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

__all__ = ["LayerKernel", "layer_at"]


class LayerKernel:
    """``[L, H, N, N+2]`` float64 kernel whose layer ``l`` is ``layer(l)`` (``[H, N, N+2]``), computed per access.

    Indexing with an int gives one layer; with a slice or an index array, the stacked layers; ``np.asarray`` gives
    the whole kernel (for tests and small models; the jobs never ask for it). ``last`` keeps the layer asked for
    last, so a transform that reads its source layer twice reads the store once."""

    ndim = 4
    dtype = np.dtype(np.float64)

    def __init__(self, shape: tuple[int, int, int, int], layer: Callable[[int], np.ndarray]):
        if len(shape) != 4 or shape[3] != shape[2] + 2:
            raise ValueError(f"a kernel is [L, H, N, N+2]; got shape {tuple(shape)}")
        self.shape = tuple(int(s) for s in shape)
        self._layer = layer
        self._last: tuple[int, np.ndarray] | None = None

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, key):
        if isinstance(key, (int, np.integer)):
            l = int(key)
            if not -self.shape[0] <= l < self.shape[0]:
                raise IndexError(f"layer {l} of a kernel of {self.shape[0]} layers")
            l %= self.shape[0]
            if self._last is None or self._last[0] != l:
                K = np.asarray(self._layer(l), dtype=np.float64)
                if K.shape != self.shape[1:]:
                    raise ValueError(f"layer {l} of the kernel is {K.shape}; expected {self.shape[1:]}")
                self._last = (l, K)
            return self._last[1].copy()  # a caller may write into its layer
        idx = np.arange(self.shape[0])[key]
        return np.stack([self[int(l)] for l in np.atleast_1d(idx)]) if np.ndim(idx) else self[int(idx)]

    def __array__(self, dtype=None, copy=None):
        K = self[:]
        return K if dtype is None else K.astype(dtype)

    def map(self, fn: Callable[[np.ndarray], np.ndarray]) -> LayerKernel:
        """The kernel whose layer ``l`` is ``fn(self[l])``."""
        return LayerKernel(self.shape, lambda l: fn(self[l]))


def layer_at(K, l: int) -> np.ndarray:
    """Layer ``l`` of a kernel (a whole array or a :class:`LayerKernel`) as float64 ``[H, N, N+2]``."""
    return K[l] if isinstance(K, LayerKernel) else np.asarray(K[l], dtype=np.float64)
