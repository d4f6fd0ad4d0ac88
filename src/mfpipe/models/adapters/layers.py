"""Per-layer attention forms: layers whose heads differ in width, in KV heads or in value source (MiMo-V2-Flash's
sliding-window layers hold twice the KV heads of its full-attention ones), placed kind by kind
(:func:`place_layer_forms`), and the zero padding that gives every layer's heads one width (:func:`pad_heads`).

A :class:`LayerForm` per layer says each head's value and read width ``head_dim``, the KV heads and the value source
(:attr:`Structure.layer_forms <mfpipe.models.adapters.structure.Structure>`; empty where every attention layer has the
placed block's form, as in every family placed before). The query heads ``H`` are the model's in every layer.

**Padding is an exact embedding.** The adapter's ``d_head`` is the widest layer's width; a layer ``l`` of width
``dh_l`` has its values, its reads and the rows of its output projection's head slices zero-padded, ``E_l v``,
``E_l z`` and ``E_l O_h`` with ``E_l`` the isometry ``R^{dh_l} -> R^{d_head}`` that appends zeros. So
``(E_l z) (E_l O_h) = z O_h``: every sum of values or reads is the padded sum, every product through ``O_h`` and every
dot product or norm in head space is unchanged, and the padded coordinates are exactly 0 (tests/test_layer_forms.py
checks the statistics, pass 2, the substitution and the rollout of a padded model against the unpadded one). The
site writes a replaced read back as the layer's own ``dh_l`` coordinates and refuses nonzero padded ones.

**Placement by kind.** The attention layers are grouped by their attention module's signature (its class and the
paths and shapes of its projections). Where there is more than one kind, the block
``describe`` placed gives its kind's form, and one block of each other kind is placed by a reduced probe
(:func:`~mfpipe.models.adapters.probe.probe_forward` on that block's attention, output projection and projections):
its width is its output projection's input over ``H``, and the value search
(:func:`~mfpipe.models.adapters.probe.value_layout`) finds its value source and KV heads against its own reads. Norm
roles, the MLP and an output gate are the placed block's (the conformance check rebuilds every layer). A kind is
placed for a value projection of its own (the ``split`` layout) or a chunked one, latent attention's among them: each
kind's latent and its values' offset in the decompressing projection are its own (dots.3-note's sliding layers: wider
keys per head, so the values sit at another offset of each head's ``[k_nope | v]`` chunk).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from mfpipe.models.adapters.convolved import conv_watch, value_convs
from mfpipe.models.adapters.gate import gated_layout
from mfpipe.models.adapters.latent import Latent, latent_sources
from mfpipe.models.adapters.linears import attention_linears, linear_paths
from mfpipe.models.adapters.probe import (Shape, UnsupportedArchitectureError, is_norm, linear_shape, probe_forward,
                                          same_within, submodule, value_layout)

__all__ = ["FORM_LAYOUTS", "LayerForm", "attention_signature", "pad_heads", "place_layer_forms", "unpadded"]


FORM_LAYOUTS = ("split", "chunked")  # the value layouts a layer of another kind may have


@dataclass(frozen=True)
class LayerForm:
    """One layer's attention form: each head's value and read width, its KV heads (query head ``h`` reads KV head
    ``h // (H // kv_heads)``) and its value source (a path from the block), laid out ``split`` (``[KV * head_dim]``) or
    ``chunked`` (``value_chunks`` equal chunks, the values at ``value_offset`` of each:
    :func:`~mfpipe.models.adapters.probe.chunk_index`), reading ``latent`` where it is latent attention's (its paths
    from the block: :func:`~mfpipe.models.adapters.latent.latent_input`)."""

    head_dim: int
    kv_heads: int
    value_source: str
    value_layout: str = "split"
    value_chunks: int = 1
    value_offset: int = 0
    latent: Latent | None = None


def _in_block(latent: Latent | None, attn: str) -> Latent | None:
    """``latent`` (names in the attention) with its paths from the block."""
    return None if latent is None else Latent(f"{attn}.{latent.proj}", latent.offset, latent.width,
                                              f"{attn}.{latent.norm}", latent.scale)


def _form(found: dict, head_dim: int, kv: int, attn: str) -> LayerForm:
    """The :class:`LayerForm` of a value search's result ``found`` (:func:`~mfpipe.models.adapters.probe.value_layout`)
    with heads ``head_dim`` wide reading ``kv`` KV heads."""
    chunked = found["value_layout"] == "chunked"
    return LayerForm(head_dim, kv, f"{attn}.{found['value_source']}", found["value_layout"],
                     found["value_chunks"] if chunked else 1, found["value_offset"] if chunked else 0,
                     _in_block(found.get("latent"), attn))


def attention_signature(attn_mod: nn.Module) -> tuple:
    """What tells two layers' attention forms apart: the class and its projections' paths and shapes (MiMo-V2-Flash's
    sliding-window layers: wider key and value projections). A parameter of its own some layers hold does not (their
    sinks; GPT-NeoX-Japanese's last block's returned bias): it changes no head's width, KV heads or value source."""
    return type(attn_mod).__name__, tuple((n, linear_shape(m)) for n, m in linear_paths(attn_mod).items())


