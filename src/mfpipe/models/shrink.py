"""A tiny copy of any decoder's config (:func:`shrink_config`, re-exported by :mod:`mfpipe.models.tiny`).

The copy keeps the config's class, ``model_type`` and every switch; its sizes are shrunk by what each field *is*,
read from its name and value rather than from a list of families, so that a family transformers adds later shrinks
too:

- widths, layer and head counts, head widths (scaled with the head: a latent-attention config's ``qk_nope_head_dim``,
  ``qk_rope_head_dim``, ``v_head_dim`` keep their proportions), MLP widths, vocabularies, positions, windows,
  low-rank bottlenecks, state-space state sizes; a mixture of experts keeps at most 4 experts, 2 per token, 1 shared;
- every per-layer field (``layer_types``, ``mlp_layer_types``, ``activation_sparsity_pattern``, any list as long as
  the layers, a list of layer indices, a count of leading or trailing layers, the ``per_layer_config`` overrides) is
  cut to the same layers, two of every kind where there are two (the depth grows past ``layers`` where kinds need it);
- a field the config derives in its ``__post_init__`` from others (a ``None`` or ``"auto"`` default: Nemotron's
  ``head_dim``, Zamba's ``attention_hidden_size``, Bamba's ``mamba_d_head``; or an attribute that is no field:
  DeepSeek's ``qk_head_dim``) is left to be derived again from the shrunk sizes;
- sub-configs (DBRX's ``attn_config`` / ``ffn_config``, a composite's text and vision configs) shrink alike; a size a
  default config of transformers leaves unset though its model needs it gets a small value
  (:func:`mfpipe.models.defaults.fill_default_gaps`).
"""

from __future__ import annotations

import dataclasses
import re

from mfpipe.models.defaults import (EXPERT_COUNT, LAYER_KEYS, MAX_EXPERTS, MAX_TOP_K, TOP_K, build_validated,
                                     fill_default_gaps)

__all__ = ["shrink_config"]

MAX_POS = 128
MAX_RANK, MAX_STATE, MAX_WINDOW = 16, 16, 8
_DROP = ("architectures", "auto_map", "_name_or_path", "transformers_version")
_WIDTH_KEYS = ("hidden_size", "n_embd", "d_model", "embed_dim", "emb_dim", "dim", "model_dim")
_HEAD_KEYS = ("num_attention_heads", "n_head", "n_heads", "num_heads")
_INNER = re.compile(r"intermediate|ffn_hidden|ffn_dim|^n_inner$|^d_inner$|^d_ff$|dim_feedforward|expert_ffn")


@dataclasses.dataclass
class _Sizes:  # the old sizes and the new
    W0: int
    H0: int
    dh0: int
    L0: int
    width: int
    heads: int
    dh: int
    vocab: int
    widths: tuple = ()  # the old widths of this level and the levels above it


def _even(x: float) -> int:
    return max(2, 2 * round(x / 2))


