"""The mean-field kernel object every forward-pass experiment reads: per layer the context-conditional kernel ``W``
(paper eq:w-def-appendix; or the calibrated U of App. B) and the heads' mean values ``mu``, with the tracked set's
bucket look-up tables, built from a statistics half by :func:`kernel_from_store`. Its :meth:`MeanFieldKernel.zhat`
is the context-conditional mean field ẑ_sX of eq:ccmf (:func:`mfpipe.meanfield.plan.ccmf_rows`) for every layer.
What is written back at the read site with it: :func:`mean_field_replacement` (ẑ at substituted positions, the
substitution of Sec. 5.1) or :func:`own_reads_replacement` (the model's own reads: the identity check, ΔL = 0).
Used by substitution (Sec. 5), pass 2 (Sec. 6), the prompt classes and the lenses."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from mfpipe.meanfield.plan import ccmf_rows, query_plan
from mfpipe.meanfield.deviation import layer_grams
from mfpipe.stats.buckets import window_buckets

__all__ = ["MeanFieldKernel", "kernel_from_store", "RESIDENT_KERNEL_BYTES", "Replacement", "mean_field_replacement",
           "own_reads_replacement"]

# replacement(layer, reads [B,T,H,dh], zhat [B,T,H,dh], substituted [B,T]) -> the reads to write back
Replacement = Callable[[int, Tensor, Tensor, Tensor], Tensor]


def mean_field_replacement(layer: int, reads: Tensor, zhat: Tensor, substituted: Tensor) -> Tensor:
    """The substitution of Sec. 5.1: ẑ at substituted positions, the model's own read elsewhere."""
    return torch.where(substituted[:, :, None, None], zhat.to(reads.dtype), reads)


def own_reads_replacement(layer: int, reads: Tensor, zhat: Tensor, substituted: Tensor) -> Tensor:
    """Writes the model's own reads back through the same intervention (the identity check: ΔL = 0)."""
    return reads


# W above this size stays on the host and goes to the model's device one layer at a time (per batch)
RESIDENT_KERNEL_BYTES = 4 << 30


@dataclass
class MeanFieldKernel:
    """What the substitution needs from the statistics half: per layer ``W [L,H,N,K]`` (or the calibrated U of
    App. B) and the heads' mean values ``mu [L,H,K,dh]``, with the tracked set's bucket lookup tables.

    Memory: ``W`` is ``L H N (N+2)`` floats (GPT-2 small at N = 1000: 0.58 GB in float32). :meth:`to` moves it
    to the model's device whole when it is at most ``RESIDENT_KERNEL_BYTES``, else keeps it on the host and
    :meth:`zhat` moves one layer at a time."""

    W: Tensor
    mu: Tensor
    key_lut: np.ndarray
    query_lut: np.ndarray
    n: int
    attrs: dict = field(default_factory=dict)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    # the layers with attention (None: all); a hybrid's other layers have NaN W and mu, no ẑ and no say in `valid`
    attention_layers: tuple[int, ...] | None = None
    _grams: tuple | None = field(default=None, repr=False, compare=False)  # (adapter, [L,H,dh,dh]) cache

    @property
    def n_layers(self) -> int:
        return int(self.W.shape[0])

    def to(self, device, dtype=torch.float32, resident_bytes: int = RESIDENT_KERNEL_BYTES) -> "MeanFieldKernel":
        device = torch.device(device)
        fits = self.W.numel() * torch.finfo(dtype).bits // 8 <= resident_bytes
        home = device if fits else torch.device("cpu")
        return MeanFieldKernel(self.W.to(device=home, dtype=dtype), self.mu.to(device=device, dtype=dtype),
                               self.key_lut, self.query_lut, self.n, dict(self.attrs), device, self.attention_layers)

    def grams(self, adapter) -> Tensor:
        """The residual-stream grams ``[L,H,dh,dh]`` of the adapter's output projections (cached: the weights are
        frozen), on the kernel's device."""
        if self._grams is None or self._grams[0] is not adapter:
            self._grams = (adapter, layer_grams(adapter).to(self.device))
        return self._grams[1]

    def buckets(self, tokens) -> tuple[Tensor, Tensor]:
        kb, qt = window_buckets(np.asarray(tokens), self.key_lut, self.query_lut, self.n)
        return torch.from_numpy(kb), torch.from_numpy(qt)

    def zhat(self, kb: Tensor, qt: Tensor) -> tuple[list[Tensor], Tensor]:
        """ẑ per layer ``[B,T,H,dh]`` and the substituted positions ``[B,T]`` (valid in every layer), on
        :attr:`device`; each layer's ẑ is 0 where that layer's Â row is empty, and may be non-zero at a position another
        layer leaves unsubstituted (callers mask with the substituted positions). The type-space form (:func:`mfpipe.meanfield.plan.ccmf_rows`,
        at the query rows only, one plan for every layer): the pair form over key positions
        (:func:`~mfpipe.meanfield.ccmf.ccmf_reads`) computes the same ẑ with T / U times the work."""
        dev = self.device
        B, T = kb.shape
        plan = query_plan(kb, qt, self.n + 2, dev)
        zs, valid = [], None
        for l in range(self.n_layers):
            if self.attention_layers is not None and l not in self.attention_layers:  # a hybrid's other mixer
                zs.append(torch.zeros(B, T, *self.mu.shape[1:2], self.mu.shape[-1], dtype=self.W.dtype, device=dev))
                continue
            z, v = ccmf_rows(plan, self.W[l].to(dev, non_blocking=True), self.mu[l].to(dev))
            full = torch.zeros(B, T, *z.shape[1:], dtype=z.dtype, device=dev)
            full[plan.b, plan.j] = torch.where(v[:, None, None], z, torch.zeros_like(z))  # 0 where not valid
            zs.append(full)
            valid = v if valid is None else valid & v
        sub = torch.zeros(B, T, dtype=torch.bool, device=dev)
        if valid is not None:
            sub[plan.b, plan.j] = valid
        return zs, sub


