"""Attentions that return their probabilities only when asked: GPT-1's ``Attention.forward(x, attention_mask,
output_attentions=False)`` returns ``[a]`` unless its caller passes ``output_attentions=True``, and the model's forward
passes it only where the whole model is asked for every layer's attentions (each layer's kept to the end of the
forward). A pre-hook on each such attention module asks it instead, so that it returns ``[a, probs]`` as the modern
eager attentions do; its block hands the probabilities on beside its output, which the model's forward drops: no
layer's are kept. And what the probabilities a placement reads say of the model: :func:`reads_ahead` (an encoder's
attention, which reads later positions)."""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Iterable

import torch
from torch import nn

__all__ = ["ask_for_probabilities", "reads_ahead"]

_ASKED: weakref.WeakSet = weakref.WeakSet()  # the modules hooked (once each: a model placed twice)
_FLAG = "output_attentions"


def ask_for_probabilities(modules: Iterable[nn.Module]) -> int:
    """Hooks every module of ``modules`` whose forward takes ``output_attentions`` so that it is always called with
    ``True``; returns how many it hooked (0 for the attentions that return their probabilities anyway)."""
    n = 0
    for m in modules:
        if m in _ASKED:
            continue
        names = list(inspect.signature(m.forward).parameters)
        if _FLAG not in names:
            continue
        at = names.index(_FLAG)
        m.register_forward_pre_hook(lambda mod, args, kwargs, at=at: _asked(args, kwargs, at), with_kwargs=True)
        _ASKED.add(m)
        n += 1
    return n


def _asked(args: tuple, kwargs: dict, at: int) -> tuple[tuple, dict]:
    if len(args) > at:  # passed by position
        return args[:at] + (True,) + args[at + 1:], kwargs
    return args, {**kwargs, _FLAG: True}


def reads_ahead(out) -> bool:
    """Whether an attention's output ``out`` (``[0]`` its branch, ``[1]`` its probabilities ``[B, H, T, T]``) gives a
    query weight on a later key: an encoder's, or a BERT-style decoder's without ``is_decoder=True`` (a mask's
    ``-inf`` or ``finfo.min`` gives an exact 0 above the diagonal; probabilities of another shape say nothing)."""
    probs = out[1] if isinstance(out, (tuple, list)) and len(out) > 1 else None
    if not isinstance(probs, torch.Tensor) or probs.ndim < 2 or probs.shape[-1] != probs.shape[-2]:
        return False
    return bool(torch.triu(probs.detach().abs(), 1).amax() > 0)