def _scalar(key: str, v, s: _Sizes):
    """The shrunk value of the size field ``key`` (``v`` an int or float; anything else unchanged)."""
    if isinstance(v, bool) or not isinstance(v, int):
        if isinstance(v, float) and ("pdrop" in key or "dropout" in key):
            return 0.0
        return v
    k = key.lower()
    if k in _WIDTH_KEYS:
        return s.width
    if k in _HEAD_KEYS or ("heads" in k and not any(t in k for t in ("kv", "key_value", "key_heads"))):
        return min(v, s.heads) if v > 0 else v
    if "heads" in k:  # KV heads: as many as the heads stay as many, one stays one, else two
        return s.heads if v >= s.H0 else (1 if v == 1 else min(2, s.heads))
    if "head_dim" in k or k in ("d_head", "head_size", "kv_channels", "attention_head_size", "rotary_dim"):
        return _even(v * s.dh / s.dh0)  # the head width becomes dh; others (MLA's, a layer's) in proportion
    if _INNER.search(k):
        return 2 * s.width if v > 0 else v
    if EXPERT_COUNT.match(k):
        return min(v, MAX_EXPERTS)
    if "expert" in k and "shared" in k and "size" not in k and "dim" not in k:
        return min(v, 1)
    if TOP_K.match(k):
        return min(v, MAX_TOP_K)
    if k in ("n_group", "num_expert_group", "n_expert_groups"):
        return min(v, 2)
    if k in ("topk_group", "topk_groups"):
        return min(v, 1)
    if k.endswith("_rank") and k not in ("dt_rank",):
        return min(v, MAX_RANK) if v > 0 else v
    if "max_position" in k or k in ("n_positions", "max_seq_len", "n_ctx", "seq_length", "max_seq_length"):
        return min(v, MAX_POS) if v > 0 else v
    if "window" in k or k in ("attention_chunk_size", "local_attention"):
        return min(v, MAX_WINDOW) if v > 0 else v
    if "vocab_size" in k:  # every vocabulary (Gemma-3n's per-layer input, Qwen-4's n-gram tables)
        return s.vocab if v > 0 else v
    if k.endswith("d_state") or k.endswith("state_size") or k == "d_state":
        return min(v, MAX_STATE)
    if k.endswith("n_groups") and "kv" not in k:
        return 1 if v > 0 else v
    if k.endswith("chunk_size") and "feed_forward" not in k:
        return min(v, 32) if v > 0 else v
    if k == "index_topk":
        return min(v, MAX_WINDOW)
    if v in s.widths and any(t in k for t in ("size", "dim", "hidden", "embd", "model")):  # a sub-config's text width
        return s.width
    return v


_LAYER_COUNT = re.compile(r"^(n|num)_\w*layers$")
# counts of the first or last layers that are of another kind: cut as a per-layer mask, so that every kind stays
_PREFIX = ("first_k_dense_replace", "num_dense_layers", "n_dense_layers", "n_input_layers", "max_window_layers")
_TAIL = ("num_kv_shared_layers", "n_output_layers")


def _layer_count(key: str, v, L0: int, L: int):
    """A count of layers of some other kind (a multi-token-prediction head's): all stay all, none stays none, some
    stays at least one and fewer than all."""
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        return v
    if v >= L0:
        return L if v == L0 else v - L0 + L
    return min(max(1, round(v * L / L0)), max(1, L - 1))


def _per_layer_rows(d: dict, L0: int) -> dict:
    """The per-layer fields of the config dict ``d``: key -> its ``L0`` entries (a list of layer indices as its mask;
    a ``layer_types`` k times as long folded into k-tuples; ``per_layer_config`` as each layer's overrides; a count
    of leading or trailing layers of another kind as its mask)."""
    rows = {}
    for k, v in d.items():
        if k == "per_layer_config" and isinstance(v, dict):
            rows[k] = [_override(v, i) for i in range(L0)]
        elif k in _PREFIX + _TAIL and isinstance(v, int) and not isinstance(v, bool) and 0 < v <= L0:
            rows[k] = [i < v if k in _PREFIX else i >= L0 - v for i in range(L0)]
        elif not isinstance(v, (list, tuple)) or not v:
            continue
        elif len(v) == L0:
            rows[k] = list(v)
        elif k.endswith("layer_types") and len(v) % L0 == 0:
            n = len(v) // L0
            rows[k] = [tuple(v[i * n:(i + 1) * n]) for i in range(L0)]
        elif (all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < L0 for x in v)
              and any(t in k for t in ("layer", "idx", "indices", "index"))):
            rows[k] = [i in v for i in range(L0)]
    return rows


def _override(per_layer: dict, i: int) -> dict:
    for key, value in per_layer.items():
        if int(key) == i:
            return value
    return {}


