"""Where a decoder keeps its pieces: the :class:`Structure` an adapter is built from, and :func:`describe`, which
places a loaded model by what its modules are and do, not by its ``model_type``.

A structure names (paths from the base model for the block list, the token embedding and the final norm; from one
block for the rest):

* the attention module (its output ``[0]`` is the attention branch before any post-norm, ``[1]`` the
  probabilities under eager attention, or the weights a sink's factor multiplies, ``attn_sink``: Granite-SWA's,
  :mod:`~mfpipe.models.adapters.sinks`; where a block's attention module wraps the attention proper, GPT-Neo's, the
  inner one), its output projection (input = the per-head reads, ``H x dv``: ``dv`` the head width, or latent
  attention's ``v_head_dim``) and where the values come from: a separate value projection, or a fused one in one of
  the layouts of ``VALUE_LAYOUTS`` (``chunked`` covers any layout of equal chunks with the values at one offset in
  each: Falcon's multi-query and grouped layouts, CodeGen's four shards), or latent attention's decompressing
  projection, which reads a norm of a slice of another projection (DeepSeek-V2/V3's ``kv_b_proj`` of
  ``kv_a_layernorm`` of ``kv_a_proj_with_mqa``: :mod:`~mfpipe.models.adapters.latent`);
* the norms by role: before attention, after attention (Gemma-2/3, OLMo-2), before the MLP (or the attention's
  own norm, shared: GPT-J, parallel StableLM), after the MLP (after a branch: or a short convolution over positions,
  Inkling's, as on its values, ``value_conv``: :mod:`~mfpipe.models.adapters.convolved`); ``None`` where none is;
* the MLP: one module (a mixture of experts included: Mixtral's router and experts, called on ``[B, T, d]`` as the
  block calls it), or a chain of the block's own modules (OPT's ``fc1``, ``activation_fn``, ``fc2``); whether it
  reads the block input (parallel residual: GPT-J, GPT-NeoX / Pythia, parallel StableLM, Falcon, Cohere) or the
  residual after attention;
* the RMS norms' scale form (``weight`` or ``1 + weight``: the Gemma family; a LayerNorm without a bias: Cohere),
  the scale the token embedding reaches the first block with (sqrt(d) where the model's forward multiplies and the
  embedding module does not), a learned absolute position table (GPT-2; OPT's, whose rows start at an offset), a
  norm on the embedding (BLOOM), and the final logits' scale (Cohere's ``logit_scale``) and soft-cap (Gemma-2).

:func:`describe` finds the modules by their kind and shape (a list of ``num_hidden_layers`` blocks in the base
model or one level down, OPT's ``decoder.layers``; the module the model returns as its input embedding, one
attention module per block, a projection from ``H * dh`` to ``d``...) and decides the rest by one probe forward of
three tokens (:mod:`mfpipe.models.adapters.probe`): which tensor each norm reads and writes, which layout of the
value source reproduces the attention's reads, which module chain is the MLP, which norm outside the blocks reads
the last block. A model it cannot place raises :class:`UnsupportedArchitectureError` naming what did not match and
the conformance command (``mfpipe conformance``), which checks a placed model's pieces against its own forward.

Rotary embeddings are no part of the description: no analysis recomputes attention scores (the forward's are read).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import Tensor, nn

from mfpipe.models.adapters import probe
from mfpipe.models.adapters.asked import ask_for_probabilities
from mfpipe.models.adapters.capture import path_within
from mfpipe.models.adapters.configs import check_config_forms, config_value
from mfpipe.models.adapters.forms import (NO_MLP, block_forms, check_skipped, check_source_forms, formed_sources,
                                          idle_attentions, placing_block, side_mixer, unstacked, wrapped_attention)
from mfpipe.models.adapters.embedding import embedding_places
from mfpipe.models.adapters.gate import gate_fields
from mfpipe.models.adapters.hybrid import MIXERS, mixer_kind, own_name
from mfpipe.models.adapters.joins import check_per_position
from mfpipe.models.adapters.layers import LayerForm, place_layer_forms
from mfpipe.models.adapters.latent import latent_sources
from mfpipe.models.adapters.linears import linear_paths
from mfpipe.models.adapters.probe import Shape, UnsupportedArchitectureError, is_norm, linear_shape, submodule
from mfpipe.models.adapters.residual import head_transform, input_embedding, logit_scale, returned_bias, scalar_buffer
from mfpipe.models.adapters.streaming import held

__all__ = ["Structure", "UnsupportedArchitectureError", "VALUE_LAYOUTS", "base_model", "blocks", "describe"]

# how a block's values come out of its value source:
#   "split":  a projection of its own, [KV * dh] outputs (Llama, Mistral, Qwen, Gemma, OLMo-2, GPT-J, StableLM)
#   "qkv":    one projection, outputs [q (H dh) | k (KV dh) | v (KV dh)] (Phi-3's qkv_proj; GPT-2's Conv1D c_attn)
#   "neox":   one projection, outputs per head [H, (q | k | v), dh] (GPT-NeoX / Pythia's query_key_value)
#   "chunked": one projection of `value_chunks` equal chunks, each holding KV * dh / value_chunks values at
#              `value_offset` (Falcon's multi-query [q.. | k | v] and grouped [(q.. | k | v) per KV head], CodeGen's
#              four shards [q | v | k]; latent attention's kv_b_proj, per head [k_nope | v]); the probe's search
VALUE_LAYOUTS = ("split", "qkv", "neox", "chunked")
_VALUE_SOURCES = {"v_proj": "split", "qkv_proj": "qkv", "c_attn": "qkv", "query_key_value": "neox"}
_OUT_PROJ_NAMES = ("o_proj", "out_proj", "dense", "c_proj", "Wo")  # Wo: ModernBERT-decoder's
@dataclass(frozen=True)
class Structure:
    """A decoder's layout (see the module docstring). Paths are dotted attribute names."""

    layers: str
    embed: str
    final_norm: str | None  # None: the last block's output is what the LM head reads
    attn: str
    value_source: str
    value_layout: str
    out_proj: str
    attn_norm: str | None
    post_attn_norm: str | None
    mlp: str | None  # None: the block has no MLP (Nemotron-H's attention blocks: mfpipe.models.adapters.forms)
    mlp_norm: str | None
    post_mlp_norm: str | None
    parallel_residual: bool
    rms_offset: float = 0.0  # RMS norms scale by (rms_offset + weight): 1.0 in the Gemma family
    embed_scale: float = 1.0  # what the forward multiplies the embedding module's output by before block 0
    embed_affine: tuple | None = None  # (bias, scale) of the base model: block 0 reads (e + bias) * scale (Zaya's)
    position_table: str | None = None  # a learned absolute position embedding of the base model (GPT-2's wpe)
    logit_softcap: float | None = None  # final logits -> tanh(logits / cap) * cap (Gemma-2)
    kv_heads: int | None = None  # KV heads where the config's num_key_value_heads does not say (Falcon: the probe's)
    value_chunks: int = 1  # the "chunked" value layout (see VALUE_LAYOUTS)
    value_offset: int = 0
    mlp_chain: tuple[str, ...] = ()  # the MLP as block children run in order (OPT); `mlp` is the last of them
    mlp_siblings: tuple[str, ...] = ()  # children on one input, outputs summed: the MLP (Granite's), in call order
    mlp_sequences: bool = False  # the MLP takes [B, T, d] only (a mixture of experts reshapes its input so)
    mlp_tuple: bool = False  # the MLP returns a tuple whose [0] is its output
    embed_norm: str | None = None  # a norm on the embedding before block 0 (BLOOM's word_embeddings_layernorm)
    position_row_offset: int = 0  # position p reads row p + offset of the position table (OPT: 2)
    norm_centred: bool = False  # the norms subtract the mean and have no bias (Cohere's LayerNorm)
    logit_scale: float = 1.0  # the logits are the LM head's output times this (Cohere), before any soft-cap
    # each head's value and read width where the projection's input is H x another than the config's (MLA's v_head_dim)
    value_head_dim: int | None = None
    # latent attention (adapters.latent): values read latent_norm(latent_proj's output[offset:offset+width]) x scale
    latent_proj: str | None = None
    latent_offset: int = 0
    latent_width: int = 0
    latent_norm: str | None = None
    latent_scale: float = 1.0
    # the attention returns its branch plus the residual it is handed (BLOOM's dropout_add): its branch is the output
    # projection's output; the MLP takes (input, residual), returns branch + residual (BLOOM, MPT): zero residual
    attn_residual: bool = False
    mlp_residual: bool = False
    branch_scale: float = 1.0  # each branch enters the residual times this (MiniCPM-3's scale_depth / sqrt(L))
    attn_bias: str | None = None  # a bias the attention returns for the block to add (GPT-NeoX-Japanese's dense_bias)
    # a hybrid (Jamba, Qwen3-Next, Nemotron-H...): each block's kind, "attention" or its mixer's ("mamba",
    # "gated_delta_net", "linear_attention", "recurrent", "convolution", "mlp"...); the paths above are those of the
    # attention blocks, a block of another kind is run as the model runs it. () where every block is attention
    layer_kinds: tuple[str, ...] = ()
    # an output gate (Qwen3-Next, LFM-3, Laguna: mfpipe.models.adapters.gate): the reads enter the output projection
    # times gate_act (sigmoid; Laguna's softplus) of the slice gate_layout (n, chunks, offset) of output_gate's output
    # (a path from the block), a projection of the attention's input running before the value source where gate_first
    output_gate: str | None = None
    gate_layout: tuple[int, int, int] = (0, 1, 0)
    gate_first: bool = False
    gate_act: str = "sigmoid"
    gate_bias: str | None = None  # a per-head bias (path from the block) the attention adds to the gate (Beam's)
    gate_direct: bool = True  # the source reads the attention's input (False: a latent of it, AXK-2's q_gate_proj)
    reads_norm: str | None = None  # a norm of every head's reads together before it (BitNet's: adapters.normed)
    side_mixer: str | None = None  # a mixer beside the attention: its branch joins the heads' (Falcon-H1: forms)
    side_scale: float = 1.0  # ... times this
    attn_scales: tuple[float, float] = (1.0, 1.0)  # its input, its output times these (Falcon-H1's multipliers: forms)
    value_clip: float | None = None  # the attention clamps its q, k, v to +-this before the heads read (DBRX's)
    value_scale: float = 1.0  # ... and multiplies its values by this (MiMo-V2-Flash's v_scale): forms.value_form
    value_norm: str | None = None  # ... a norm of each head's values, the layer's own (Gemma-4's v_norm; from the block)
    value_conv: str | None = None  # ... a convolution over positions of the source's output (Inkling's)
    resid_scale: str | None = None  # a [1] buffer the block multiplies its output by (Gemma-4's layer_scalar)
    # each layer's head width, KV heads, value source and layout (and latent) where its attention layers are of several
    # kinds (adapters.layers: MiMo-V2-Flash's, dots.3-note's); () where every layer has the placed block's form
    layer_forms: tuple[LayerForm, ...] = ()
    # the reads are the returned weights' times sigmoid(logsumexp(scores) - this (H,) parameter) (a path from the
    # block; Granite-SWA's sinks): the probabilities behind the reads are the weights times it (adapters.sinks)
    attn_sink: str | None = None
    head_transform: str | None = None  # a module (path from the causal LM) between the final norm and the LM head
    # post-norm (GPT-1, TrOCR): the norm (from the block) that the block's sum passes before the block hands it on,
    # and whether the residual the MLP branch joins is the MLP's norm's output (GPT-1's ln_1 of x + a) not resid_mid
    block_norm: str | None = None
    norm_carried: bool = False
    # "sum": the branches join the residual as the fields above say; "model": in a form of the block's own (Doge's
    # a ⊙ x + attn, Beam's depth-scaled sums, MiniMax's), run by the block (mfpipe.models.adapters.joins)
    join: str = "sum"

    @property
    def projection_beside(self) -> bool:
        """Whether the output projection sits beside the attention module, not in it (GIT's, in its wrapper: the
        attention returns the reads, before the projection runs)."""
        return path_within(self.out_proj, self.attn) is None

    @property
    def branch_at_projection(self) -> bool:
        """Whether the attention branch is the output projection's output, not the attention module's ``[0]``: the
        attention adds the residual itself (BLOOM), or the projection sits beside it (GIT's)."""
        return self.attn_residual or self.projection_beside

    def as_dict(self) -> dict:
        return asdict(self)


