"""A hybrid's blocks of another mixer than attention (Jamba's and Nemotron-H's Mamba, Recurrent-Gemma's recurrent
block, OLMo-Hybrid's and LFM-2's others: :attr:`Adapter.layer_kinds <mfpipe.models.adapters.base.Adapter>`) as
functions of residual rows, for the open-loop rollout (:mod:`mfpipe.experiments.rollout.algorithm`).

:func:`mixer_block` runs such a block as the model runs it, on each row as a sequence of one position: the mixer with
no history before the row (a Mamba or recurrent state starting from zero, a delta-net's from its initial state), then
the block's own MLP. The block is called with the arguments the model's forward hands it on a one-token input
(position ids, masks), captured once per adapter by a plain torch pre-hook
(:func:`~mfpipe.models.adapters.calls.one_token_call`): a block's
signature differs by family (Recurrent-Gemma's needs its position ids and mask), and so the call is the model's own.

It also names a block's kind for :func:`~mfpipe.models.adapters.structure.describe`: a mixer's by its class name
(:data:`MIXERS`, :func:`mixer_kind`, less the family's words: :func:`own_name`).
"""

from __future__ import annotations

import re

import torch
from torch import Tensor, nn

from mfpipe.models.adapters.capture import first_output
from mfpipe.models.adapters.forms import IDENTITY_KINDS
from mfpipe.models.adapters.calls import one_token_call
from mfpipe.models.adapters.probe import is_norm
from mfpipe.models.adapters.streaming import held

__all__ = ["MIXERS", "check_attention", "layer_kinds", "mixer_block", "mixer_kind", "own_name"]


# a module whose class name says it is no softmax attention over the text (a hybrid's other blocks: Kimi-Linear's
# KimiDeltaAttention, though its name ends in "Attention"; Mllama's cross-attention), and the kind its block gets
MIXERS = (("cross", "cross_attention"), ("mamba", "mamba"), ("deltanet", "gated_delta_net"), ("delta", "delta_net"),
          ("linear", "linear_attention"), ("lightning", "linear_attention"), ("recurrent", "recurrent"),
          ("rglru", "recurrent"), ("conv", "convolution"), ("ssm", "state_space"), ("rwkv", "rwkv"), ("mixer", "mixer"))


def mixer_kind(block: nn.Module) -> str:
    """The kind of a block without attention: its mixer's (:data:`MIXERS`, by class name), "mlp" where it holds an
    MLP or a mixture of experts only (Nemotron-H's), else its first module's class name."""
    kids = [c for c in block.children() if not is_norm(c) and any(True for _ in c.parameters())]
    names = [own_name(c, block) for c in kids]
    # by the names less the family's words first, then by the whole names (Jamba's JambaMambaMixer in a
    # JambaMambaDecoderLayer is a "mixer" less its family's words)
    for pool in (names, [type(c).__name__.lower() for c in kids]):
        for token, kind in MIXERS:
            if any(token in n for n in pool) and (kind != "mixer" or pool is not names):
                return kind
    if names and all(any(t in n for t in ("mlp", "moe", "expert", "feedforward")) for n in names):
        return "mlp"
    return names[0] if names else "identity"


def own_name(module: nn.Module, block: nn.Module) -> str:
    """``module``'s class name, lower case, less the words it shares with its block's at the start (the family's
    name: Recurrent-Gemma's ``RecurrentGemmaAttention`` is ``attention``, no recurrent mixer)."""
    def words(name):
        return re.findall(r"[A-Z][a-z0-9]*|[a-z0-9]+|[A-Z]+(?![a-z])", name)

    own, outer = words(type(module).__name__), words(type(block).__name__)
    n = 0
    while n < min(len(own), len(outer)) - 1 and own[n] == outer[n]:
        n += 1
    return "".join(own[n:]).lower()


def layer_kinds(structure, n_layers: int) -> tuple[tuple[str, ...], tuple[int, ...], bool]:
    """(each layer's kind: "attention" or a hybrid's other mixer, from ``structure.layer_kinds``; the attention layers;
    whether any layer is of another kind)."""
    kinds = tuple(structure.layer_kinds) or ("attention",) * n_layers
    if len(kinds) != n_layers:
        raise ValueError(f"the structure names {len(kinds)} layer kinds for {n_layers} layers")
    attention = tuple(l for l, k in enumerate(kinds) if k == "attention")
    return kinds, attention, len(attention) < n_layers


def check_attention(adapter, layer: int, what: str) -> None:
    """Refuse a block piece ``what`` (a module path) of a hybrid's layer of another mixer, which has none."""
    kind = adapter.layer_kinds[layer]
    if kind != "attention":
        raise ValueError(f"{adapter.model_type}: layer {layer} is a {kind} layer, not attention: it has no {what} (the "
                         f"attention layers: {list(adapter.attention_layers)})")

@torch.no_grad()
def mixer_block(adapter, layer: int, x: Tensor) -> Tensor:
    """Block ``layer`` of a hybrid (any kind) on the rows ``x [..., d]``, each a sequence of one position: the block's
    output ``[..., d]`` (the residual leaving it), float32. Run so rather than passed through: the mixer and the
    block's MLP move the residual as much as an attention block does, and with nothing before the row the mixer's
    output is a function of the row alone, as the MLP's is (a mixer reads no mean field of its context here: only
    attention has one). A block the forward skips (Mllama's cross-attention on text: adapters.forms) is the identity."""
    if adapter.layer_kinds[layer] in IDENTITY_KINDS:
        return x.float()
    args, kwargs = one_token_call(adapter, layer)
    rows = x.reshape(-1, 1, x.shape[-1]).to(device=adapter.device, dtype=adapter.dtype)
    with held(adapter.block_module(layer)):
        y = adapter.block_module(layer)(rows, *args, **kwargs)
    y = first_output(y)
    return y.reshape(x.shape).float()
