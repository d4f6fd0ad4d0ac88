"""What a model's config says of its attention forms: a value of a config whose layers differ (:func:`config_value`)
and the forms mfpipe does not place, refused by the config keys that turn them on (:func:`check_config_forms`:
Gemma-4's KV sharing and mixture-of-experts block)."""

from __future__ import annotations

from mfpipe.models.adapters.probe import UnsupportedArchitectureError

__all__ = ["check_config_forms", "config_value"]


def check_config_forms(cfg, L: int, mt) -> None:
    """Refuse the Gemma-4 forms mfpipe does not place, by the config keys that turn them on: layers that read another
    layer's keys and values (``num_kv_shared_layers``; all of them: an assistant, a drafter fed its target's) and a
    mixture of experts beside the MLP with norms of its own (``enable_moe_block``). (Its per-layer input of each token
    after the MLP, ``hidden_size_per_layer_input``, PLE, is placed: the block runs it with each row's token,
    :func:`~mfpipe.models.adapters.calls.token_call`.)"""
    streams = config_value(cfg, "altup_num_inputs")  # Gemma-3n's several residual streams (AltUp) come first: its
    if isinstance(streams, int) and streams > 1:  # refusal is the placement's (mfpipe.models.adapters.unplaced)
        return
    shared, moe = (config_value(cfg, k) for k in ("num_kv_shared_layers", "enable_moe_block"))
    if isinstance(shared, int) and shared >= L:  # Gemma-4's assistants: their layers hold no key or value projection
        raise UnsupportedArchitectureError(mt, "every layer attends to another model's keys/values: a drafter fed "
                                               "shared_kv_states (its target's), whose heads read no values of its "
                                               "own residual stream", kind="modelling")
    if isinstance(shared, int) and shared > 0:
        raise UnsupportedArchitectureError(mt, f"its last {shared} layers (num_kv_shared_layers) read the keys and "
                                               "values an earlier layer computed of its own input: mfpipe reads each "
                                               "layer's values of the residual entering it")
    if moe is True:
        raise UnsupportedArchitectureError(mt, "its blocks add a mixture of experts beside the MLP, each branch with "
                                               "norms of its own (enable_moe_block): mfpipe reads one MLP branch")


def config_value(cfg, key: str):
    """``cfg.<key>``; where it is a per-layer attribute of a heterogeneous config that differs between layers
    (Gemma-4's head_dim: its full-attention layers' heads twice as wide), layer 0's: the other layers' are their
    per-layer forms' (:mod:`~mfpipe.models.adapters.layers`, placed by what their projections are)."""
    try:
        value = getattr(cfg, key, None)
    except Exception:  # transformers' AmbiguousGlobalPerLayerAttributeError
        return getattr(cfg.per_layer_config[0], key, None)
    return None if isinstance(value, BaseException) else value  # Gemma-4-Unified's class attributes AttributeError()
