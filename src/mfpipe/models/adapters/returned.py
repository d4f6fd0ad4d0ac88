"""Values a module of the attention returns among several outputs, already one tensor ``[B, T, KV, dh]`` per head:
Zaya's CCA projection (``qkv_proj``) returns ``(query, key, value)``, its value heads half from the current token's
projection and half from the previous token's (a delayed value: what a head reads at key ``j`` is a function of
positions ``j`` and ``j - 1``). No projection of the width d gives those values; the module does.

The probe watches the attention's other children (:func:`returning_children`) and offers each 4-D element of a
tuple one returns as a value-source candidate ``<src>NAME#i`` (:func:`returned_sources`), which the value search
(:func:`~mfpipe.models.adapters.probe.value_layout`) confirms against the reads like any projection. The placed
source keeps the suffix (``self_attn.qkv_proj#2``): :func:`split_source` parts it, the site reads element ``i`` of
the module's output (:func:`returned_values`), and the value map runs the module itself on the attention-input
norm's output (:func:`run_source`), the statistics summing the values as read (no value weights: not a linear map
of one position)."""

from __future__ import annotations

import inspect

from torch import Tensor, nn

__all__ = ["returning_children", "returned_sources", "split_source", "returned_values", "run_source"]


def returning_children(attn_mod: nn.Module, linears) -> dict[str, nn.Module]:
    """The probe's watch of the attention's children that hold modules of their own and are no projection
    (``linears``): candidates for a module returning the values among its outputs (``<tuple>NAME``)."""
    return {f"<tuple>{n}": m for n, m in attn_mod.named_children()
            if n not in linears and any(True for _ in m.children())}


def returned_sources(seen: dict, dh: int) -> list[str]:
    """Each 4-D ``[1, T, k, dh]`` element ``i`` of a tuple a watched child returned (:func:`returning_children`) as
    a value-source candidate ``<src>NAME#i`` in ``seen`` (``[1, T, k dh]``, as a projection's output); their names."""
    names = []
    for key in [k for k in seen if k.startswith("<tuple>")]:
        got, name = seen[key], key[len("<tuple>"):]
        if not isinstance(got.out, tuple):
            continue
        for i, t in enumerate(got.out):
            if isinstance(t, Tensor) and t.dim() == 4 and t.shape[-1] == dh and t.shape[1] == got.x.shape[-2]:
                y = t.detach().flatten(-2)
                seen[f"<src>{name}#{i}"] = got._replace(y=y.float().clone(), y_obj=y)
                names.append(f"{name}#{i}")
    return names


def split_source(path: str) -> tuple[str, int | None]:
    """A value source's module path and the index of its output the values are (None: the output itself)."""
    head, _, i = path.partition("#")
    return head, (int(i) if i else None)


def returned_values(out, index: int) -> Tensor:
    """The values ``[B, T, KV dh]`` among a returning module's outputs ``out`` (nnsight's or torch's)."""
    return out[index].flatten(-2)


def run_source(module: nn.Module, h: Tensor, index: int) -> Tensor:
    """The values ``[..., KV dh]`` the returning ``module`` gives for the attention-input norm's output ``h``: a
    sequence ``[B, T, d]`` as the model runs it; rows ``[N, d]`` each a sequence of one position (a delayed value's
    earlier position then absent, as the model's first position's). Its other inputs (a cache) are None."""
    extra = [p for p in list(inspect.signature(module.forward).parameters.values())[1:]
             if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    x = h if h.dim() == 3 else h.reshape(-1, 1, h.shape[-1])
    v = returned_values(module(x, *[None] * len(extra)), index)
    return v if h.dim() == 3 else v.reshape(*h.shape[:-1], -1)
