"""An attention's projections by path (:func:`linear_paths`), for :mod:`~mfpipe.models.adapters.structure`, the probe
and :mod:`~mfpipe.models.adapters.unplaced`: its linear children (``nn.Linear``, transformers' ``Conv1D``), and a
child that only wraps one linear and calls it (Moshi's ``MoshiLinear``, which holds ``linear`` and passes a codebook
index the text model leaves None: path ``o_proj.linear``). A wrapper is one where the forward confirms it: the probe
checks every projection it places against the attention's reads and output, and that what the value source and the
output projection returned in its forward is the linear map of their weights (:func:`off_linear`: a quantized layer,
BitNet's ``AutoBitLinear``, which quantizes its input to 8 bits, is an ``nn.Linear`` that is not); where a fused
projection's chunks hold the values (:func:`chunk_index`)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["attention_linears", "canonical_layout", "chunk_index", "linear_paths", "off_linear"]


def _is_linear(m: nn.Module) -> bool:
    w = getattr(m, "weight", None)
    return isinstance(w, Tensor) and w.ndim == 2 and (isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D")


def linear_paths(attn_mod: nn.Module) -> dict[str, nn.Module]:
    """The attention's projections by path from it: its linear children, and ``name.child`` where a child has no
    parameters of its own and one child, a linear (a wrapper)."""
    out = {}
    for n, m in attn_mod.named_children():
        kids = list(m.named_children())
        if _is_linear(m):
            out[n] = m
        elif len(kids) == 1 and _is_linear(kids[0][1]) and not any(True for _ in m.parameters(recurse=False)):
            out[f"{n}.{kids[0][0]}"] = kids[0][1]
    return out


def attention_linears(attn_mod: nn.Module, out_proj: str, d: int) -> tuple[list[str], list[str]]:
    """(the attention's projections but its output projection ``out_proj``, those of them that read the model width
    ``d``: the value source's candidates), by path."""
    linears = {n: m for n, m in linear_paths(attn_mod).items() if n != out_proj}
    reads_d = [n for n, m in linears.items() if int(m.weight.shape[1 if isinstance(m, nn.Linear) else 0]) == d]
    return list(linears), reads_d  # a Conv1D's weight is [in, out]


def off_linear(seen: dict, root: nn.Module, keys: dict[str, str], same) -> str | None:
    """The first of the attention's projections (path from ``root``, the block -> its probe key in ``seen``:
    ``<out_proj>``, ``<src>NAME``) whose output in the probe forward is not the linear map of its weight of its input,
    to the model's rounding (``same``), as ``"path (Class)"``; None where every one is."""
    for name, key in keys.items():
        if "#" in name:  # values among a module's several outputs (adapters.returned): no projection
            continue
        m, got = root.get_submodule(name), seen.get(key)
        if got is None or not isinstance(getattr(m, "weight", None), Tensor):
            continue
        w = m.weight.t() if type(m).__name__ == "Conv1D" else m.weight  # Conv1D's weight is [in, out]
        want = nn.functional.linear(got.x_obj.to(w.dtype), w, getattr(m, "bias", None))
        y = got.y_obj  # what the module returned (the probe's y may be rewritten as the heads read it: Gemma-4's v_norm)
        if not same(want.float().reshape(y.shape), y.float()):
            return f"{name} ({type(m).__name__})"
    return None


def chunk_index(width: int, n_values: int, chunks: int, offset: int) -> Tensor:
    """The positions of the ``n_values`` values among a fused projection's ``width`` outputs laid out as ``chunks``
    equal chunks holding ``n_values / chunks`` values each at ``offset``."""
    cw, vw = width // chunks, n_values // chunks
    return (torch.arange(chunks)[:, None] * cw + offset + torch.arange(vw)[None]).reshape(-1)


def canonical_layout(W: int, kv: int, chunks: int, offset: int, H: int, dh: int) -> str:
    """The name of a value layout found among the chunked ones where it is one of the named ones (``split``, ``qkv``,
    ``neox``: :data:`~mfpipe.models.adapters.structure.VALUE_LAYOUTS`), else ``chunked``."""
    if W == kv * dh and offset == 0:
        return "split"
    if chunks == 1 and W == (H + 2 * kv) * dh and offset == (H + kv) * dh:
        return "qkv"
    if kv == H and chunks == H and W == 3 * H * dh and offset == 2 * dh:
        return "neox"
    return "chunked"
