"""The MLP as a sum over its hidden units (paper App. llama, "the MLP output is exactly linear in the post-activation"):
for the MLP of block ``layer`` read at residual rows ``x [N, d]``, the post-activation ``h(x) [N, F]`` (the input of the
MLP's output projection: GPT-2's ``c_proj``, Llama's ``down_proj``, GPT-NeoX's ``dense_4h_to_h``) and that projection's
weight, so that the MLP's output is ``h(x) @ weight + bias`` exactly and unit ``k`` contributes ``h_k(x) weight[k]``.

With a ``tangent`` the same forward carries forward-mode derivatives (``torch.autograd.forward_ad``), giving the
directional derivative ``J_h(x) tangent`` of every unit at once: the linear part the nonlinear excess is measured
against. Nothing here knows a module path: the output projection is found among the MLP module the adapter names
(:attr:`Structure.mlp`) as the last 2-D weight called with the model's width as its output, and the MLP's output is
checked to be that projection's output. An MLP with no such decomposition raises :class:`NoUnitDecomposition`
with the reason, which the divergence tables carry in the layer's row (the job does not fail): a mixture of experts
(its experts' weights stacked in one parameter, or a module of an expert class: it routes each token to its own
experts, so the layer has no fixed hidden units), an MLP with no forward-mode derivative, one not linear in one
post-activation.

The decomposition is of the MLP itself (pre-norm, MLP): on Gemma-2 and OLMo-2 a norm follows the MLP inside the
branch, and the branch's output is not linear in ``h``; :attr:`MlpUnits.post_norm` says so.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.autograd.forward_ad as fwAD
from torch import Tensor

from mfpipe.models.adapters.site import module_at

__all__ = ["MOE_REASON", "MlpUnits", "NoUnitDecomposition", "mlp_units"]

MOE_REASON = "a mixture of experts routes each token to its own experts; no fixed hidden units"


class NoUnitDecomposition(ValueError):
    """The MLP of a layer has no decomposition over fixed hidden units; ``reason`` says why in a phrase (the tables'
    ``not_applicable`` column), the message names the model and layer as well."""

    def __init__(self, adapter, layer: int, reason: str):
        super().__init__(f"{adapter.model_type}: the MLP of layer {layer}: {reason}; no unit decomposition")
        self.reason = reason


class MlpUnits(NamedTuple):
    """One MLP evaluation split over its hidden units (float64: the model's numbers, widened exactly)."""

    out: Tensor  # [N, d] the output projection's output, before any module after the MLP: hidden @ weight + bias
    hidden: Tensor  # [N, F] the post-activation (the output projection's input)
    hidden_tangent: Tensor | None  # [N, F] J_h(x) tangent, when a tangent was given
    out_tangent: Tensor | None  # [N, d] J_out(x) tangent = hidden_tangent @ weight
    weight: Tensor  # [F, d]
    bias: Tensor | None  # [d]
    # whether a module follows the MLP inside the branch (a norm, Gemma-2's: the branch is then not linear in hidden;
    # Inkling's convolution over positions): the decomposition is of the MLP itself
    post_norm: bool


def _projection_weight(mod) -> Tensor:
    """``[F, d]`` such that the module's output is ``input @ weight (+ bias)``: ``nn.Linear`` keeps ``[d, F]``,
    GPT-2's ``Conv1D`` ``[F, d]``."""
    w = mod.weight.detach().double()
    return w if type(mod).__name__ == "Conv1D" else w.t()


def _unpack(x: Tensor) -> tuple[Tensor, Tensor | None]:
    """Primal and tangent as ``[N, width]`` rows: an MLP the adapter calls on ``[1, N, d]`` (``mlp_sequences``: a MoE
    model's dense layers are called as its experts are) records its projection's tensors with that leading 1."""
    p, t = fwAD.unpack_dual(x)
    rows = lambda v: v.detach().double().reshape(-1, v.shape[-1])  # noqa: E731
    return rows(p), (None if t is None else rows(t))


def _is_mixture(mlp) -> bool:
    """Whether the MLP module is a mixture of experts: its experts' weights stacked in one parameter (``[E, ...]``,
    transformers' fused ``*Experts`` modules) or a module of it whose class is an expert one. (Not "MoE" in a class
    name: a MoE family's dense layers are named so too, Cohere2-MoE's ``Cohere2MoeMLP``.)"""
    return (any(p.ndim >= 3 for p in mlp.parameters())
            or any("expert" in type(m).__name__.lower() for m in mlp.modules()))


@torch.no_grad()
def mlp_units(adapter, layer: int, x_resid: Tensor, tangent: Tensor | None = None) -> MlpUnits:
    """The MLP of block ``layer`` at the residual rows ``x_resid [N, d]`` (what the MLP branch reads: ``resid_mid``,
    or the block input for a parallel-residual block), split over its hidden units; with ``tangent [N, d]`` also the
    directional derivatives along it. Raises :class:`NoUnitDecomposition` (a ``ValueError``: the model, the layer and
    the reason) when the MLP is a mixture of experts or its output is not one projection of one post-activation."""
    if layer not in getattr(adapter, "attention_layers", (layer,)):
        raise NoUnitDecomposition(adapter, layer, f"a {adapter.layer_kinds[layer]} block of a hybrid (no attention, "
                                                  "run as the model's own block)")
    if adapter.structure.mlp is None:
        raise NoUnitDecomposition(adapter, layer, "a block without an MLP (Nemotron-H's attention blocks)")
    mlp = module_at(adapter.block_module(layer), adapter.structure.mlp)
    beside = [module_at(adapter.block_module(layer), p) for p in adapter.structure.mlp_siblings if p != adapter.MLP]
    if any(_is_mixture(m) for m in (mlp, *beside)):
        raise NoUnitDecomposition(adapter, layer, MOE_REASON)
    if beside:  # the excess of one module's units alone would leave the others' out
        raise NoUnitDecomposition(adapter, layer, "its MLP branch is the sum of several modules: no one set of units")
    calls: list[tuple] = []
    hooks = [m.register_forward_hook(lambda mod, args, out: calls.append((mod, args[0], out)))
             for m in mlp.modules() if getattr(m, "weight", None) is not None and m.weight.ndim == 2]
    x = x_resid.to(device=adapter.device, dtype=adapter.dtype)
    try:
        with fwAD.dual_level():
            xin = x if tangent is None else fwAD.make_dual(x, tangent.to(device=x.device, dtype=x.dtype))
            try:
                adapter.mlp(layer, xin)
            except (NotImplementedError, RuntimeError) as e:
                if tangent is None:
                    raise
                raise NoUnitDecomposition(adapter, layer, f"it has no forward-mode derivative "
                                          f"({str(e).splitlines()[0]}): no linear part to measure the excess against"
                                          ) from e
            outs = [c for c in calls if c[2].shape[-1] == adapter.d_model]
            if not outs:
                raise NoUnitDecomposition(adapter, layer, f"no linear map of it writes the model width "
                                                          f"{adapter.d_model}: no output projection of hidden units")
            mod, hin, hout = outs[-1]
            h, h_dot = _unpack(hin)
            out, out_dot = _unpack(hout)
    finally:
        for hk in hooks:
            hk.remove()
    weight = _projection_weight(mod)
    bias = None if getattr(mod, "bias", None) is None else mod.bias.detach().double()
    recon = h @ weight + (0 if bias is None else bias)
    if not torch.allclose(recon, out, rtol=1e-4, atol=1e-5 * (1 + float(out.abs().max()))):
        raise NoUnitDecomposition(adapter, layer, f"it is not one projection of its post-activation "
                                                  f"({type(mod).__name__} does not reproduce its own output)")
    post_norm = adapter.structure.post_mlp_norm is not None
    if not post_norm and not _is_mlp_output(adapter, layer, x, out):
        raise NoUnitDecomposition(adapter, layer, "its output is not its last projection's output: not one "
                                                  "projection of one post-activation")
    return MlpUnits(out=out, hidden=h, hidden_tangent=h_dot, out_tangent=out_dot, weight=weight, bias=bias,
                    post_norm=post_norm)


def _is_mlp_output(adapter, layer: int, x: Tensor, out: Tensor) -> bool:
    y = adapter.mlp(layer, x).double()
    return bool(torch.allclose(y, out, rtol=1e-5, atol=1e-6 * (1 + float(y.abs().max()))))