def _choose_layers(rows: dict, L0: int, layers: int, most: int = 8) -> list[int]:
    """Layers of the old depth to keep: the first two that have each kind of every per-layer field (so every kind
    stays present, and a module the layers of a kind share, Zamba's shared attention block, is shared; at most
    ``most``), filled up with the earliest others to ``layers``."""
    seen, chosen = {}, []
    for times in (1, 2):  # one of each kind first, then a second
        for i in range(L0):
            kinds = {(k, repr(r[i])) for k, r in rows.items()}
            if i not in chosen and any(seen.get(kind, 0) < times for kind in kinds) and len(chosen) < most:
                chosen.append(i)
                for kind in kinds:
                    seen[kind] = seen.get(kind, 0) + 1
    for i in range(L0):
        if len(chosen) >= layers:
            break
        if i not in chosen:
            chosen.append(i)
    chosen.sort()
    # the copy ends as the original does where a list of layer indices (or a count of leading or trailing layers)
    # tells its last layer apart: Mllama's last layer is no cross-attention layer, which its text forward would skip
    firsts = {k: r[0] if isinstance(r[0], tuple) else (r[0],) for k, r in rows.items() if r}  # (_chosen: in tuples)
    marks = [rows[k] for k, f in firsts.items() if {type(x) for x in f} == {bool}]
    if L0 - 1 not in chosen and any(r[L0 - 1] != r[chosen[-1]] for r in marks):
        chosen.append(L0 - 1)
    return chosen


def _cut(key: str, entries: list, chosen: list[int], original, s: _Sizes):
    picked = [entries[i] for i in chosen]
    if key == "per_layer_config":
        return {str(j): _same_kv(o, _shrink_dict(o, s)) for j, o in enumerate(picked) if o} or None
    if not isinstance(original, (list, tuple)):  # a count of leading or trailing layers
        return sum(picked)
    if isinstance(original, (list, tuple)) and len(original) != len(entries):
        if picked and isinstance(picked[0], bool):  # a list of layer indices
            return [j for j, on in enumerate(picked) if on]
        return [x for t in picked for x in t]  # a folded layer_types
    return [_scalar(key, x, s) for x in picked]