def base_model(model: nn.Module) -> nn.Module:
    """The decoder stack of an HF model (``model.base_model``; the model itself if already bare). Where
    ``base_model`` names the causal LM itself (a ``base_model_prefix`` it has no attribute of: Llama-4's text model),
    the one child besides the LM head that holds the input embedding."""
    base = getattr(model, "base_model", None)
    if base is model and callable(getattr(model, "get_output_embeddings", None)):
        head, emb = model.get_output_embeddings(), model.get_input_embeddings()
        holders = [m for m in model.children() if m is not head and any(x is emb for x in m.modules())]
        if head is not None and len(holders) == 1:
            return holders[0]
    return model if base is None else base


def _one(found: list[str], what: str, model_type) -> str:
    if len(found) != 1:
        raise UnsupportedArchitectureError(model_type, f"cannot place {what}: " + (
            "none" if not found else f"{len(found)} candidates ({', '.join(found)})"))
    return found[0]


def describe(model: nn.Module) -> Structure:
    """The :class:`Structure` of a loaded causal LM (or its base model), in eval mode with eager attention.
    Raises :class:`UnsupportedArchitectureError` naming the first piece it cannot place."""
    cfg = model.config
    mt = getattr(cfg, "model_type", None)
    base = base_model(model)
    shape = _shape(cfg, mt)
    stack = _stack(base, shape.L, mt)  # "" or the path of the module holding the blocks ("decoder.")
    stack_mod = submodule(base, stack)
    layers = stack + _layers(dict(stack_mod.named_children()), shape.L, mt)
    emb = input_embedding(model, base) if hasattr(base, "get_input_embeddings") else None
    # paths from the base model: the embedding beside the blocks, one level down, or beside their module (GIT's)
    embed, outer_norms, tables = embedding_places(base, stack, emb, shape.d, getattr(cfg, "max_position_embeddings",
                                                                                      None), mt)
    blocks = submodule(base, layers)
    attn, kinds = _attention_blocks(blocks, mt, idle_attentions(base, blocks))  # TrOCR's encoder_attn left out
    check_skipped(base, blocks, kinds, mt)  # the blocks the forward skips on text-only input (Mllama's cross-attention)
    ask_for_probabilities(submodule(b, attn) for b, k in zip(blocks, kinds) if k == "attention")  # GPT-1's: asked
    first = placing_block(blocks, kinds)  # a hybrid's first attention block; one with every norm the others have
    block = blocks[first]
    attn_mod = submodule(block, attn)
    out_proj, dv = _out_projection(block, attn, shape, mt)  # a path from the block
    dh, shape.dh = shape.dh, dv  # the values and reads are dv wide from here on
    named_value = _value_by_name(attn_mod, shape)
    mlp_parts = [n for n, m in block.named_children()
                 if n != attn.split(".")[0] and not is_norm(m) and any(True for _ in m.parameters())]
    named_mlp = [n for n in mlp_parts if type(getattr(block, n)).__name__.lower().endswith("mlp")]
    side = side_mixer(block, attn, lambda m: any(t in own_name(m, block) for t, _ in MIXERS))  # Falcon-H1's
    mlp = named_mlp[0] if len(named_mlp) == 1 else None if mlp_parts else NO_MLP  # none: Nemotron-H's attention
    found = probe.probe(model, base, blocks, attn, out_proj, outer_norms,
                        submodule(base, tables[0]) if len(tables) == 1 else None, shape, mt,
                        mlp, named_value, latent_sources, first, block_forms(block, attn, side, mlp == NO_MLP, mlp, mt))
    final_norm, embed_norm = found["final_norm"], found["embed_norm"]
    roles, latent, vconv = found["roles"], found["latent"], found.get("value_conv")
    inside = path_within(out_proj, attn)  # None: the projection beside the attention (GIT's)
    if roles["join"] == "model":  # a join of the block's own: run by the block, so it must be of each position alone
        check_per_position(base, blocks, first, attn, mt, found["attn_residual"] or inside is None)
    norm = (submodule(block, roles["attn_norm"]) if roles["attn_norm"] else submodule(base, final_norm)
            if final_norm else nn.Identity())
    with held(block):  # called outside a forward: a streamed block's weights are read for it
        rms_offset, centred = _norm_kind(norm, mt)
    check_source_forms(blocks, attn, [l for l, k in enumerate(kinds) if k == "attention"], mt)
    forms = place_layer_forms(model, base, blocks, kinds, attn, inside, first, found, shape, mt, formed_sources)
    head = head_transform(model, base)  # ModernBERT-decoder's prediction head
    return Structure(
        layers=layers, embed=embed, final_norm=final_norm, attn=attn,
        value_source=f"{attn}.{found['value_source']}", value_layout=found["value_layout"],
        out_proj=out_proj, attn_norm=roles["attn_norm"], post_attn_norm=roles["post_attn_norm"],
        mlp=(found["mlp_chain"] or [None])[-1], mlp_norm=roles["mlp_norm"], post_mlp_norm=roles["post_mlp_norm"],
        parallel_residual=roles["parallel"], rms_offset=rms_offset, embed_scale=found["embed_scale"],
        embed_affine=found["embed_affine"], position_table=tables[0] if len(tables) == 1 else None,
        logit_softcap=getattr(cfg, "final_logit_softcapping", None) or getattr(cfg, "logits_soft_cap", None) or None,
        kv_heads=found["kv_heads"], value_chunks=found["value_chunks"], value_offset=found["value_offset"],
        mlp_chain=tuple(found["mlp_chain"]) if len(found["mlp_chain"]) > 1 else (),
        mlp_sequences=found["mlp_sequences"], mlp_tuple=found["mlp_tuple"], embed_norm=embed_norm,
        position_row_offset=found["position_row_offset"], mlp_siblings=found.get("mlp_siblings", ()),
        norm_centred=centred, logit_scale=logit_scale(model, base, mt, head), value_head_dim=None if dv == dh else dv,
        latent_proj=f"{attn}.{latent.proj}" if latent else None, latent_offset=latent.offset if latent else 0,
        latent_width=latent.width if latent else 0, latent_norm=f"{attn}.{latent.norm}" if latent else None,
        latent_scale=latent.scale if latent else 1.0, value_conv=vconv and f"{attn}.{vconv}",
        attn_residual=found["attn_residual"], mlp_residual=found["mlp_residual"], branch_scale=roles["branch_scale"],
        attn_bias=returned_bias(blocks, attn, shape.d), layer_kinds=() if set(kinds) == {"attention"} else tuple(kinds),
        side_mixer=side, side_scale=found.get("side_scale", 1.0), attn_scales=found.get("attn_scales", (1.0, 1.0)),
        value_clip=found.get("value_clip"), layer_forms=forms, head_transform=head, attn_sink=found.get("attn_sink"),
        value_scale=found.get("value_scale", 1.0),
        value_norm=f"{attn}.{found['value_norm']}" if found.get("value_norm") else None,
        resid_scale="layer_scalar" if scalar_buffer(block, "layer_scalar") else None,
        block_norm=roles["block_norm"], norm_carried=roles["norm_carried"], join=roles["join"],
        **gate_fields(found["gate"], attn, found.get("reads_norm")),
    )


