"""A hybrid's blocks of another mixer than attention (Jamba's and Nemotron-H's Mamba, Recurrent-Gemma's recurrent
block, OLMo-Hybrid's and LFM-2's others: :attr:`Adapter.layer_kinds <mfpipe.models.adapters.base.Adapter>`) as
functions of residual rows, for the open-loop rollout (:mod:`mfpipe.experiments.rollout.algorithm`).

:func:`mixer_block` runs such a block as the model runs it, on each row as a sequence of one position: the mixer with
no history before the row (a Mamba or recurrent state starting from zero, a delta-net's from its initial state), then
the block's own MLP. The block is called with the arguments the model's forward hands it on a one-token input
(position ids, masks), captured once per adapter by a plain torch pre-hook (:func:`one_token_call`): a block's
signature differs by family (Recurrent-Gemma's needs its position ids and mask), and so the call is the model's own.
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor

from mfpipe.models.adapters.forms import IDENTITY_KINDS
from mfpipe.models.adapters.streaming import held

__all__ = ["check_attention", "layer_kinds", "mixer_block", "one_token_call"]


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

_CALLS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # adapter -> {layer: (args, kwargs)}


@torch.no_grad()
def one_token_call(adapter, layer: int) -> tuple[tuple, dict]:
    """(the positional arguments after the hidden states, the keyword arguments) the model's forward calls block
    ``layer`` with on a one-token input ``[[0]]``, without its hidden states and cache (no cache is kept)."""
    calls = _CALLS.get(adapter)
    if calls is None:
        calls = {}

        def hook(l):
            def pre(mod, args, kwargs):
                calls[l] = (tuple(args[1:]), {k: v for k, v in kwargs.items() if k != "hidden_states"})
            return pre

        handles = [adapter.block_module(l).register_forward_pre_hook(hook(l), with_kwargs=True)
                   for l in range(adapter.n_layers)]
        try:
            adapter.base(torch.zeros(1, 1, dtype=torch.long, device=adapter.device), use_cache=False)
        finally:
            for h in handles:
                h.remove()
        _CALLS[adapter] = calls
    return calls[layer]


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
    y = y[0] if isinstance(y, tuple) else y
    return y.reshape(x.shape).float()
