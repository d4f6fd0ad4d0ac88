"""Configs built through transformers' strict validators: a family's default config that its own validator refuses
(:func:`default_config`), and a shrunk config a validator refuses for a value it names (:func:`build_validated`).

Some validators say exactly which value a field must have ("hidden_size_per_layer_input must be 0, got 256": the
Gemma-4 Assistant's text config, whose default is a plain Gemma-4 text config with a per-layer input). Where the
message names one such value, it is set -- on the config, or on the sub-configs that hold the field -- and the
config built again; any other refusal is raised as it is. And the sizes some default configs leave unset though their
model needs them (:func:`fill_default_gaps`: the default builds no model), with the key names of depth and experts
:mod:`mfpipe.models.shrink` shares. And a config.json's contents with the floats transformers writes as tags made
floats again (:func:`special_floats`), for a config built from a file's contents as the workflow's planning does.
"""

from __future__ import annotations

import dataclasses
import re

__all__ = ["default_config", "build_validated", "fill_default_gaps", "special_floats", "EXPERT_COUNT", "TOP_K",
           "LAYER_KEYS", "MAX_EXPERTS", "MAX_TOP_K"]

# the names configs give their depth, their expert count and their experts per token; a tiny copy keeps at most
# MAX_EXPERTS experts and MAX_TOP_K per token
LAYER_KEYS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers")
EXPERT_COUNT = re.compile(r"^(num_experts|n_routed_experts|num_local_experts|moe_num_experts|n_experts|"
                          r"num_routed_experts|zero_expert_num|num_experts_total)$")
TOP_K = re.compile(r"^(num_experts_per_tok|num_experts_per_token|moe_topk|moe_top_k|top_k|router_top_k|"
                   r"num_selected_experts|moe_k)$")
MAX_EXPERTS, MAX_TOP_K = 4, 2

# a validator's message naming the one value a field accepts ("hidden_size_per_layer_input must be 0, got 256")
_MUST = re.compile(r"`?(\w+)`? must be (-?\d+|True|False|None)\b,? got")
_LITERALS = {"True": True, "False": False, "None": None}
_TRIES = 8
_MISSING = object()


def _named_value(error: Exception):
    """The (field, value) a validator's message names, or None."""
    m = _MUST.search(str(error))
    if m is None:
        return None
    raw = m.group(2)
    return m.group(1), (_LITERALS[raw] if raw in _LITERALS else int(raw))


def _put_nested(d: dict, key: str, value) -> bool:
    """Set ``key`` to ``value`` wherever ``d`` or a dict inside it holds another value for it; whether any did."""
    found = False
    if key in d and d[key] != value:
        d[key], found = value, True
    for v in d.values():
        if isinstance(v, dict):
            found = _put_nested(v, key, value) or found
    return found


def build_validated(cls, kwargs: dict):
    """``cls(**kwargs)``; where a strict validator names the one value a field must have, that value (in ``kwargs`` or
    a sub-config dict inside it), and again."""
    for _ in range(_TRIES):
        try:
            return cls(**kwargs)
        except Exception as e:
            named = _named_value(e)
            if named is None or not _put_nested(kwargs, *named):
                raise
    return cls(**kwargs)


def default_config(model_type: str):
    """The default config of the family ``model_type`` (``CONFIG_MAPPING[model_type]()``); where its own validator
    refuses it naming the one value a field must have, that value, set on the config if the field is its own, else on
    its text config (or every sub-config) -- and again."""
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    own = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    subs = list(getattr(cls, "sub_configs", None) or {})
    subs = ["text_config"] if "text_config" in subs else subs
    kwargs: dict = {}
    for _ in range(_TRIES):
        try:
            return cls(**kwargs)
        except Exception as e:
            named = _named_value(e)
            if named is None:
                raise
            key, value = named
            if key in own and kwargs.get(key, _MISSING) != value:
                kwargs[key] = value
            elif subs and any(kwargs.get(n, {}).get(key, _MISSING) != value for n in subs):
                for n in subs:
                    kwargs[n] = {**kwargs.get(n, {}), key: value}
            else:
                raise
    return cls(**kwargs)


def fill_default_gaps(model_type: str, out: dict, heads: int, head_dim: int) -> None:
    """Sizes that some default configs of transformers (5.24) leave unset although their model needs them -- the
    default config itself builds no model -- filled in the shrunk config dict ``out`` (in place) with small values,
    only where unset (a checkpoint's config sets them)."""
    if isinstance(out.get("moe_intermediate_size"), int):  # a mixture of experts with no expert count (Dots1)
        for k in [k for k in out if out[k] is None]:
            if EXPERT_COUNT.match(k):
                out[k] = MAX_EXPERTS
            elif TOP_K.match(k):
                out[k] = MAX_TOP_K
            elif "expert" in k and "shared" in k and "size" not in k:
                out[k] = 1
    if model_type == "dbrx" and isinstance(out.get("attn_config"), dict):  # its attention reads attn_config.rope_theta
        attn = out["attn_config"]
        attn.setdefault("rope_theta", (out.get("rope_parameters") or {}).get("rope_theta", 10_000.0))
        if attn.get("clip_qkv") is None:  # and clamps by clip_qkv, None by default (DBRX's checkpoints: 8)
            attn["clip_qkv"] = 8.0
    layers = next((out[k] for k in LAYER_KEYS if isinstance(out.get(k), int)), 0)
    if model_type == "lfm2_moe" and out.get("layer_types") is None:  # its checkpoints mix convolutions and attention
        out["layer_types"] = [("conv", "full_attention")[i % 2] for i in range(layers)]
    if "indexed_attention" in (out.get("layer_types") or ()) and out.get("indexer_n_heads", 0) is None:
        # Qwen-4-Exp's indexed attention with no indexer sizes: one KV head, a budget of 8 tokens in blocks of 4
        out.update(indexer_n_heads=heads, indexer_kv_heads=1, indexer_head_dim=head_dim, indexer_budget=8,
                   indexer_compress_ratio=4)
    if out.get("rope_parameters") == {} and out.get("layer_types"):  # per-layer-type rope with no entry (Cohere's)
        out["rope_parameters"] = {kind: {"rope_type": "default", "rope_theta": 10_000.0}
                                  for kind in dict.fromkeys(out["layer_types"])}


_FLOATS = {"NaN": float("nan"), "Infinity": float("inf"), "-Infinity": float("-inf")}


def special_floats(obj):
    """``obj`` (a config.json's contents) with the floats JSON has no number for as transformers writes them,
    ``{"__float__": "Infinity"}`` (Granite-4.0-H's ``time_step_limit``), made floats again, as its loader does."""
    if isinstance(obj, dict):
        tag = obj.get("__float__") if len(obj) == 1 else None
        return _FLOATS[tag] if tag in _FLOATS else {k: special_floats(v) for k, v in obj.items()}
    return [special_floats(v) for v in obj] if isinstance(obj, list) else obj
