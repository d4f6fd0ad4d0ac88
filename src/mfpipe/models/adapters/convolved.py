"""Short convolutions over positions on a head's path (Inkling's): the values a head reads are a causal depthwise
convolution of what the value projection writes over the last few positions (``v_sconv(v_proj(h))``), and each branch
passes one before it joins the residual (``attn_sconv`` after the attention, ``mlp_sconv`` after the MLP).

A head still reads its values under one probability row: its P, μ (the values as it reads them, which the
statistics pass sums at the convolution's output: the values are then no affine map of the attention-input norm,
``value_weights`` is None) and reads are the attention's, and a substitution writes a read where the model's own
would be, the convolutions running after it as the model runs them. A branch's convolution takes the role of a
post-norm (``Structure.post_attn_norm`` / ``post_mlp_norm``: the module between the branch and the residual), so
what joins the residual (the statistics' ``attn_out`` and ``mlp_out``) is read at its output.

A block piece applied to a sequence (``[B, T, d]``) runs the convolutions over its positions, as the model does; the
rollout's rows (type centroids, ``[N, d]``) are each a sequence of one position (:func:`on_rows`), as a hybrid's mixer
block is run on them (:func:`~mfpipe.models.adapters.hybrid.mixer_block`): a convolution then weighs its input by its
tap of the current position only, the positions before a type not being in the mean field's state. (So the rollout's
diagnostics that compare a piece on the centroid with the mean of its values over positions, the Jensen gaps of μ and
of the MLP, hold the convolutions' terms of earlier positions too: the statistics read the values and branches as the
model computes them on sequences.)

The placement finds them by what the modules are and do (:func:`position_conv`: a module whose weights are all those
of depthwise ``nn.Conv1d``; :func:`value_convs`: one of the attention's that reads what a projection from the model
width writes), never by name.
"""

from __future__ import annotations

from torch import Tensor, nn

__all__ = ["conv_watch", "on_rows", "position_conv", "value_convs"]


def position_conv(m: nn.Module) -> bool:
    """Whether every weight of ``m`` is a depthwise ``nn.Conv1d``'s (a short convolution over positions, Inkling's
    ``InklingShortConvolution``; a Mamba mixer's holds projections too)."""
    convs = [c for c in m.modules() if isinstance(c, nn.Conv1d)]
    owned = {id(p) for c in convs for p in c.parameters()}
    return bool(convs) and all(c.groups == c.in_channels == c.out_channels for c in convs) and \
        all(id(p) in owned for p in m.parameters())


def conv_watch(attn_mod: nn.Module) -> dict[str, nn.Module]:
    """The probe forward's watch of the attention's position convolutions, as value-source candidates (``<src>NAME``,
    what :func:`value_convs` reads)."""
    return {f"<src>{n}": m for n, m in attn_mod.named_children() if position_conv(m)}


def value_convs(seen: dict, attn_mod: nn.Module, sources: list[str]) -> dict[str, str]:
    """The attention's position convolutions that read what one of its projections ``sources`` (from the model width)
    writes, by the probe forward's objects (``seen``: ``<src>NAME``) -> name -> that projection's name: Inkling's
    ``k_sconv`` (k_proj) and ``v_sconv`` (v_proj); the value search tries their outputs as value sources."""
    out = {}
    for n, m in attn_mod.named_children():
        got = seen.get(f"<src>{n}")
        if got is None or not position_conv(m):
            continue
        src = [p for p in sources if f"<src>{p}" in seen and seen[f"<src>{p}"].y_obj is got.x_obj]
        if len(src) == 1:
            out[n] = src[0]
    return out


def on_rows(module, x: Tensor) -> Tensor:
    """``module`` (a position convolution, or a norm: per row) on ``x``: sequences ``[B, T, d]`` as they are (more
    leading dimensions folded into ``B``); rows ``[N, d]`` each a sequence of one position (a convolution on a 2-D
    tensor would take its rows for positions)."""
    if x.dim() == 3:
        return module(x)
    T = x.shape[-2] if x.dim() > 3 else 1
    return module(x.reshape(-1, T, x.shape[-1])).reshape(*x.shape[:-1], -1)