def _shrink_dict(d: dict, s: _Sizes, rope_n: int | None = None) -> dict:
    """A nested dict (a sub-config, the rope parameters, one layer's overrides) shrunk by the same rules."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out[k] = _shrink_dict(v, s, rope_n if rope_n is not None or "rope" not in k else _rope_n(d, s))
        elif isinstance(v, list) and rope_n is not None and v and all(isinstance(x, (int, float)) for x in v):
            out[k] = v[:rope_n] + [v[-1]] * max(0, rope_n - len(v))  # per-frequency factors, cut to the new head
        else:
            out[k] = _scalar(k, v, s)
    return out


def _rope_n(d: dict, s: _Sizes) -> int:
    share = d.get("partial_rotary_factor")
    share = float(share) if isinstance(share, (int, float)) and not isinstance(share, bool) else 1.0
    return max(1, int(s.dh * share) // 2)


def _config_dict(config) -> dict:
    """``config.to_dict()`` with the global values of per-layer attributes (a heterogeneous config hides them)."""
    import copy

    src = copy.copy(config)
    if getattr(src, "is_heterogeneous", False):
        src.allow_global_per_layer_attribute_access = True
    return {k: v for k, v in src.to_dict().items() if k not in _DROP}


def _derived_keys(cls, d: dict) -> set[str]:
    """The keys of ``d`` the config class derives from the others in its ``__post_init__``: a field whose default is
    ``None`` or ``"auto"``, or an attribute that is no field, that comes back with the same value when the config is
    built without it. They are left out of the tiny copy, to be derived again from its sizes."""
    fields = {f.name: f for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else {}
    probe, candidates = {}, set()
    for k, v in d.items():
        f = fields.get(k)
        default = f.default if f is not None else dataclasses.MISSING
        if isinstance(v, (list, dict, tuple)) or v is None:
            probe[k] = v
        elif f is None:
            candidates.add(k)
        elif default is None or default == "auto":
            candidates.add(k)
            probe[k] = default
        else:
            probe[k] = v
    if not candidates:
        return set()
    try:
        again = _config_dict(cls(**probe))
    except Exception:  # the config cannot be built without them: keep them all
        return set()
    return {k for k in candidates if k in again and again[k] == d[k]}


def _sizes(d: dict, width: int, heads: int, vocab: int, parent: _Sizes | None) -> _Sizes:
    """The old sizes of one level of a config (a sub-config without its own width or heads takes its parent's)."""
    def first(keys):
        return next((d[k] for k in keys if isinstance(d.get(k), int) and not isinstance(d.get(k), bool)), None)

    W0 = first(_WIDTH_KEYS) or (parent.W0 if parent else width)
    H0 = first(_HEAD_KEYS) or (parent.H0 if parent else heads)
    if isinstance(d.get("head_dim"), int):
        dh0 = d["head_dim"]
    else:
        dh0 = max(1, W0 // H0) if first(_WIDTH_KEYS) or not parent else parent.dh0
    subs = [v[k] for v in d.values() if isinstance(v, dict) for k in _WIDTH_KEYS if type(v.get(k)) is int]
    return _Sizes(W0=W0, H0=H0, dh0=dh0, L0=first(LAYER_KEYS) or 0, width=width, heads=heads, dh=width // heads,
                  vocab=vocab, widths=(W0, *(parent.widths if parent else ()), *subs))  # and its sub-configs'


def _consistent(out: dict, s: _Sizes, cls) -> None:
    """Sizes that must divide each other or stay in range after shrinking (in place)."""
    types = {f.name: str(f.type) for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else {}
    # a size the default config leaves None and its model reads as a number (Ministral's head_dim, Nemotron's KV
    # heads): the usual meaning, width / heads and one KV head per head
    if isinstance(out.get("num_attention_heads"), int):
        for k, usual in (("head_dim", s.dh), ("num_key_value_heads", out["num_attention_heads"])):
            if k in out and out[k] is None:
                out[k] = usual
    H = next((out[k] for k in _HEAD_KEYS if isinstance(out.get(k), int)), s.heads)
    for k in ("num_key_value_heads", "num_kv_heads", "kv_n_heads", "n_kv_heads"):
        if isinstance(out.get(k), int) and not isinstance(out[k], bool) and out[k] > 0 and H % out[k]:
            out[k] = 1
    experts = next((out[k] for k in out if EXPERT_COUNT.match(k) and k != "zero_expert_num"
                    and isinstance(out[k], int)), None)
    if isinstance(experts, int) and isinstance(out.get("n_group"), int):
        while out["n_group"] > 1 and experts % out["n_group"]:
            out["n_group"] -= 1
        if isinstance(out.get("topk_group"), int):
            out["topk_group"] = min(out["topk_group"], out["n_group"])
    for k in list(out):
        if k.endswith("_token_id") and isinstance(out[k], int) and not 0 <= out[k] < s.vocab:
            # dropped; a field that must hold an id (CWM's bos_token_id) gets the last one of the new vocabulary
            out[k] = None if "None" in types.get(k, "None") else s.vocab - 1
        if k.endswith("_token_id") and isinstance(out[k], list):
            kept = [t for t in out[k] if isinstance(t, int) and 0 <= t < s.vocab]
            out[k] = kept or None


def _sub_config(config, key: str):
    """The sub-config object ``config.<key>`` (a text or vision config, DBRX's ``attn_config``), or None."""
    from transformers import PreTrainedConfig

    try:
        sub = getattr(config, key, None)
    except Exception:  # a per-layer attribute of a heterogeneous config
        return None
    return sub if isinstance(sub, PreTrainedConfig) else None


def _shrink_level(config, d: dict, width: int, layers: int, heads: int, vocab: int,
                  parent: _Sizes | None = None) -> dict:
    """The shrunk dict of one config level (the top, or a sub-config: each shrinks by its own sizes)."""
    d = _by_field_name(type(config), d)
    derived = _derived_keys(type(config), d)
    s = _sizes(d, width, heads, vocab, parent)
    rows = _per_layer_rows(d, s.L0) if s.L0 else {}
    chosen = _chosen(rows, s.L0, layers) if s.L0 else list(range(layers))
    rope_n = _rope_n(d, s)
    out = {}
    for k, v in d.items():
        if k in derived:
            continue
        sub = _sub_config(config, k) if isinstance(v, dict) else None
        if sub is not None:
            out[k] = _shrink_level(sub, v, width, layers, heads, vocab, s)
        elif k in rows:
            out[k] = _cut(k, rows[k], chosen, v, s)
        elif k in LAYER_KEYS or _LAYER_COUNT.match(k):
            out[k] = _layer_count(k, v, s.L0, len(chosen)) if s.L0 else v
        elif isinstance(v, dict):
            out[k] = _shrink_dict(v, s, rope_n if "rope" in k else None)
        elif isinstance(v, (list, tuple)) and len(v) > 1 and all(type(x) is int for x in v) and sum(v) == s.W0:
            # parts of the width (Reformer's axial position embedding dims): the same shares of the new width
            head = [max(1, round(x * s.width / s.W0)) for x in v[:-1]]
            out[k] = [*head, s.width - sum(head)]
        else:
            out[k] = _scalar(k, v, s)
    if isinstance(out.get("query_pre_attn_scalar"), (int, float)):
        out["query_pre_attn_scalar"] = s.dh
    _same_kv(d, out)
    _consistent(out, s, type(config))
    fill_default_gaps(getattr(config, "model_type", ""), out, s.heads, s.dh)
    return out


def shrink_config(config, width: int = 64, layers: int = 2, heads: int = 4, vocab: int = 128):
    """A tiny copy of ``config`` (a transformers config of any decoder): the same class and ``model_type`` and every
    switch as set (biases, norms, parallel residual, rotary share, soft-caps, tied embeddings...), with the sizes
    shrunk (see the module docstring): width, layers (more where the per-layer kinds need them), heads (a
    grouped-query config keeps a KV-head count below the heads: 1 stays 1, else 2), head width ``width // heads``
    (other head widths in proportion), the MLP 2 x width, the vocabulary, at most 128 positions, at most 4 experts
    and 2 per token, the rotary dimensions and per-frequency rope factors cut in proportion, a window of at most 8;
    sub-configs (a composite's text and vision configs) alike. Special token ids outside the new vocabulary are
    dropped."""
    def build(n: int):
        return build_validated(type(config), _shrink_level(config, _config_dict(config), width, n, heads, vocab))

    cfg = build(layers)
    # a layer pattern the config derives from a period rather than lists per layer (Jamba's attention every
    # attn_layer_period layers from attn_layer_offset, Recurrent-Gemma's block_types cycled): more layers until every
    # kind of the full depth is there (a hybrid's attention layers)
    most = min(8, int(getattr(config, "num_hidden_layers", 0) or 0))
    while _kinds(config) - _kinds(cfg) and layers < most:
        layers += 1
        cfg = build(layers)
    cfg._attn_implementation = "eager"
    return cfg


def _kinds(config) -> set[str]:
    """The layer kinds a config's ``layer_types`` names (a property on some: Jamba's), or none."""
    try:
        kinds = getattr(config, "layer_types", None)
    except Exception:  # a per-layer attribute of a heterogeneous config
        return set()
    return {str(k) for k in kinds} if isinstance(kinds, (list, tuple)) else set()


def _same_kv(old: dict, new: dict) -> dict:
    """Where ``old`` has as many KV heads as heads (a layer's overrides too: DOTS-3's), so has ``new``."""
    for h, kv in (("num_attention_heads", "num_key_value_heads"), ("n_head", "num_kv_heads")):
        if isinstance(old.get(kv), int) and old.get(kv) == old.get(h) and isinstance(new.get(h), int):
            new[kv] = new[h]
    return new


def _chosen(rows: dict, L0: int, layers: int) -> list[int]:
    """:func:`_choose_layers`, in pairs where ``layer_types`` lists each layer as two blocks, the second an MLP
    (Dory's serialized layout): a pair is never split."""
    lt = rows.get("layer_types")
    g = 2 if (lt and L0 % 2 == 0 and set(lt[1::2]) == {"mlp"} and "mlp" not in lt[0::2]) else 1
    grouped = {k: [tuple(r[i * g:(i + 1) * g]) for i in range(L0 // g)] for k, r in rows.items()}
    return [c * g + j for c in _choose_layers(grouped, L0 // g, layers) for j in range(g)]


def _by_field_name(cls, d: dict) -> dict:
    """``d`` with a value stored under an ``attribute_map`` alias (Kimi-Linear's ``num_local_experts`` is kept as
    ``num_experts``) moved back to its field's name, so that it is shrunk, not taken for a derived attribute."""
    fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    out = dict(d)
    for name, stored in (getattr(cls, "attribute_map", None) or {}).items():
        if name in fields and stored in out and stored not in fields and name not in out:
            out[name] = out.pop(stored)
    return out