def pad_heads(t: Tensor, width: int) -> Tensor:
    """``t [..., dh_l]`` with zeros appended to ``width`` (``t`` itself where it is that wide already)."""
    extra = width - t.shape[-1]
    return t if extra == 0 else nn.functional.pad(t, (0, extra))


def unpadded(t: Tensor, width: int, who: str) -> Tensor:
    """The first ``width`` coordinates of padded head-space rows ``t [..., d_head]``; a ValueError where a padded
    coordinate is not 0 (a caller's bug: those coordinates are no head's)."""
    if t.shape[-1] == width:
        return t
    rest = t[..., width:]
    if bool((rest != 0).any()):
        raise ValueError(f"{who}: the replacement has nonzero entries in the padded coordinates {width}.."
                         f"{t.shape[-1] - 1} of a layer whose heads are {width} wide; keep them 0 (Adapter.head_dim)")
    return t[..., :width]


def place_layer_forms(model, base, blocks, kinds: list[str], attn: str, out_proj: str, first: int, found: dict,
                      shape: Shape, mt, source_form) -> tuple[LayerForm, ...]:
    """Each layer's :class:`LayerForm` where the attention layers are of more than one kind, else ``()``. ``first``:
    the block :func:`~mfpipe.models.adapters.structure.describe` placed (``found``: the probe's results for it, ``shape``
    with its read width); ``source_form(attn_mod, seen)``: rewrites the probe's value-source outputs as that attention
    reads them (:func:`~mfpipe.models.adapters.forms.formed_sources`)."""
    attention = [l for l, k in enumerate(kinds) if k == "attention"]
    signature = {l: attention_signature(submodule(blocks[l], attn)) for l in attention}
    if len(set(signature.values())) < 2:
        return ()
    if out_proj is None:
        raise UnsupportedArchitectureError(mt, "its attention layers are of several kinds, its output projection "
                                               "beside the attention: mfpipe places layers of several kinds whose "
                                               "projection is the attention's")
    if found["value_layout"] not in FORM_LAYOUTS:
        raise UnsupportedArchitectureError(mt, f"its attention layers are of {len(set(signature.values()))} kinds, "
                                               f"and its values are laid out {found['value_layout']}: mfpipe places "
                                               "layers of several kinds for a value projection of their own or a "
                                               "chunked one only")
    forms = {signature[first]: _form(found, shape.dh, int(found["kv_heads"] or shape.KV), attn)}
    for l in attention:
        if signature[l] not in forms:
            forms[signature[l]] = _kind_form(model, base, blocks[l], l, attn, out_proj, shape, mt, source_form, found)
    return tuple(forms[signature[l]] if l in signature else forms[signature[first]] for l in range(len(kinds)))