def blocks(model: nn.Module) -> nn.ModuleList:
    """The list of a decoder's ``num_hidden_layers`` blocks (what :func:`describe` places its ``layers`` at), found
    before any forward: weight streaming (:mod:`mfpipe.models.adapters.streaming`) hooks them."""
    mt = getattr(model.config, "model_type", None)
    base = base_model(model)
    L = _shape(model.config, mt).L
    stack = _stack(base, L, mt)
    stack_mod = submodule(base, stack)
    return getattr(stack_mod, _layers(dict(stack_mod.named_children()), L, mt))


def _layers(children: dict[str, nn.Module], L: int, mt) -> str:
    return _one([n for n, m in children.items() if isinstance(m, nn.ModuleList) and len(m) == L],
                f"the list of its {L} blocks", mt)


def _shape(cfg, mt) -> Shape:
    L = int(getattr(cfg, "num_hidden_layers", 0) or 0)
    H = int(getattr(cfg, "num_attention_heads", 0) or 0)
    if not L or not H or not getattr(cfg, "hidden_size", None):
        raise UnsupportedArchitectureError(mt, "its config has no num_hidden_layers / num_attention_heads / hidden_size")
    if getattr(cfg, "is_encoder_decoder", False) or getattr(cfg, "add_cross_attention", False):
        raise UnsupportedArchitectureError(mt, "it has cross-attention (mfpipe reads decoder-only models)")
    hc = next((int(v) for k in ("hc_mult", "hc_count") if isinstance(v := getattr(cfg, k, None), int)), 1)
    if hc > 1:  # DeepSeek-V4's, HY-V4's hc_mult, Qwen-4-Exp's hc_count: [B, T, hc, d] between the blocks
        raise UnsupportedArchitectureError(mt, f"its blocks carry {hc} residual streams mixed by hyper-connections: "
                                               "mfpipe reads one residual stream")
    check_config_forms(cfg, L, mt)  # Gemma-4's KV sharing and MoE block refused
    d = int(cfg.hidden_size)
    return Shape(L=L, H=H, KV=int(config_value(cfg, "num_key_value_heads") or H),
                 dh=int(config_value(cfg, "head_dim") or d // H), d=d)


def _stack(base: nn.Module, L: int, mt) -> str:
    """Where the blocks sit: "" when the base model holds the list of its L blocks, else the path (with a trailing
    dot) of the one child of the base model that does (OPT's ``decoder``)."""
    def has_blocks(m):
        return any(isinstance(c, nn.ModuleList) and len(c) == L for c in m.children())

    if has_blocks(base):
        return ""
    found = [n for n, m in base.named_children() if has_blocks(m)]
    return _one(found or unstacked(base, L, mt), f"the list of its {L} blocks among the base model's modules", mt) + "."


def _attention(block: nn.Module, mt, idle=frozenset()) -> str | None:
    """The block's one ``*Attention`` module (softmax attention: not one of
    :data:`~mfpipe.models.adapters.hybrid.MIXERS`, nor one of ``idle``, which text-only input does not run); where it
    wraps another (its one ``*Attention`` child that does the attention proper: GPT-Neo), that one's path. None where
    the block has none (a hybrid's block of another mixer)."""
    def attentions(m):
        return [n for n, c in m.named_children() if type(c).__name__.endswith("Attention")
                and not any(t in own_name(c, block) for t, _ in MIXERS)]

    found = [n for n in attentions(block) if n not in idle] or wrapped_attention(block, attentions, mt)  # DBRX's
    if not found:
        return None
    path = _one(found, "one attention module in a block", mt)
    inner = attentions(submodule(block, path))
    while len(inner) == 1:
        path = f"{path}.{inner[0]}"
        inner = attentions(submodule(block, path))
    return path


def _attention_blocks(blocks, mt, idle=frozenset()) -> tuple[str, list[str]]:
    """(the attention module's path in the attention blocks, each block's kind: "attention" or its mixer's). A
    hybrid's attention blocks must keep their attention at one path, of one class."""
    paths = [_attention(b, mt, idle) for b in blocks]
    found = {(p, type(submodule(b, p)).__name__) for p, b in zip(paths, blocks) if p is not None}
    if not found:
        kinds = sorted({mixer_kind(b) for b in blocks})
        _one([], f"one attention module in a block (none in any of its {len(blocks)} blocks: {', '.join(kinds)})", mt)
    if len(found) > 1:
        _one(sorted(f"{p} ({c})" for p, c in found), "one attention module at one path in its attention blocks", mt)
    return next(iter(found))[0], ["attention" if p else mixer_kind(b) for p, b in zip(paths, blocks)]


def _out_projection(block: nn.Module, attn: str, shape: Shape, mt) -> tuple[str, int]:
    """(the attention's output projection, as a path from the block, the width of each head's read): the one of the
    known names from ``H x dh`` to ``d``; where there is none, the one from ``H x dv`` to ``d`` for another ``dv``
    (latent attention, whose heads read values ``v_head_dim`` wide; the probe's value search then confirms the heads).
    Where the attention proper holds none, the one its wrapper holds beside it (GIT's ``attention.output.dense`` beside
    ``attention.self``, in a module that adds the residual and norms the sum: BERT's layout)."""
    named = {f"{attn}.{n}": linear_shape(m) for n, m in linear_paths(submodule(block, attn)).items()
             if n.split(".")[0] in _OUT_PROJ_NAMES}
    if not named and "." in attn:
        wrapper = attn.rsplit(".", 1)[0]
        named = {f"{wrapper}.{n}": linear_shape(m) for n, m in submodule(block, wrapper).named_modules()
                 if n and not f"{wrapper}.{n}".startswith(attn + ".") and n.rsplit(".", 1)[-1] in _OUT_PROJ_NAMES
                 and n.count(".") == 1}
    what = f"the attention's output projection ({shape.H} x {shape.dh} -> {shape.d})"
    exact = [n for n, s in named.items() if s == (shape.H * shape.dh, shape.d)]
    if exact:
        return _one(exact, what, mt), shape.dh
    wide = [n for n, s in named.items() if s and s[1] == shape.d and s[0] % shape.H == 0]
    return _one(wide, what, mt), named[wide[0]][0] // shape.H


def _value_by_name(attn_mod: nn.Module, shape: Shape) -> tuple[str, str] | None:
    """(value source, layout) by the names and widths mfpipe knows (v_proj, qkv_proj, c_attn, query_key_value), or
    None; the probe checks it against the reads and searches every chunked layout where it fails."""
    H, KV, dh, d = shape.H, shape.KV, shape.dh, shape.d
    want_out = {"split": KV * dh, "qkv": (H + 2 * KV) * dh, "neox": 3 * H * dh}
    sources = [(p, lay) for p, m in linear_paths(attn_mod).items() for n, lay in _VALUE_SOURCES.items()
               if p.split(".")[0] == n and linear_shape(m) == (d, want_out[lay])]  # Moshi's wrapped: v_proj.linear
    return sources[0] if len(sources) == 1 else None


def _norm_kind(norm: nn.Module, mt) -> tuple[float, bool]:
    """(rms_offset, centred): 0.0 or 1.0 for an RMS norm that scales by ``weight`` or ``1 + weight``, or a norm that
    subtracts the mean and scales by ``weight`` with no bias (Cohere's; centred True), told apart on a probe row; a
    LayerNorm: (0.0, False)."""
    if isinstance(norm, nn.LayerNorm):
        return 0.0, False
    w = getattr(norm, "weight", None)
    eps = getattr(norm, "variance_epsilon", None) or getattr(norm, "eps", None) or 1e-6
    if not isinstance(w, Tensor) or w.ndim != 1:
        return 0.0, False
    with torch.no_grad():
        x = torch.linspace(-1.0, 2.0, w.numel(), dtype=torch.float32, device=w.device)[None]
        got = norm(x.to(w.dtype)).float()
        xc = x - x.mean(-1, keepdim=True)
        z = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + float(eps))
        zc = xc * torch.rsqrt((xc * xc).mean(-1, keepdim=True) + float(eps))
        errs = {(0.0, False): (z * w.float() - got).abs().max().item(),
                (1.0, False): (z * (1.0 + w.float()) - got).abs().max().item(),
                (0.0, True): (zc * w.float() - got).abs().max().item()}
    best = min(errs, key=errs.get)
    scale = got.abs().max().item()
    if errs[best] > 1e-2 * max(scale, 1e-6):
        raise UnsupportedArchitectureError(mt, f"its norm {type(norm).__name__} is neither an RMS norm by weight nor "
                                               "by 1 + weight, nor a LayerNorm (with or without a bias)")
    return best
