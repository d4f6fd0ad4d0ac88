"""The mean field of a statistics half in a notebook (:func:`mean_field`): the kernel W on its support and the heads'
mean values μ as labelled arrays, and ẑ, the context-conditional mean field (eq:ccmf) of every head at every
position of given windows: the substitution's own kernel object (:class:`mfpipe.meanfield.kernel.MeanFieldKernel`,
built by :func:`mfpipe.meanfield.kernel.kernel_from_store`), with the bucket tables taken from the statistics' own
coordinates."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import xarray as xr

from mfpipe.notebook.identity import check_identity
from mfpipe.notebook.inputs import (NotebookError, as_stats, by_length, in_input_order, positive_int, text_windows,
                                    tokens_fingerprint)

__all__ = ["MeanField", "mean_field", "pad_windows", "result_attrs"]


def pad_windows(arrays: list[np.ndarray], fill) -> np.ndarray:
    """``[n_i, T_i, ...]`` arrays stacked along windows into ``[n, max T, ...]``, padded with ``fill``."""
    T = max(a.shape[1] for a in arrays)
    out = np.full((sum(a.shape[0] for a in arrays), T, *arrays[0].shape[2:]), fill, dtype=arrays[0].dtype)
    n = 0
    for a in arrays:
        out[n : n + a.shape[0], : a.shape[1]] = a
        n += a.shape[0]
    return out


def result_attrs(stats, blocks: list[np.ndarray], what: str, **extra) -> dict:
    """Provenance of a notebook result: the statistics' (model, revision, weights and tokenizer, tracked set, corpus,
    N), the windows' fingerprint and size (``blocks`` in the input's order), what computed it and the mfpipe
    version."""
    from mfpipe.version import __version__

    a = stats.attrs
    attrs = {k: a.get(k) for k in ("model", "revision", "revision_commit", "half", "weights_fingerprint",
                                   "tokenizer_fingerprint", "tracked_fingerprint", "corpus_fingerprint", "n_tracked",
                                   "context_length") if a.get(k) is not None}
    attrs.update({"stats_tokens": a.get("n_tokens"), "source": f"in-memory (mfpipe.{what})",
                  "tokens_fingerprint": tokens_fingerprint(blocks), "n_windows": int(sum(len(b) for b in blocks)),
                  "n_tokens": int(sum(b.size for b in blocks)), "mfpipe_version": __version__})
    attrs.update({k: v for k, v in extra.items() if v is not None})
    return attrs


@dataclass
class MeanField:
    """The mean field of one statistics half (see :func:`mean_field`)."""

    stats: object  # MeanFieldStats
    min_count: int | None = None
    _kernel: object = field(default=None, repr=False)

    @property
    def attrs(self) -> dict:
        return dict(self.stats.attrs)

    @property
    def W(self) -> xr.DataArray:
        """(layer, head, query, key): W = P / nbar on the C_st >= min_count support, 0 off it (App. A, E)."""
        return self.stats.W(min_count=self.min_count)

    @property
    def mu(self) -> xr.DataArray:
        """(layer, head, key, head_dim): each head's mean value vector per key bucket (μ_t)."""
        return self.stats.mu()

    @property
    def type_ids(self) -> np.ndarray:
        return np.asarray(self.stats.ds["query_token_id"].values, dtype=np.int64)

    def kernel(self, vocab_size: int = 0):
        """The :class:`~mfpipe.meanfield.kernel.MeanFieldKernel` (host) with bucket tables for ids below
        ``vocab_size`` (at least the tracked ids and BOS)."""
        from mfpipe.meanfield.kernel import kernel_from_store

        ids, n = self.type_ids, self.stats.n
        bos = int(self.stats.attrs.get("bos_id", -1))
        size = max(int(vocab_size), int(ids.max(initial=-1)) + 1, bos + 1)
        if self._kernel is None or len(self._kernel.key_lut) < size:
            key, query = np.full(size, n + 1, dtype=np.int64), np.full(size, -1, dtype=np.int64)
            key[ids], query[ids] = np.arange(n), np.arange(n)
            luts = {"key_lut": key, "query_lut": query, "n": n, "bos_id": None if bos < 0 else bos}
            if self._kernel is None:
                self._kernel = kernel_from_store(self.stats, luts, min_count=self.min_count)
            else:
                self._kernel = replace(self._kernel, key_lut=key, query_lut=query)
        return self._kernel

    def zhat(self, tokens_or_texts, tokenizer=None) -> xr.Dataset:
        """ẑ_sX = Σ_t Â_stX μ_t (eq:ccmf) of every head at every position of the windows: ``zhat`` (window, position,
        layer, head, head_dim), NaN where the position is not substituted (no tracked query type, or a row of W
        without support in some layer), ``substituted`` (window, position); ``token_id`` -1 on padding. Texts (one
        window each, BOS-led) need ``tokenizer``, the statistics' own (refused when their provenance records another).
        Windows keep the input's order (``window`` i is the i-th), whatever their lengths."""
        bos = self.stats.attrs.get("bos_id")
        if bos is None:
            raise NotebookError("these statistics record no bos_id: pass token windows from a store of this mfpipe")
        if tokenizer is not None:
            check_identity(None, tokenizer, {"tokenizer_fingerprint": self.stats.attrs.get("tokenizer_fingerprint")},
                           f"statistics {self.stats.path or '(in memory)'}")
        blocks = text_windows(tokens_or_texts, tokenizer, int(bos), None)
        k = self.kernel(max(int(b.max()) for b in blocks) + 1)
        zs, subs = [], []
        groups, order = by_length(blocks)
        for g in groups:
            kb, qt = k.buckets(g)
            z, sub = k.zhat(kb, qt)
            z = np.stack([x.cpu().numpy() for x in z], axis=2)  # [B, T, L, H, dh]
            sub = sub.cpu().numpy()
            z[~sub] = np.nan
            zs.append(z)
            subs.append(sub)
        ds = xr.Dataset({"zhat": (("window", "position", "layer", "head", "head_dim"),
                                  in_input_order(pad_windows(zs, np.nan), order)),
                         "substituted": (("window", "position"), in_input_order(pad_windows(subs, False), order))},
                        coords={"token_id": (("window", "position"), in_input_order(pad_windows(groups, -1), order)),
                                "layer": np.arange(k.n_layers), "head": np.arange(k.W.shape[1])})
        ds.attrs.update(result_attrs(self.stats, blocks, "mean_field", min_count=k.attrs.get("min_count")))
        return ds


def mean_field(stats, *, min_count: int | None = None) -> MeanField:
    """The mean field of statistics ``stats`` (:func:`mfpipe.collect_stats`'s Dataset, ``mfpipe.open_results("stats",
    ...)``, a store path or ``mfpipe.open_stats(...)``): ``.W`` and ``.mu`` (labelled), ``.zhat(tokens)`` (eq:ccmf);
    ``min_count`` the kernel's support (default: the statistics', 20).

    Example::

        mf = mfpipe.mean_field(ds)
        mf.W.sel(layer=0, head=1)             # (query, key)
        mf.zhat(prompt_ids)["zhat"]           # (window, position, layer, head, head_dim)
    """
    return MeanField(as_stats(stats), positive_int("min_count", min_count, allow_none=True))
