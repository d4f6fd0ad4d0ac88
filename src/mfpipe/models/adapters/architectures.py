"""The per-architecture adapters: module paths and weight layouts of each supported HF ``model_type``.

Adding an architecture: subclass :class:`~mfpipe.models.adapters.base.Adapter` with its module paths
(``LAYERS`` / ``EMBED`` / ``FINAL_NORM`` from the base model; ``ATTN``, ``V_SRC``, ``O_PROJ``, the norms
and ``MLP`` from one block), override ``_values_from_src`` / ``value_map`` / ``value_weights`` / ``out_proj_slices`` where
its weights are fused or transposed, register it in ``_ADAPTERS`` and add a recipe to
``tests/tiny_models.py`` plus its module paths to ``tests/hf_reference.py`` (the independent check). A block must
add ``attn_out + mlp_out`` to the residual, and ``FINAL_NORM``'s input must be the last block's output (the statistics
pass derives the mlp_out sums from that: ``Adapter.mlp_out_from_resid``); where not, override that property to False.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from mfpipe.models.adapters.base import Adapter, NormForm, base_model, no_grad
from mfpipe.models.adapters.site import module_at

__all__ = ["SUPPORTED_MODEL_TYPES", "UnsupportedArchitectureError", "get_adapter"]


class UnsupportedArchitectureError(ValueError):
    """The model's HF ``model_type`` has no adapter."""

    def __init__(self, model_type: str | None):
        self.model_type = model_type
        super().__init__(
            f"unsupported architecture: model_type={model_type!r}; "
            f"supported model_types: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )


# ---------------------------------------------------------------------------------------------- GPT-2
class GPT2Adapter(Adapter):
    model_type = "gpt2"
    LAYERS = "h"
    EMBED = "wte"
    FINAL_NORM = "ln_f"
    ATTN = "attn"
    V_SRC = "attn.c_attn"  # Conv1D d -> 3d, [q | k | v]
    O_PROJ = "attn.c_proj"  # Conv1D, weight [d_in, d_out]
    ATTN_NORM = "ln_1"
    MLP_NORM = "ln_2"

    def __init__(self, model: nn.Module):
        super().__init__(model)
        if getattr(self.config, "add_cross_attention", False):
            raise UnsupportedArchitectureError("gpt2 (with cross-attention)")

    def _values_from_src(self, src_out: Tensor) -> Tensor:
        d = self.d_model
        return super()._values_from_src(src_out[..., 2 * d : 3 * d])

    @no_grad
    def value_map(self, layer: int, x: Tensor) -> Tensor:
        d = self.d_model
        h = self._sub(layer, self.ATTN_NORM)(self._in(x))
        c_attn = self._sub(layer, self.V_SRC)
        v = torch.addmm(c_attn.bias[2 * d :], h.reshape(-1, d), c_attn.weight[:, 2 * d :])
        return v.view(*h.shape[:-1], self.n_heads, self.d_head).to(x.dtype)

    @no_grad
    def value_weights(self, layer: int) -> tuple[Tensor, Tensor]:
        d, H, dh = self.d_model, self.n_heads, self.d_head
        c_attn = self._sub(layer, self.V_SRC)  # Conv1D: weight [d, 3d], columns [q | k | v]
        w = c_attn.weight.detach()[:, 2 * d :].reshape(d, H, dh).transpose(0, 1)
        return w, c_attn.bias.detach()[2 * d :].reshape(H, dh)

    @no_grad
    def out_proj_slices(self, layer: int) -> Tensor:
        w = self._sub(layer, self.O_PROJ).weight  # Conv1D: [d_in = H*dh, d_out = d]
        return w.detach().reshape(self.n_heads, self.d_head, self.d_model)

    @no_grad
    def position_offset(self, context_length: int | None = None, position_count=None) -> Tensor | None:
        """Mean learned positional embedding ``[d]`` over the positions tracked queries occupy: ``1..T-1``
        (position 0 holds BOS, never a query, so ``wpe[0]`` is left out).

        A type's true layer-0 centroid is its embedding plus the mean of ``wpe`` over ITS occurrences; one
        offset shared by all types comes closest to those (occurrence-weighted squared error) when it is the
        mean over all tracked-query occurrences, i.e. ``wpe`` weighted by ``position_count [T]`` (the
        statistics half's tracked-query count per position; it is 0 at position 0). Without it: uniform over
        ``1..T-1``, which is what packed full windows give. ``context_length`` T defaults to
        ``len(position_count)``, else to the whole learned table.
        """
        wpe = self.base.wpe.weight.detach()
        if position_count is not None:
            w = torch.as_tensor(position_count, dtype=torch.float64).reshape(-1)
            if context_length is not None and int(context_length) != w.numel():
                raise ValueError(f"position_count has {w.numel()} positions, context_length is {context_length}")
            if not 1 < w.numel() <= wpe.shape[0] or (w < 0).any() or w[1:].sum() <= 0:
                raise ValueError(f"position_count must be [T] with 1 < T <= {wpe.shape[0]}, non-negative, with "
                                 "tracked queries at positions >= 1")
            w[0] = 0.0  # BOS's own position, never a query
            return ((w / w.sum()).to(wpe.dtype).to(wpe.device) @ wpe[: w.numel()]).to(wpe.dtype)
        n = wpe.shape[0] if context_length is None else int(context_length)
        if not 1 < n <= wpe.shape[0]:
            raise ValueError(f"context_length={context_length} outside 2..{wpe.shape[0]} (queries need positions >= 1)")
        return wpe[1:n].mean(0)


# ------------------------------------------------------------------------------------ GPT-NeoX / Pythia
class GPTNeoXAdapter(Adapter):
    model_type = "gpt_neox"
    LAYERS = "layers"
    EMBED = "embed_in"
    FINAL_NORM = "final_layer_norm"
    ATTN = "attention"
    V_SRC = "attention.query_key_value"  # Linear d -> 3d, laid out per head: [H, (q|k|v), dh]
    O_PROJ = "attention.dense"
    ATTN_NORM = "input_layernorm"
    MLP_NORM = "post_attention_layernorm"  # GPT-NeoX's name for the pre-MLP norm

    def __init__(self, model: nn.Module):
        super().__init__(model)
        self.parallel_residual = bool(self.config.use_parallel_residual)

    def _values_from_src(self, src_out: Tensor) -> Tensor:
        B, T = src_out.shape[:2]
        qkv = src_out.view(B, T, self.n_heads, 3 * self.d_head).transpose(1, 2)  # as HF: [B,H,T,3dh]
        return qkv[..., 2 * self.d_head :]

    @no_grad
    def value_map(self, layer: int, x: Tensor) -> Tensor:
        H, dh, d = self.n_heads, self.d_head, self.d_model
        h = self._sub(layer, self.ATTN_NORM)(self._in(x))
        qkv = self._sub(layer, self.V_SRC)
        w = qkv.weight.view(H, 3, dh, d)[:, 2].reshape(H * dh, d)
        b = None if qkv.bias is None else qkv.bias.view(H, 3, dh)[:, 2].reshape(H * dh)
        v = nn.functional.linear(h, w, b)
        return v.unflatten(-1, (H, dh)).to(x.dtype)

    @no_grad
    def value_weights(self, layer: int) -> tuple[Tensor, Tensor | None]:
        H, dh, d = self.n_heads, self.d_head, self.d_model
        qkv = self._sub(layer, self.V_SRC)  # Linear d -> 3d, rows laid out [H, (q|k|v), dh]
        w = qkv.weight.detach().view(H, 3, dh, d)[:, 2].transpose(1, 2)
        b = None if qkv.bias is None else qkv.bias.detach().view(H, 3, dh)[:, 2]
        return w, b


# ------------------------------------------------------------------------------- Llama-style blocks
class LlamaAdapter(Adapter):
    model_type = "llama"
    LAYERS = "layers"
    EMBED = "embed_tokens"
    FINAL_NORM = "norm"
    ATTN = "self_attn"
    V_SRC = "self_attn.v_proj"
    O_PROJ = "self_attn.o_proj"
    ATTN_NORM = "input_layernorm"
    MLP_NORM = "post_attention_layernorm"  # Llama's name for the pre-MLP norm


class Qwen3Adapter(LlamaAdapter):
    model_type = "qwen3"
    # q_norm / k_norm act on queries and keys only; values are plain v_proj outputs.


class Gemma2Adapter(LlamaAdapter):
    model_type = "gemma2"
    POST_ATTN_NORM = "post_attention_layernorm"
    MLP_NORM = "pre_feedforward_layernorm"
    POST_MLP_NORM = "post_feedforward_layernorm"

    def attn_input_norm_form(self, layer: int) -> NormForm | None:
        """Gemma-2's RMS norm multiplies by ``1 + weight`` and keeps its epsilon as ``eps``."""
        if self.dtype != torch.float32:
            return None
        m = self._sub(layer, self.ATTN_NORM)
        return NormForm("rms", float(m.eps), 1.0 + m.weight.detach())

    @no_grad
    def embed(self, ids: Tensor) -> Tensor:
        """Token embedding times sqrt(d), rounded to the embedding dtype as the model does. Where the scale
        lives moved between transformers releases: recent ones use ``Gemma2TextScaledWordEmbedding`` (the module
        scales, it has ``embed_scale``); 4.x used a plain ``nn.Embedding`` and ``Gemma2Model.forward``
        multiplied by ``torch.tensor(hidden_size**0.5, dtype=hidden_states.dtype)``."""
        e = super().embed(ids)
        if hasattr(self._embedding(), "embed_scale"):
            return e
        return e * torch.tensor(self.config.hidden_size**0.5, dtype=e.dtype)

    def _final_logits(self, logits: Tensor) -> Tensor:
        """Gemma-2's final logit soft-capping, as ``Gemma2ForCausalLM.forward`` applies it."""
        cap = getattr(self.config, "final_logit_softcapping", None)
        return logits if not cap else torch.tanh(logits / cap) * cap


class Olmo2Adapter(LlamaAdapter):
    model_type = "olmo2"
    ATTN_NORM = None  # OLMo-2 normalises the attention *output*, not its input
    POST_ATTN_NORM = "post_attention_layernorm"
    MLP_NORM = None
    POST_MLP_NORM = "post_feedforward_layernorm"


_ADAPTERS: dict[str, type[Adapter]] = {
    cls.model_type: cls
    for cls in (GPT2Adapter, GPTNeoXAdapter, LlamaAdapter, Qwen3Adapter, Gemma2Adapter, Olmo2Adapter)
}
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(_ADAPTERS)


def get_adapter(model: nn.Module) -> Adapter:
    """The adapter for a loaded HF causal LM (``*ForCausalLM`` / ``GPT2LMHeadModel``) or its base model.

    Raises :class:`UnsupportedArchitectureError` for a ``config.model_type`` outside
    :data:`SUPPORTED_MODEL_TYPES`.
    """
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    cls = _ADAPTERS.get(model_type)
    if cls is None:
        raise UnsupportedArchitectureError(model_type)
    try:
        module_at(base_model(model), cls.LAYERS)
    except AttributeError as exc:
        raise ValueError(
            f"{type(model).__name__} (model_type={model_type!r}) has no `{cls.LAYERS}` in its base model: "
            "pass a transformers causal LM (e.g. from AutoModelForCausalLM) or its base model"
        ) from exc
    return cls(model)