def kernel_from_store(stats, tracked, *, min_count: int | None = None, calibrated=None,
                      dtype: torch.dtype = torch.float32) -> MeanFieldKernel:
    """The substitution kernel of a statistics store (:class:`~mfpipe.stats.api.MeanFieldStats`, the ``stats``
    half): ``W`` on the ``C_st >= min_count`` support (store default 20) or, with ``calibrated`` (an
    xarray ``U`` from :func:`mfpipe.meanfield.calibrated.load_calibrated`, same dims as ``W``), U instead; μ from the
    store. ``tracked`` is the :class:`~mfpipe.corpus.tracked.TrackedSet` whose fingerprint the store records (or the
    plain lookup tables of :func:`mfpipe.stats.buckets.bucket_luts`, unchecked: the notebook API builds them from the
    store's own coordinates). Read one layer at a time into ``dtype`` (no float64 copy of the whole kernel)."""
    from mfpipe.stats.buckets import bucket_luts

    fingerprint = getattr(tracked, "fingerprint", None)
    if fingerprint is not None and stats.attrs.get("tracked_fingerprint") not in (None, fingerprint):
        from mfpipe.stats.api import ProvenanceError

        raise ProvenanceError(
            f"statistics store {stats.path} was computed with another tracked set "
            f"({stats.attrs.get('tracked_fingerprint')!r}, this one is {fingerprint!r}); rerun the stats stage")
    if calibrated is not None:  # calibrated against this store's P: of its model, corpus and half
        from mfpipe.meanfield.calibrated import PAIRED
        from mfpipe.stats.api import ProvenanceError, same_value

        for k in (k for k in PAIRED if k in calibrated.attrs and k in stats.attrs):
            if not same_value(calibrated.attrs[k], stats.attrs[k]):
                raise ProvenanceError(f"the calibrated kernel U was calibrated on another {k.replace('_', ' ')} "
                                      f"({calibrated.attrs[k]!r}) than statistics store {stats.path} has "
                                      f"({stats.attrs[k]!r}); rerun its calibrate_kernel job on this store")
    W = None  # filled a layer at a time: never a second copy of the whole kernel (a list of layers, then a stack)
    mc = None
    for l in range(stats.n_layers):
        if calibrated is None:
            Wl = stats.W(min_count=min_count, layer=l)
            mc = int(Wl.attrs["min_count"])
        else:
            Wl = calibrated.isel(layer=l)
            mc = int(calibrated.attrs.get("min_count", stats.attrs.get("min_count", 20)))
        Wl = torch.from_numpy(np.asarray(Wl.transpose("head", "query", "key").values))
        if W is None:
            W = torch.empty((stats.n_layers, *Wl.shape), dtype=dtype)
        W[l] = Wl  # the same cast to dtype as .to(dtype)
    mu = stats.mu().transpose("layer", "head", "key", "head_dim")
    key_lut, query_lut, n, _ = bucket_luts(tracked)
    attrs = {k: stats.attrs.get(k) for k in ("model", "revision", "revision_commit", "tracked_fingerprint",
                                            "corpus_fingerprint", "n_tracked", "context_length", "n_tokens")}
    attrs["kernel"] = "W" if calibrated is None else "U (calibrated, App. B)"
    attrs["min_count"] = mc
    hybrid = len(getattr(stats, "attention_layers", ())) < stats.n_layers
    return MeanFieldKernel(W, torch.from_numpy(np.asarray(mu.values)).to(dtype), key_lut, query_lut,
                           n, attrs, attention_layers=tuple(stats.attention_layers) if hybrid else None)
