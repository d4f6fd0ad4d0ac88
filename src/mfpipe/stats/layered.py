"""Sums of ``[L, ...]`` shape made one layer at a time when indexed, so that no stage holds them whole: the merge's
sum of several partials' kernel sums left on disk (:class:`LayerSum`) and pass 1's derived sums as its job writes
them (:class:`LayerDerived`). ``np.asarray`` builds either whole. No torch here."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

__all__ = ["LayerDerived", "LayerSum"]


class LayerSum:
    """The float64 sum of several partials' ``[L, ...]`` sums left on disk, added one layer at a time when indexed
    (``[l]``: read layer ``l`` of each partial, add in float64): what :func:`merge_sums` gives for a sum opened
    lazily (:func:`open_partial`), so that merging N = 4000 kernel sums needs one layer (1.5 GB) at a time, not
    18 GB. ``np.asarray`` builds it all. :func:`mfpipe.stats.store.write_stats` writes from it layer by layer."""

    def __init__(self, first):
        self.parts = [first]
        self.shape, self.ndim, self.dtype = tuple(first.shape), len(first.shape), np.dtype(np.float64)

    def add(self, part) -> "LayerSum":
        self.parts.append(part)
        return self

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, index):
        if not isinstance(index, (int, np.integer)):
            return np.asarray(self)[index]
        out = np.zeros(self.shape[1:], dtype=np.float64)
        for part in self.parts:
            out += part[int(index)]
        return out

    def __array__(self, dtype=None, copy=None):
        out = np.empty(self.shape, dtype=np.float64 if dtype is None else dtype)
        for l in range(self.shape[0]):
            out[l] = self[l]
        return out


class LayerDerived:
    """A derived ``[L, ...]`` float64 sum (:mod:`mfpipe.stats.derived`) computed one layer at a time, which
    :func:`mfpipe.stats.partials.save_partial` writes a block of layers at a time: ``[l]`` (or ``[l, ...]``) computes
    layer ``l`` (the last one computed is kept, so its blocks are written without computing it again), ``[a:b, ...]``
    layers ``a..b-1``; ``np.asarray`` builds all of it. ``shape``, ``ndim``, ``dtype`` and ``len`` as an array's."""

    def __init__(self, shape: tuple, layer: Callable[[int], np.ndarray]):
        self.shape, self.ndim, self.dtype = tuple(shape), len(shape), np.dtype(np.float64)
        self._layer, self._last = layer, (None, None)

    def __len__(self) -> int:
        return self.shape[0]

    def layer(self, l: int) -> np.ndarray:
        if self._last[0] != l:
            self._last = (None, None)  # the previous layer goes before the next is made
            self._last = (l, self._layer(l))
        return self._last[1]

    def __getitem__(self, index):
        head, rest = (index[0], index[1:]) if isinstance(index, tuple) and index else (index, ())
        if isinstance(head, (int, np.integer)):
            return self.layer(int(head))[rest] if rest else self.layer(int(head))
        if isinstance(head, slice):
            layers = range(*head.indices(self.shape[0]))
            block = np.empty((len(layers), *self.shape[1:]), dtype=np.float64)
            for i, l in enumerate(layers):
                block[i] = self.layer(l)
            return block[(slice(None), *rest)]
        return np.asarray(self)[index]

    def __array__(self, dtype=None, copy=None):
        out = np.empty(self.shape, dtype=np.float64 if dtype is None else dtype)
        for l in range(self.shape[0]):
            out[l] = self.layer(l)
        self._last = (None, None)
        return out
