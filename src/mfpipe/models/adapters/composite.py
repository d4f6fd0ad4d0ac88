"""Multimodal composites whose language model is a decoder (Gemma-3, Gemma-4, Llama-4, Qwen-3.5, ...): placed through
that language model, on text-only input.

A composite's config holds its decoder's one level down (``text_config``: :func:`text_config`), and the causal LM
transformers builds for it is either already the decoder's own text-only class (Llama-4, Qwen-3.5, Mllama:
``AutoModelForCausalLM`` swaps in the text config itself) or the whole conditional-generation model, the decoder beside
a vision or audio tower (Gemma-3's ``Gemma3ForConditionalGeneration``: ``model.language_model`` and ``lm_head``).
:func:`language_model` turns the second kind into the first: the decoder's text-only causal LM (the class
``AutoModelForCausalLM`` builds for the text config, Gemma-3's ``Gemma3ForCausalLM``) assembled around the composite's
own language model (embedding, blocks, final norm) and LM head -- the same modules, shared, not copied, so the weights
are the composite's and a hook on a block sees both forwards. Everything downstream (the placement, the read/patch
site, every job) then reads an ordinary decoder; the towers are dropped with the composite. On text-only input the
text LM's forward is the composite's (tests/test_families.py compares the logits; tests/test_stats_reference.py and
tests/test_substitution.py run their per-position and hook references on the composite's own forward).
"""

from __future__ import annotations

from torch import nn

from mfpipe.models.adapters.probe import UnsupportedArchitectureError
from mfpipe.models.adapters.structure import base_model

__all__ = ["is_composite", "language_model", "shrink_composite", "text_config"]


def text_config(config):
    """The decoder's config of a composite (``config.get_text_config(decoder=True)``: its ``text_config``), else
    ``config`` itself (also where the sub-configs are ambiguous: transformers refuses to choose, and so does this)."""
    get = getattr(config, "get_text_config", None)
    if not callable(get):
        return config
    try:
        return get(decoder=True)
    except ValueError:  # several decoder sub-configs (an encoder-decoder's): none is "the" language model
        return config


def is_composite(config) -> bool:
    """Whether ``config`` holds its decoder's config one level down."""
    return text_config(config) is not config


def shrink_composite(config, shrink):
    """A tiny copy of the composite ``config``: each of its sub-configs (the text one and the towers') replaced by
    ``shrink(sub_config)`` (:func:`mfpipe.models.tiny.shrink_config`, passed in: the test recipes stay out of this
    package), the rest as set. Only the language model is ever run; the towers are shrunk so that building the
    composite costs nothing. Where the composite's validator refuses that (a width the sub-configs share: DOTS-3's
    vision adapter writes the text width), ``shrink(config)`` of the whole, which shrinks a width the sub-configs share
    alike."""
    try:
        return _shrink_each(config, shrink)
    except Exception:  # a validator of the whole: the sub-configs shrunk apart broke what they share
        tiny = shrink(config)
        tiny._attn_implementation = "eager"
        return tiny


def _shrink_each(config, shrink):
    out = config.to_dict()
    for name in getattr(config, "sub_configs", None) or {}:
        sub = getattr(config, name, None)
        if sub is not None and hasattr(sub, "to_dict"):
            out[name] = shrink(sub).to_dict()
    for k in ("architectures", "auto_map", "_name_or_path", "transformers_version"):
        out.pop(k, None)
    tiny = type(config)(**out)
    tiny._attn_implementation = "eager"
    return tiny


def language_model(model: nn.Module) -> nn.Module:
    """The text-only causal LM of a composite ``model`` (see the module docstring), sharing its modules; any other
    model as it is. Raises :class:`UnsupportedArchitectureError` where the composite holds no module of the class the
    text config's causal LM is built on (or holds several), or no LM head of the text vocabulary."""
    cfg = getattr(model, "config", None)
    if cfg is None or not is_composite(cfg):
        return model
    import torch
    import transformers

    tcfg, mt = text_config(cfg), getattr(cfg, "model_type", None)
    with torch.device("meta"):  # a shell: its decoder and head are replaced by the composite's, nothing is allocated
        lm = transformers.AutoModelForCausalLM.from_config(tcfg, attn_implementation="eager")
    if isinstance(model, type(lm)):
        return model
    shell = base_model(lm)
    slot = next((n for n, m in lm.named_children() if m is shell), None)
    found = [m for m in model.modules() if type(m) is type(shell)]
    head = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None
    if slot is None or len(found) != 1 or not isinstance(head, nn.Linear) or head.out_features != int(tcfg.vocab_size):
        raise UnsupportedArchitectureError(mt, f"cannot place its language model: {len(found)} modules of class "
                                               f"{type(shell).__name__} and LM head {type(head).__name__} (the text "
                                               f"config's causal LM, {type(lm).__name__}, needs one of each)")
    setattr(lm, slot, found[0])
    lm.set_output_embeddings(head)
    lm.config = found[0].config
    left = [n for n, t in [*lm.named_parameters(), *lm.named_buffers()] if t.is_meta]
    if left:  # a text causal LM with pieces of its own beyond the decoder and the head: not the composite's
        raise UnsupportedArchitectureError(mt, f"cannot place its language model: {type(lm).__name__} has "
                                               f"{', '.join(left[:3])} beside the decoder and the LM head")
    lm.train(model.training)
    return lm