def _kind_form(model, base, block, layer: int, attn: str, out_proj: str, shape: Shape, mt, source_form,
               placed: dict) -> LayerForm:
    """The form of one block of another kind: its read width from its output projection, its value source, layout,
    latent and KV heads from the value search against its own reads (a reduced probe forward; reads gated as the
    placed block's ``placed`` are, whose gate this kind must have too)."""
    attn_mod = submodule(block, attn)
    o = submodule(attn_mod, out_proj)
    io = linear_shape(o)
    if io is None or io[1] != shape.d or io[0] % shape.H:
        raise UnsupportedArchitectureError(mt, f"layer {layer}'s output projection ({out_proj}: {io}) is no "
                                               f"{shape.H} heads' reads to the width {shape.d}")
    dh = io[0] // shape.H
    linears, sources = attention_linears(attn_mod, out_proj, shape.d)
    watch = {"<attn>": attn_mod, "<out_proj>": o} | {f"<src>{n}": submodule(attn_mod, n) for n in linears}
    watch |= {f"<anorm>{n}": m for n, m in attn_mod.named_children() if is_norm(m)}  # a latent's norm
    watch |= conv_watch(attn_mod)  # Inkling's v_sconv
    seen, order = probe_forward(model, base, watch)
    source_form(attn_mod, seen)
    dtype = next(attn_mod.parameters()).dtype
    dtype = dtype if dtype.is_floating_point else torch.float32
    latents = latent_sources(seen, attn_mod, out_proj, shape.d, same_within(dtype)) if placed.get("latent") else {}
    # the placed block's value source first, as wide as this kind's heads make it (a layer whose KV heads repeat
    # would fit other layouts too); the value search then confirms it against the reads, or searches every layout
    source = placed["value_source"]
    width = linear_shape(submodule(attn_mod, source))[1] if source in sources else 0
    named = width and width % dh == 0 and shape.H % (width // dh) == 0
    kv = width // dh if named else shape.KV
    kind = Shape(L=shape.L, H=shape.H, KV=kv, dh=dh, d=shape.d)
    try:
        got = gated_layout(seen, attn_mod, out_proj, shape.H, dh, order, lambda s: value_layout(
            s, sources, (source, "split") if named else None, kind, mt, dtype, latents,
            value_convs(s, attn_mod, sources)))
    except UnsupportedArchitectureError as e:
        raise UnsupportedArchitectureError(mt, f"layer {layer}, of another attention kind than the placed block: "
                                               f"{e.reason}") from None
    gate, placed_gate = _gate_kind(got["gate"]), _gate_kind(placed.get("gate"))
    conv, placed_conv = got.get("value_conv"), placed.get("value_conv")
    if got["value_layout"] not in FORM_LAYOUTS or gate != placed_gate or conv != placed_conv:
        why = (f"lays its values out {got['value_layout']}" if got["value_layout"] not in FORM_LAYOUTS else
               f"gates its reads otherwise ({gate}, the placed block's {placed_gate})" if gate != placed_gate else
               f"convolves its values otherwise ({conv}, the placed block's {placed_conv})")
        raise UnsupportedArchitectureError(mt, f"layer {layer}, of another attention kind than the placed block, "
                                               f"{why}: mfpipe places layers of several kinds for a value projection "
                                               "of their own or a chunked one, gated and convolved as the placed "
                                               "block's")
    return _form(got, dh, int(got["kv_heads"] or kv), attn)


def _gate_kind(gate) -> tuple | None:
    """What of an output gate (:func:`~mfpipe.models.adapters.gate.gated_layout`'s ``gate``) every layer must share:
    its source, whether it runs first, its activation and its bias (its slice is the same in a layer of the width)."""
    return None if gate is None else (gate[0], gate[2], gate[3], gate[4])
