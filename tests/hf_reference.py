"""The ONE independent HF reference the tests compare mfpipe against.

Module paths and value layouts are written out here again on purpose: nothing is taken from
``mfpipe.models.adapters`` (that is the code under test). Activations come from HF's own
``output_attentions`` / ``output_hidden_states`` and plain torch forward (pre-)hooks on the HF modules;
head reads are patched with a plain ``forward_pre_hook`` on the output projection (no nnsight).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode

# Per HF model_type, paths from the causal LM (layers, final) or from one block (the rest):
#   v_src: module whose output holds the values; o_proj: output projection (its input = the per-head reads);
#   attn: attention module (output[0] = o_proj output, output[1] = probabilities);
#   attn_norm: pre-attention norm (None: attention reads the residual itself);
#   attn_out: module whose output is what attention adds to the residual (None: the attention module's);
#   mlp_out: module whose output is what the MLP branch adds to the residual.
_LLAMA = dict(
    layers="model.layers",
    final="model.norm",
    v_src="self_attn.v_proj",
    o_proj="self_attn.o_proj",
    attn="self_attn",
    attn_norm="input_layernorm",
    attn_out=None,
    mlp_out="mlp",
)
PATHS: dict[str, dict] = {
    "gpt2": dict(
        layers="transformer.h",
        final="transformer.ln_f",
        v_src="attn.c_attn",
        o_proj="attn.c_proj",
        attn="attn",
        attn_norm="ln_1",
        attn_out=None,
        mlp_out="mlp",
    ),
    "gpt_neox": dict(
        layers="gpt_neox.layers",
        final="gpt_neox.final_layer_norm",
        v_src="attention.query_key_value",
        o_proj="attention.dense",
        attn="attention",
        attn_norm="input_layernorm",
        attn_out=None,
        mlp_out="mlp",
    ),
    "llama": _LLAMA,
    "qwen3": _LLAMA,
    "gemma2": dict(_LLAMA, attn_out="post_attention_layernorm", mlp_out="post_feedforward_layernorm"),
    "olmo2": dict(_LLAMA, attn_norm=None, attn_out="post_attention_layernorm", mlp_out="post_feedforward_layernorm"),
    # the families placed by structure (issue 30), written out here again by hand
    "mistral": _LLAMA,
    "qwen2": _LLAMA,
    "gemma": _LLAMA,
    "stablelm": _LLAMA,
    "phi3": dict(_LLAMA, v_src="self_attn.qkv_proj"),
    "gemma3_text": dict(_LLAMA, attn_out="post_attention_layernorm", mlp_out="post_feedforward_layernorm"),
    # the census's failure classes placed (issue 48)
    "opt": dict(layers="model.decoder.layers", final="model.decoder.final_layer_norm", v_src="self_attn.v_proj",
                o_proj="self_attn.out_proj", attn="self_attn", attn_norm="self_attn_layer_norm", attn_out=None,
                mlp_out="fc2"),
    "falcon": dict(layers="transformer.h", final="transformer.ln_f", v_src="self_attention.query_key_value",
                   o_proj="self_attention.dense", attn="self_attention", attn_norm="input_layernorm", attn_out=None,
                   mlp_out="mlp"),
    "mixtral": _LLAMA,
    "cohere": _LLAMA,
    # a multimodal composite (issue 59): Gemma-3's text model one level down, beside its vision tower
    "gemma3": dict(_LLAMA, layers="model.language_model.layers", final="model.language_model.norm",
                   attn_out="post_attention_layernorm", mlp_out="post_feedforward_layernorm"),
    "codegen": dict(layers="transformer.h", final="transformer.ln_f", v_src="attn.qkv_proj", o_proj="attn.out_proj",
                    attn="attn", attn_norm="ln_1", attn_out=None, mlp_out="mlp"),
    # latent attention (issue 59): the values are kv_b_proj's output, per head [k_nope | v]
    "deepseek_v3": dict(_LLAMA, v_src="self_attn.kv_b_proj"),
    # the attention and the MLP add the residual themselves (issue 59): their branches are dense's and dense_4h_to_h's
    # values scaled by the config's attention_value_scale, a layer's KV heads its own (issue 59): MiMo-V2-Flash
    "mimo_v2_flash": _LLAMA,
    "bloom": dict(layers="transformer.h", final="transformer.ln_f", v_src="self_attention.query_key_value",
                  o_proj="self_attention.dense", attn="self_attention", attn_norm="input_layernorm",
                  attn_out="self_attention.dense", mlp_out="mlp.dense_4h_to_h"),
    # an attention sink applied as a factor of the reads that the returned probabilities leave out (issue 59)
    "granite_swa": _LLAMA,
    "granitemoe_swa": dict(_LLAMA, mlp_out="block_sparse_moe"),
    # block 0's attn_norm an nn.Identity (its hook's output the residual itself), the others' a LayerNorm (issue 59)
    "modernbert-decoder": dict(layers="model.layers", final="model.final_norm", v_src="attn.v_proj", o_proj="attn.Wo",
                               attn="attn", attn_norm="attn_norm", attn_out=None, mlp_out="mlp"),
    # values normed per head (v_norm's output [B, T, KV, dh], of v_proj's or, k_eq_v, of k_proj's), heads of two widths
    # (issue 59): Gemma-4's; every head-space tensor zero-padded to the widest layer's (:func:`layer_width`)
    "gemma4_text": dict(_LLAMA, v_src="self_attn.v_norm", attn_out="post_attention_layernorm",
                        mlp_out="post_feedforward_layernorm"),
    # post-norm blocks, ln_2(ln_1(x + a) + mlp) (issue 59): no final norm, the last block's output is the final
    # residual; GPT-1's c_attn a Conv1D d -> 3d as GPT-2's, TrOCR's decoder one level down
    # (post_norm: the norm of x + a, which the MLP reads and the stream carries, and the norm of that plus the MLP's)
    "openai-gpt": dict(layers="transformer.h", final=None, v_src="attn.c_attn", o_proj="attn.c_proj", attn="attn",
                       attn_norm=None, attn_out=None, mlp_out="mlp", post_norm=("ln_1", "ln_2")),
    "trocr": dict(layers="model.decoder.layers", final=None, v_src="self_attn.v_proj", o_proj="self_attn.out_proj",
                  attn="self_attn", attn_norm=None, attn_out=None, mlp_out="fc2",
                  post_norm=("self_attn_layer_norm", "final_layer_norm")),
    # BERT's post-norm (issue 59): GIT's norms inside the attention's and the MLP's output modules, each adding the
    # residual; the projection (attention.output.dense, the branch) beside the attention proper (attention.self)
    "git": dict(layers="git.encoder.layer", final=None, v_src="attention.self.value", o_proj="attention.output.dense",
                attn="attention.self", attn_norm=None, attn_out="attention.output.dense", mlp_out="output.dense",
                post_norm=("attention.output.LayerNorm", "output.LayerNorm")),
    # the branches joined by learned vectors (issue 59): mid = input_residual ⊙ x + attn, out = post_attention_residual
    # ⊙ mid + mlp (Doge; scale_joins: the two vectors)
    "doge": dict(_LLAMA, scale_joins=("input_residual", "post_attention_residual")),
    "gptj": dict(
        layers="transformer.h",
        final="transformer.ln_f",
        v_src="attn.v_proj",
        o_proj="attn.out_proj",
        attn="attn",
        attn_norm="ln_1",
        attn_out=None,
        mlp_out="mlp",
    ),
}


# the attention's reads are (softmax(scores) @ V) * sigmoid(logsumexp(scores) - sinks) (Granite-SWA's eager attention):
# its probabilities are the returned softmax times that factor (mfpipe's tap is mfpipe.models.adapters.sinks; this one
# is written out again on purpose)
SINK_TYPES = ("granite_swa", "granitemoe_swa")


class _FirstLogsumexp(TorchFunctionMode):
    """Records the first ``torch.logsumexp`` of the forward it is pushed in (the attention's, of its scores)."""

    def __init__(self):
        super().__init__()
        self.lse = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.logsumexp and self.lse is None:
            self.lse = out
        return out


@contextmanager
def sink_factors(model):
    """Yields a dict filled, per layer, with the factor ``sigmoid(logsumexp(scores) - sinks)`` [B,H,T] of each forward
    run inside (empty where the model has no sink): a plain pre-hook pushes a torch function mode on the attention
    module, a forward hook (always called) pops it."""
    factors: dict = {}
    handles = []
    if model.config.model_type in SINK_TYPES:
        for l, blk in enumerate(blocks(model)):
            attn, modes = module(blk, spec(model)["attn"]), []

            def push(mod, args, modes=modes):
                modes.append(_FirstLogsumexp())
                modes[-1].__enter__()

            def pop(mod, args, out, modes=modes, l=l):
                mode = modes.pop()
                mode.__exit__(None, None, None)
                if mode.lse is not None:
                    factors[l] = (mode.lse - mod.sinks.view(1, -1, 1)).float().sigmoid()

            handles += [attn.register_forward_pre_hook(push), attn.register_forward_hook(pop, always_call=True)]
    try:
        yield factors
    finally:
        for h in handles:
            h.remove()


def module(root, path: str):
    for part in path.split("."):
        root = getattr(root, part)
    return root


def spec(model) -> dict:
    return PATHS[model.config.model_type]


def blocks(model):
    return module(model, spec(model)["layers"])


def next_residuals(model, resid, attn_out, mlp_out):
    """``[L, ...]`` the residual each block hands on, of its input ``resid [L, ...]`` and its branches (float64 numpy):
    their sum, or in a post-norm block (``post_norm``) ``ln_2(ln_1(x + a) + m)`` with the block's own norms, or where
    the block scales the stream (``scale_joins``) ``b ⊙ (a ⊙ x + attn) + m`` with its own vectors."""
    import numpy as np

    norms, joins = spec(model).get("post_norm"), spec(model).get("scale_joins")
    if joins is not None:  # Doge's: each stream term times a vector of the block's own
        out = []
        for l, blk in enumerate(blocks(model)):
            a, b = (module(blk, p).detach().double().numpy() for p in joins)
            out.append(b * (a * resid[l] + attn_out[l]) + mlp_out[l])
        return np.stack(out)
    if norms is None:
        return resid + attn_out + mlp_out
    out = []
    with torch.no_grad():
        for l, blk in enumerate(blocks(model)):
            ln1, ln2 = (module(blk, p) for p in norms)
            mid = ln1(torch.as_tensor(resid[l] + attn_out[l], dtype=torch.float32))
            out.append(ln2(mid + torch.as_tensor(mlp_out[l], dtype=torch.float32)).double().numpy())
    return np.stack(out)


def final_norm(model):
    """The final norm (None where the model has none: its last block's output is the final residual)."""
    return None if spec(model)["final"] is None else module(model, spec(model)["final"])


def o_proj(model, layer: int):
    return module(blocks(model)[layer], spec(model)["o_proj"])


def layer_width(model, layer: int) -> int:
    """Each head's read width in layer ``layer``: its output projection's input over the query heads."""
    proj = o_proj(model, layer)  # an nn.Linear's weight [out, in]; GPT-2's Conv1D [in, out]
    return (proj.weight.shape[0] if type(proj).__name__ == "Conv1D" else proj.in_features) // shape(model)[0]


def pad(t: torch.Tensor, width: int) -> torch.Tensor:
    """``t [..., w]`` with zeros appended to ``width``."""
    return torch.nn.functional.pad(t, (0, width - t.shape[-1]))


def shape(model) -> tuple[int, int, int]:
    """(H query heads, KV heads, head width: the widest layer's where they differ)."""
    cfg = model.config
    if cfg.model_type == "gemma3":  # a composite: its language model's sizes
        cfg = cfg.text_config
    if cfg.model_type == "gemma4_text":  # per-layer attributes: the global config refuses to say
        per = [cfg.per_layer_config[l] for l in range(cfg.num_hidden_layers)]
        return cfg.num_attention_heads, per[0].num_key_value_heads, max(c.head_dim for c in per)
    H = cfg.num_attention_heads
    KV = getattr(cfg, "num_key_value_heads", None) or H
    if cfg.model_type == "falcon":  # grouped (new architecture), multi-query, or one KV head per head
        KV = cfg.num_kv_heads if cfg.new_decoder_architecture else 1 if cfg.multi_query else H
    dh = getattr(cfg, "head_dim", None) or cfg.hidden_size // H
    if cfg.model_type in ("deepseek_v3", "mimo_v2_flash"):  # the reads are v_head_dim wide (head_dim: queries/keys')
        dh = cfg.v_head_dim
    return H, KV, dh


def values_from_src(model, out: torch.Tensor) -> torch.Tensor:
    """Output of the value source [B,T,*] -> per-query-head values [B,H,T,dh] (KV head h // (H // KV))."""
    mt = model.config.model_type
    H, KV, dh = shape(model)
    B, T = out.shape[:2]
    if mt == "deepseek_v3":  # kv_b_proj of the latent [B, 1, T, r]: per head [k_nope (qk_nope_head_dim) | v (dh)]
        nope = model.config.qk_nope_head_dim
        v = out.reshape(B, -1, H, nope + dh)[..., nope:]
    elif mt in ("gpt2", "openai-gpt"):  # Conv1D d -> 3d laid out [q | k | v]
        d = model.config.hidden_size
        v = out[..., 2 * d : 3 * d].reshape(B, T, H, dh)
    elif mt in ("gpt_neox", "bloom"):  # fused, per head [q | k | v]
        v = out.reshape(B, T, H, 3, dh)[..., 2, :]
    elif mt == "falcon" and not (model.config.new_decoder_architecture or model.config.multi_query):  # per head
        v = out.reshape(B, T, H, 3, dh)[..., 2, :]
    elif mt == "falcon":  # per KV group [q (H / KV heads) | k | v]; multi-query: one group
        kv = out.reshape(B, T, KV, H // KV + 2, dh)[..., -1, :]
        v = torch.stack([kv[:, :, h // (H // KV)] for h in range(H)], dim=2)
    elif mt == "mimo_v2_flash":  # as many KV heads as the layer's v_proj holds (its sliding-window layers twice the
        # full ones'), times the config's attention_value_scale as the attention multiplies them
        kv = out.reshape(B, T, -1, dh) * model.config.attention_value_scale
        v = torch.stack([kv[:, :, h // (H // kv.shape[2])] for h in range(H)], dim=2)
    elif mt == "gemma4_text":  # v_norm's output [B, T, KV, dh_l]: KV heads expanded, zero-padded to the widest
        v = pad(torch.stack([out[:, :, h // (H // out.shape[2])] for h in range(H)], dim=2), dh)
    elif mt == "codegen":  # four shards, each [q | v | k] of a quarter of the heads
        local = H * dh // 4
        v = out.reshape(B, T, 4, 3 * local)[..., local : 2 * local].reshape(B, T, H, dh)
    elif mt == "phi3":  # fused [q (H heads) | k (KV heads) | v (KV heads)]
        kv = out[..., (H + KV) * dh :].reshape(B, T, KV, dh)
        v = torch.stack([kv[:, :, h // (H // KV)] for h in range(H)], dim=2)
    else:
        kv = out.reshape(B, T, KV, dh)
        v = torch.stack([kv[:, :, h // (H // KV)] for h in range(H)], dim=2)
    return v.permute(0, 2, 1, 3)


PatchFn = Callable[[int, torch.Tensor], "torch.Tensor | None"]


@contextmanager
def patched_reads(model, patch: PatchFn):
    """Replace head reads with a plain forward_pre_hook on each layer's output projection:
    ``patch(layer, reads [B,T,H,dh]) -> new reads`` (or None: unchanged)."""
    H, _, dh = shape(model)

    def hook_for(layer):
        def hook(mod, args):
            x, own = args[0], layer_width(model, layer)  # a narrower layer's reads zero-padded, its own coordinates back
            new = patch(layer, pad(x.reshape(*x.shape[:2], H, own), dh))
            if new is None:
                return None
            return (new[..., :own].to(x.dtype).reshape(x.shape), *args[1:])

        return hook

    handles = [o_proj(model, l).register_forward_pre_hook(hook_for(l)) for l in range(len(blocks(model)))]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def reference_run(model, ids: torch.Tensor, patch: PatchFn | None = None) -> dict:
    """One HF forward with hooks; per layer (tensors in the model's dtype, cloned):

    ``resid_in`` [B,T,d], ``probs`` [B,H,T,T] (times a sink's factor: :func:`sink_factors`), ``values``
    [B,H,T,dh], ``reads`` [B,T,H,dh] (before any patch), ``o_out`` (output projection output), ``attn_block_out``
    (attention module output[0]), ``attn_out`` (what attention adds to the residual), ``mlp_out``, ``ln_in``
    (pre-attention norm output, the residual where there is none); plus ``final`` (input of the last norm),
    ``final_normed`` and ``logits``. ``patch`` is applied as in :func:`patched_reads`.
    """
    sp = spec(model)
    H, _, dh = shape(model)
    rec: dict = {}
    handles = []

    def out_hook(key):
        def hook(mod, args, out):
            rec[key] = (out if isinstance(out, torch.Tensor) else out[0]).detach().clone()

        return hook

    def in_hook(key):
        def hook(mod, args):
            rec[key] = args[0].detach().clone()

        return hook

    layers = blocks(model)
    for l, blk in enumerate(layers):
        handles.append(module(blk, sp["v_src"]).register_forward_hook(out_hook(("v", l))))
        handles.append(module(blk, sp["o_proj"]).register_forward_pre_hook(in_hook(("reads", l))))
        handles.append(module(blk, sp["o_proj"]).register_forward_hook(out_hook(("o_out", l))))
        handles.append(module(blk, sp["attn"]).register_forward_hook(out_hook(("attn", l))))
        if sp["attn_out"]:
            handles.append(module(blk, sp["attn_out"]).register_forward_hook(out_hook(("attn_out", l))))
        if sp["attn_norm"]:
            handles.append(module(blk, sp["attn_norm"]).register_forward_hook(out_hook(("ln_in", l))))
        handles.append(module(blk, sp["mlp_out"]).register_forward_hook(out_hook(("mlp_out", l))))
    fin = final_norm(model)
    if fin is not None:
        handles.append(fin.register_forward_pre_hook(in_hook("final")))
        handles.append(fin.register_forward_hook(out_hook("final_normed")))
    try:
        with torch.no_grad(), patched_reads(model, patch or (lambda layer, reads: None)), sink_factors(model) as sink:
            out = model(torch.as_tensor(ids), output_attentions=True, output_hidden_states=True, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    if fin is None:  # the final residual is the last block's output, the last hidden state
        rec["final"] = rec["final_normed"] = out.hidden_states[len(layers)]
    per_layer = []
    for l in range(len(layers)):
        reads = rec[("reads", l)]
        resid_in = out.hidden_states[l]
        per_layer.append(
            dict(
                resid_in=resid_in,
                probs=out.attentions[l] if l not in sink else out.attentions[l] * sink[l][..., None],
                values=values_from_src(model, rec[("v", l)]),
                reads=pad(reads.reshape(*reads.shape[:2], H, layer_width(model, l)), dh),
                o_out=rec[("o_out", l)],
                attn_block_out=rec[("attn", l)],
                attn_out=rec[("attn_out", l)] if sp["attn_out"] else rec[("attn", l)],
                mlp_out=rec[("mlp_out", l)].reshape(resid_in.shape),  # OPT runs its MLP on [B * T, d]
                ln_in=rec[("ln_in", l)] if sp["attn_norm"] else resid_in,
            )
        )
    return dict(layers=per_layer, final=rec["final"], final_normed=rec["final_normed"], logits=out.logits)


def head_maps(model, layer):
    """O_h [H, dh, d] (float64 numpy) by probing the output projection with basis reads (independent of its weight layout)."""
    H, _, dh = shape(model)
    proj, own = o_proj(model, layer), layer_width(model, layer)  # a narrower layer's rows zero-padded to dh
    with torch.no_grad():
        eye = torch.eye(H * own, dtype=proj.weight.dtype)
        out = (proj(eye) - proj(torch.zeros(1, H * own, dtype=proj.weight.dtype))).reshape(H, own, -1)
    return pad(out.transpose(1, 2), dh).transpose(1, 2).double().numpy()
