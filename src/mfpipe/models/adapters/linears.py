"""An attention's projections by path (:func:`linear_paths`), for :mod:`~mfpipe.models.adapters.structure`, the probe
and :mod:`~mfpipe.models.adapters.unplaced`: its linear children (``nn.Linear``, transformers' ``Conv1D``), and a
child that only wraps one linear and calls it (Moshi's ``MoshiLinear``, which holds ``linear`` and passes a codebook
index the text model leaves None: path ``o_proj.linear``). A wrapper is one where the forward confirms it: the probe
checks every projection it places against the attention's reads and output."""

from __future__ import annotations

from torch import Tensor, nn

__all__ = ["attention_linears", "linear_paths"]


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
