"""Input gradients through a 16-bit model's linear layers, on a CPU, at the speed of its forward (issue 58, the
J-lens's backward passes).

A linear layer's backward to its input is ``g @ W`` with ``W [out, in]`` as the model stores it. On a CPU with
oneDNN off (the pinned numerics, :func:`mfpipe.workflow.numerics.pin_torch`), torch's bfloat16 kernel for that
product, whose right operand is read down its columns, runs at 0.8 GFLOP/s on this machine, where the forward's
``x @ W.T`` runs at 28 and float32 at 60-110 (``benchmarks/README.md``, "The J-lens of a bfloat16 model"): the
J-lens of Gemma-2-2B spent its hours there. Within :func:`fast_input_grads`, each ``nn.Linear`` of the model, in a
forward with a graph, returns the value of its own forward (``F.linear``, the same kernel: the same result bit for
bit) carrying the gradient of the same product in float32 (``y + (z - z.detach())``, ``z`` the float32 product, so
the value added is 0): the backward computes ``g @ W`` in float32 and rounds it to ``g``'s dtype. A 16-bit kernel
accumulates in float32 as well, so the two differ by the order of the float32 sums before that rounding. The graph
saves the 16-bit weight, not its float32 copy, which each backward rebuilds (``saved_tensors_hooks``): no weight is
held twice, and a batch of backward passes (``is_grads_batched``, under ``vmap``) is one float32 product, which a
custom ``autograd.Function`` would not be (vmap runs its backward one pass at a time). The J-lens switches the
parameters' ``requires_grad`` off; a forward without a graph (its prefix's) runs the module as it is.

At Gemma-2-2B's shape (2 of its layers, T = 512, a position at 256, two threads) a backward pass through one token
costs 16 ms this way and 341 ms through the model's own backward (``benchmarks/backward16.py``); much of what is left
is the attention's backward through the cached keys and values (their gradients, computed and then dropped: they
are constants of the Jacobian).

Where it applies: 16-bit weights on a CPU. A float32 model, or any model on a GPU (whose 16-bit kernels are fast),
runs its own backward, untouched. Only exact ``torch.nn.Linear`` modules are swapped (a subclass's forward may do
more); whatever else a model multiplies with stays as it is.
"""

from __future__ import annotations

import contextlib
import types
from typing import NamedTuple

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from mfpipe.models.adapters.streaming import reread, source_of

__all__ = ["SIXTEEN_BIT", "WIDE_ROWS", "applies", "fast_input_grads"]

SIXTEEN_BIT = (torch.bfloat16, torch.float16)
# backward passes batched at least, where this applies to the passes through one token after a cached prefix: each
# batch widens every weight to float32 once (Gemma-2-2B's shape, 2 of its layers, T = 512: 52 ms a pass at 16, 41
# at 64, 40 at 128, against 345 through the model's own bfloat16 backward)
WIDE_ROWS = 64


class _Weight(NamedTuple):
    """A float32 copy of a 16-bit weight as the graph saves it: rebuilt from the weight when the backward needs it (a
    streamed block's: from where it is read, :func:`mfpipe.models.adapters.streaming.source_of`, so the backward does
    not keep the block resident)."""

    weight: Tensor | tuple
    size: tuple
    stride: tuple
    offset: int


def _pack(weight: Tensor, wide: Tensor):
    def pack(t: Tensor):
        if t.untyped_storage().data_ptr() == wide.untyped_storage().data_ptr():
            return _Weight(source_of(weight) or weight, tuple(t.size()), t.stride(), t.storage_offset())
        return t

    return pack


def _unpack(saved):
    if isinstance(saved, _Weight):
        weight = saved.weight if isinstance(saved.weight, Tensor) else reread(saved.weight)
        return weight.float().as_strided(saved.size, saved.stride, saved.offset)
    return saved


def _forward(module: nn.Linear, x: Tensor) -> Tensor:
    y = F.linear(x, module.weight, module.bias)  # the model's own kernel: the value, bit for bit
    if not (torch.is_grad_enabled() and x.requires_grad):
        return y  # a forward without a graph (the prefix's) runs as the model's
    wide = module.weight.float()
    # the graph keeps the 16-bit weight, not its float32 copy, which each backward rebuilds: no weight held twice
    with torch.autograd.graph.saved_tensors_hooks(_pack(module.weight, wide), _unpack):
        z = F.linear(x.float(), wide)  # no bias: it has no part in the input's gradient
    # the value of y, the gradient of z (z - z.detach() is 0): g @ W in float32, a batched product under vmap
    return y.detach() + (z - z.detach()).to(y.dtype)


def applies(model: nn.Module) -> bool:
    """Whether :func:`fast_input_grads` changes anything for ``model``: its first floating parameter is 16-bit and on
    the CPU."""
    p = next((p for p in model.parameters() if p.is_floating_point()), None)
    return p is not None and p.dtype in SIXTEEN_BIT and p.device.type == "cpu"


@contextlib.contextmanager
def fast_input_grads(model: nn.Module):
    """Within the block, every exact ``nn.Linear`` of ``model`` computes its input's gradient in float32 (module
    docstring), where :func:`applies`; else nothing changes. The modules' own ``forward`` is restored on exit, also
    after an error."""
    if not applies(model):
        yield
        return
    swapped = []
    try:
        for m in model.modules():
            if type(m) is nn.Linear:
                # nnsight leaves a forward of its own on each module it has traced (it calls F.linear outside a
                # trace): put back as found
                swapped.append((m, vars(m).get("forward")))
                m.forward = types.MethodType(_forward, m)
        yield
    finally:
        for m, own in swapped:
            if own is None:
                del m.forward
            else:
                m.forward = own
