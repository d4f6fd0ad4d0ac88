"""The per-context deviation forward: one clean traced forward of the model with, per layer, the pass-2 math of the
deviation of every head's read from its context-conditional mean field (paper Sec. 6 eq:deviation, eq:mcov-mctx):
:func:`~mfpipe.meanfield.ccmf.pair_kernel`, :func:`~mfpipe.meanfield.deviation.occurrence_terms` and
:func:`~mfpipe.meanfield.deviation.meters` on the model's own attention, values and reads.

Shared by the experiments that measure the deviation on their own token sequences (the prompt classes and the
instance meter of Sec. 6.1, the positional transport of App. positional); :func:`kernel_for` puts a
:class:`~mfpipe.meanfield.kernel.MeanFieldKernel` on the adapter's device, refusing one of another model's shape.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mfpipe.meanfield.ccmf import pair_kernel
from mfpipe.meanfield.deviation import meters, occurrence_terms
from mfpipe.meanfield.kernel import MeanFieldKernel
from mfpipe.models.adapters.gate import has_gate

__all__ = ["METERS", "kernel_for", "deviation_forward"]

#: the float meters :func:`deviation_forward` returns per (window, position, layer, head)
METERS = ("D", "M_cov", "M_ctx")


def kernel_for(kernel, adapter) -> MeanFieldKernel:
    """``kernel`` on the adapter's device (:meth:`MeanFieldKernel.to`), refused if it belongs to another shape."""
    k = kernel if kernel.device == torch.device(adapter.device) else kernel.to(adapter.device)
    if tuple(k.W.shape[:2]) != (adapter.n_layers, adapter.n_heads):
        raise ValueError(f"the kernel has (layers, heads) = {tuple(k.W.shape[:2])}, the model "
                         f"({adapter.n_layers}, {adapter.n_heads}): the statistics belong to another model")
    return k


def deviation_forward(adapter, kernel: MeanFieldKernel, ids: torch.Tensor, kb: torch.Tensor, qt: torch.Tensor, *,
                      logits: bool = False, loss: bool = False, on_capture: Callable | None = None):
    """One clean traced forward reading attention, values and reads; per layer the pass-2 math
    (:func:`~mfpipe.meanfield.ccmf.pair_kernel`, :func:`~mfpipe.meanfield.deviation.occurrence_terms`, :func:`~mfpipe.meanfield.deviation.meters`).

    ``kb``/``qt [B, T]`` the key buckets and query types of ``ids`` (:meth:`MeanFieldKernel.buckets`).
    ``on_capture(cap, m_layer)``: called once per attention layer (a hybrid's others have none), in order, with its
    :class:`~mfpipe.models.adapters.site.LayerCapture` (``attn_probs``, ``values``, ``reads``; do not modify in
    place) and its meters (:func:`~mfpipe.meanfield.deviation.meters`: ``[B, T, H]`` each), so a caller reads more
    from the same forward.

    Returns ``(m, valid, result)``: ``m[key] [B, T, L, H]`` float64 for ``D``, ``M_cov``, ``M_ctx`` and
    ``degenerate`` (bool), ``valid [B, T]`` (a query with a valid Â row in every layer), the :class:`RunResult`."""
    dev = kernel.device
    kb, qt = kb.to(dev), qt.to(dev)
    B, T = kb.shape
    L, H = adapter.n_layers, adapter.n_heads
    grams = kernel.grams(adapter)
    out = {k: torch.zeros(B, T, L, H, dtype=torch.float64, device=dev) for k in METERS}
    out["degenerate"] = torch.zeros(B, T, L, H, dtype=torch.bool, device=dev)
    valid = torch.ones(B, T, dtype=torch.bool, device=dev)

    def on_layer(cap):
        l = cap.layer
        if cap.attn_probs is None:  # a hybrid's layer of another mixer: no meters (NaN), no say in `valid`
            for key in METERS:
                out[key][:, :, l] = float("nan")
            return
        a, _, v = pair_kernel(kernel.W[l].to(dev, torch.float32), kb, qt)
        terms = occurrence_terms(cap.attn_probs.float(), cap.values.float(), a.transpose(0, 1), kernel.mu[l], kb,
                                 reads=cap.reads)
        # a gated attention: the meters of the gated reads, each query's own gate (meanfield.deviation.gate_head_major)
        m = meters(terms, grams[l], None if cap.resid_in is None else adapter.read_gate(l, cap.resid_in, cap.reads))
        for key in out:
            out[key][:, :, l] = m[key].to(dev)
        valid.logical_and_(v.to(dev))
        if on_capture is not None:
            on_capture(cap, m)

    want = ("attn_probs", "values", "reads") + (("resid_in",) if has_gate(adapter) else ())
    res = adapter.run(ids, select=want, on_layer=on_layer, logits=logits, loss=loss)
    return out, valid, res
