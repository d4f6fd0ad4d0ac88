"""Per-architecture adapters: the ONE place in mfpipe that knows module paths.

An :class:`Adapter` wraps an already-loaded ``transformers`` causal LM (eager attention, eval mode) and
offers two things:

1. :meth:`Adapter.capture` — one nnsight-traced forward pass that hands a :class:`LayerCapture` per
   layer (residual stream in, attention probabilities, per-head values and reads, attention / MLP
   branch outputs) to a callback *while the forward is running*, so only one layer's attention is
   alive at a time, then the final residual (before the last norm) to ``on_final``.
2. Block pieces (``embed``, ``position_offset``, ``attn_input_norm``, ``value_map``,
   ``out_proj_slices``, ``out_proj_bias``, ``post_attn_norm``, ``mlp``, ``final_norm``): pure functions of
   tensors with the frozen weights of each architecture's real block, for the open-loop mean-field
   rollout (paper Alg. 1, App. E).

Supported HF ``model_type``s: gpt2, gpt_neox, llama, qwen3, gemma2, olmo2. Anything else raises
:class:`UnsupportedArchitectureError`.

Conventions shared by all adapters
----------------------------------
* Heads: ``H = n_heads`` query heads of width ``d_head``. Grouped-query KV heads are expanded to query
  heads exactly as HF's ``repeat_kv`` does: query head ``h`` reads KV head ``h // (H // n_kv_heads)``.
* ``reads[..., h, :]`` is head ``h``'s slice of the input of the output projection (``c_proj`` /
  ``dense`` / ``o_proj``), i.e. ``sum_j probs[h, i, j] * values[h, j]``; and
  ``sum_h reads_h @ out_proj_slices(l)[h] + out_proj_bias(l)`` is the output projection's output.
* ``attn_out`` is what the attention branch adds to the residual stream: the output projection's output
  for GPT-2 / GPT-NeoX / Llama / Qwen-3, ``post_attention_layernorm(o_proj(...))`` for Gemma-2 / OLMo-2.
  ``resid_mid = resid_in + attn_out``.
* ``mlp_out`` is what the MLP branch adds to the residual stream, after the post-feedforward norm
  where present. For sequential blocks ``resid_in[l+1] = resid_mid + mlp_out``; for GPT-NeoX with
  ``use_parallel_residual`` the MLP reads the block input: ``resid_in[l+1] = resid_in + attn_out +
  mlp_out`` with ``mlp_out = mlp(l, resid_in)``. :meth:`Adapter.mlp` takes the residual stream the
  MLP branch reads (``resid_mid`` for sequential blocks, ``resid_in`` for parallel ones) and applies
  the branch's own pre-/post-norms.

nnsight 0.8 notes (checked here with nnsight 0.8.1, transformers 5.23)
---------------------------------------------------------------------
* The trace body runs in a greenlet interleaved with the forward; ``.input`` / ``.output`` give real
  tensors, and helper functions *called from* the body (``_capture_layer``) may read envoys too.
* Reads must follow forward-execution order; reading a module the forward already passed raises
  ``nnsight.intervention.interleaver.OutOfOrderError``.
* We trace the decoder stack (``model.base_model``) rather than using ``tracer.stop()`` to skip the LM
  head: ``stop()`` raises an exception whose traceback keeps the last layer's activations alive in a
  reference cycle until the next garbage collection.
* Wrapping a model with ``NNsight`` leaves its plain forward bit-identical; several wrappers of one
  model coexist.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, ClassVar

import torch
from torch import Tensor, nn

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "UnsupportedArchitectureError",
    "LayerCapture",
    "Adapter",
    "get_adapter",
]


class UnsupportedArchitectureError(ValueError):
    """The model's HF ``model_type`` has no adapter."""

    def __init__(self, model_type: str | None):
        self.model_type = model_type
        super().__init__(
            f"unsupported architecture: model_type={model_type!r}; "
            f"supported model_types: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )


@dataclass
class LayerCapture:
    """One layer's activations from :meth:`Adapter.capture` (float32; do not modify in place).

    Shapes: B batch, T positions, H query heads, dh head width, d model width.
    """

    layer: int
    resid_in: Tensor  # [B,T,d] residual stream entering block `layer`
    attn_probs: Tensor  # [B,H,T,T] attention probabilities (query, key)
    values: Tensor  # [B,H,T,dh] per-head values (head space, before the output projection), GQA expanded
    reads: Tensor  # [B,T,H,dh] per-head read = input of the output projection, split by head
    attn_out: Tensor  # [B,T,d] what the attention branch adds to the residual (after post-attn norm if any)
    resid_mid: Tensor  # [B,T,d] resid_in + attn_out
    mlp_out: Tensor  # [B,T,d] what the MLP branch adds to the residual (after post-ff norm if any)


def _get_path(root, path: str):
    """``root.a.b.c`` for ``path="a.b.c"`` (works on modules and on nnsight envoys)."""
    obj = root
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _identity(x: Tensor) -> Tensor:
    return x


def _no_grad(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with torch.no_grad():
            return fn(*args, **kwargs)

    return wrapper


def _base_model(model: nn.Module) -> nn.Module:
    """The decoder stack of an HF model (``model.base_model``; the model itself if already bare)."""
    base = getattr(model, "base_model", None)
    return model if base is None else base


class Adapter:
    """Architecture adapter for one loaded HF causal LM. Build it with :func:`get_adapter`.

    Attributes: ``model`` (the HF model given), ``base`` (its decoder stack, ``model.base_model``:
    ``GPT2Model`` / ``GPTNeoXModel`` / ``LlamaModel`` ...), ``config``, and the shape fields below.

    Subclasses set the module paths (relative to the base model for ``LAYERS`` / ``FINAL_NORM`` /
    ``EMBED``, relative to one block otherwise) and override the few methods whose weights are laid
    out differently (fused QKV, Conv1D).
    """

    model_type: ClassVar[str]
    # paths from the base model (model.base_model)
    LAYERS: ClassVar[str]
    EMBED: ClassVar[str]
    FINAL_NORM: ClassVar[str]
    # paths from one block
    ATTN: ClassVar[str]
    V_SRC: ClassVar[str]  # module whose output holds the values
    O_PROJ: ClassVar[str]  # output projection; its input is the per-head reads
    ATTN_NORM: ClassVar[str | None]  # pre-attention norm (None: absent)
    POST_ATTN_NORM: ClassVar[str | None] = None  # norm on the attention output (Gemma-2, OLMo-2)
    MLP: ClassVar[str] = "mlp"
    MLP_NORM: ClassVar[str | None]  # pre-MLP norm (None: absent)
    POST_MLP_NORM: ClassVar[str | None] = None  # norm on the MLP output (Gemma-2, OLMo-2)

    def __init__(self, model: nn.Module):
        self.model = model
        self.base: nn.Module = _base_model(model)
        cfg = model.config
        self.config = cfg
        self.n_layers: int = int(cfg.num_hidden_layers)
        self.n_heads: int = int(cfg.num_attention_heads)
        self.n_kv_heads: int = int(getattr(cfg, "num_key_value_heads", None) or self.n_heads)
        self.d_model: int = int(cfg.hidden_size)
        self.d_head: int = int(getattr(cfg, "head_dim", None) or self.d_model // self.n_heads)
        self.parallel_residual: bool = False
        self.has_post_attn_norm: bool = self.POST_ATTN_NORM is not None
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        self._layer_modules = _get_path(self.base, self.LAYERS)
        self._envoy = None  # nnsight wrapper of self.base, built on the first capture
        if len(self._layer_modules) != self.n_layers:
            raise ValueError(
                f"{self.model_type}: config says {self.n_layers} layers, model has {len(self._layer_modules)}"
            )

    # ------------------------------------------------------------------ basic properties
    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(model_type={self.model_type!r}, n_layers={self.n_layers}, "
            f"n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads}, d_model={self.d_model}, "
            f"d_head={self.d_head}, parallel_residual={self.parallel_residual}, "
            f"has_post_attn_norm={self.has_post_attn_norm})"
        )

    @property
    def dtype(self) -> torch.dtype:
        return self._embedding().weight.dtype

    @property
    def device(self) -> torch.device:
        return self._embedding().weight.device

    @property
    def n_rep(self) -> int:
        """Query heads per KV head (1 without grouped-query attention)."""
        return self.n_heads // self.n_kv_heads

    # ------------------------------------------------------------------ module access
    def _embedding(self) -> nn.Module:
        return _get_path(self.base, self.EMBED)

    def _block(self, layer: int) -> nn.Module:
        return self._layer_modules[layer]

    def _sub(self, layer: int, path: str) -> nn.Module:
        return _get_path(self._layer_modules[layer], path)

    def _opt_module(self, layer: int, path: str | None) -> Callable[[Tensor], Tensor]:
        return _identity if path is None else self._sub(layer, path)

    def _in(self, x: Tensor) -> Tensor:
        return x.to(device=self.device, dtype=self.dtype)

    # ------------------------------------------------------------------ capture
    def _values_from_src(self, src_out: Tensor) -> Tensor:
        """[B,T,*] output of ``V_SRC`` -> values [B,H,T,dh] (GQA expanded)."""
        B, T = src_out.shape[:2]
        v = src_out.view(B, T, self.n_kv_heads, self.d_head).transpose(1, 2)  # [B,KV,T,dh]
        if self.n_rep > 1:
            v = v.repeat_interleave(self.n_rep, dim=1)
        return v

    def _check_capturable(self) -> None:
        impl = getattr(self.config, "_attn_implementation", None)
        if impl != "eager":
            raise ValueError(
                f"Adapter.capture needs eager attention (got attn_implementation={impl!r}); load the model "
                "with mfpipe.models.loader.load_model or call model.set_attn_implementation('eager')"
            )
        if self.model.training or self.base.training:
            raise ValueError("Adapter.capture needs the model in eval mode (dropout); call model.eval()")

    def _capture_layer(self, layer_env, layer: int) -> LayerCapture:
        """Read one block's activations from inside a trace, in forward-execution order.

        Runs in the nnsight worker: each ``.input`` / ``.output`` access parks until the forward
        pass reaches that module and returns the real tensor.
        """
        resid_in = layer_env.input
        values = self._values_from_src(_get_path(layer_env, self.V_SRC).output)
        reads = _get_path(layer_env, self.O_PROJ).input
        attn_res = _get_path(layer_env, self.ATTN).output
        probs = attn_res[1]
        if self.POST_ATTN_NORM is not None:
            attn_out = _get_path(layer_env, self.POST_ATTN_NORM).output
        else:
            attn_out = attn_res[0]
        mlp_out = _get_path(layer_env, self.POST_MLP_NORM or self.MLP).output
        B, T = reads.shape[:2]
        resid_in = resid_in.float()
        attn_out = attn_out.float()
        return LayerCapture(
            layer=layer,
            resid_in=resid_in,
            attn_probs=probs.float(),
            values=values.float(),
            reads=reads.view(B, T, self.n_heads, self.d_head).float(),
            attn_out=attn_out,
            resid_mid=resid_in + attn_out,
            mlp_out=mlp_out.float(),
        )

    def capture(
        self,
        input_ids: Tensor,
        on_layer: Callable[[LayerCapture], None],
        on_final: Callable[[Tensor], None] | None = None,
    ) -> None:
        """ONE nnsight-traced forward pass over ``input_ids`` [B,T] (no padding, no attention mask;
        any integer tensor or array, e.g. a shard's int32 tokens).

        Calls ``on_layer(LayerCapture)`` once per layer, in layer order, from inside the trace with
        real float32 tensors (views of the model's own activations when the model is float32: do not
        modify them in place), then ``on_final(final residual before the last norm [B,T,d])``. Only
        the decoder stack (``model.base_model``) runs: the LM head is never computed. Runs under
        ``torch.no_grad()``. Exceptions raised by the callbacks propagate unchanged.
        """
        self._check_capturable()
        if self._envoy is None:
            from nnsight import NNsight

            self._envoy = NNsight(self.base)
        envoy = self._envoy
        ids = torch.as_tensor(input_ids).to(device=self.device, dtype=torch.long)
        if ids.ndim != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {tuple(ids.shape)}")
        layers_env = _get_path(envoy, self.LAYERS)
        final_env = _get_path(envoy, self.FINAL_NORM)
        n_layers = self.n_layers
        with torch.no_grad():
            with envoy.trace(ids, use_cache=False):
                for layer in range(n_layers):
                    on_layer(self._capture_layer(layers_env[layer], layer))
                if on_final is not None:
                    on_final(final_env.input.float())

    # ------------------------------------------------------------------ block pieces
    @_no_grad
    def embed(self, ids: Tensor) -> Tensor:
        """Token embedding ``[..., d]`` incl. any embedding scale (Gemma-2: sqrt(d)); no positions."""
        return self._embedding()(ids.to(self.device))

    def position_offset(self, context_length: int | None = None) -> Tensor | None:
        """Mean learned positional embedding over positions ``0..T-1`` (``[d]``), or None (rotary).

        ``context_length`` T defaults to the whole learned table; pass the window length.
        """
        return None

    @_no_grad
    def attn_input_norm(self, layer: int, x: Tensor) -> Tensor:
        """The norm applied to the residual stream before attention (identity where absent: OLMo-2)."""
        return self._opt_module(layer, self.ATTN_NORM)(self._in(x)).to(x.dtype)

    @_no_grad
    def value_map(self, layer: int, x: Tensor) -> Tensor:
        """v(x): residual stream ``[..., d]`` -> per-head values ``[..., H, dh]`` (incl. the pre-attention
        norm and the value bias; GQA KV heads expanded to query heads)."""
        h = self._opt_module(layer, self.ATTN_NORM)(self._in(x))
        v = self._sub(layer, self.V_SRC)(h)
        v = v.unflatten(-1, (self.n_kv_heads, self.d_head))
        if self.n_rep > 1:
            v = v.repeat_interleave(self.n_rep, dim=-2)
        return v.to(x.dtype)

    @_no_grad
    def out_proj_slices(self, layer: int) -> Tensor:
        """``[H, dh, d]`` so that ``sum_h reads[..., h, :] @ W[h] + out_proj_bias`` = output projection."""
        w = self._sub(layer, self.O_PROJ).weight  # nn.Linear: [d, H*dh]
        return w.detach().t().reshape(self.n_heads, self.d_head, self.d_model)

    @_no_grad
    def out_proj_bias(self, layer: int) -> Tensor | None:
        b = self._sub(layer, self.O_PROJ).bias
        return None if b is None else b.detach()

    @_no_grad
    def post_attn_norm(self, layer: int, x: Tensor) -> Tensor:
        """The norm on the attention output before it joins the residual (identity where absent)."""
        return self._opt_module(layer, self.POST_ATTN_NORM)(self._in(x)).to(x.dtype)

    @_no_grad
    def mlp(self, layer: int, x_resid: Tensor) -> Tensor:
        """The MLP branch as a function of the residual stream it reads (``resid_mid`` for sequential
        blocks, the block input for GPT-NeoX parallel residual): pre-norm, MLP, post-norm where present."""
        h = self._opt_module(layer, self.MLP_NORM)(self._in(x_resid))
        h = self._sub(layer, self.MLP)(h)
        return self._opt_module(layer, self.POST_MLP_NORM)(h).to(x_resid.dtype)

    @_no_grad
    def final_norm(self, x: Tensor) -> Tensor:
        return _get_path(self.base, self.FINAL_NORM)(self._in(x)).to(x.dtype)


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

    @_no_grad
    def value_map(self, layer: int, x: Tensor) -> Tensor:
        d = self.d_model
        h = self._sub(layer, self.ATTN_NORM)(self._in(x))
        c_attn = self._sub(layer, self.V_SRC)
        v = torch.addmm(c_attn.bias[2 * d :], h.reshape(-1, d), c_attn.weight[:, 2 * d :])
        return v.view(*h.shape[:-1], self.n_heads, self.d_head).to(x.dtype)

    @_no_grad
    def out_proj_slices(self, layer: int) -> Tensor:
        w = self._sub(layer, self.O_PROJ).weight  # Conv1D: [d_in = H*dh, d_out = d]
        return w.detach().reshape(self.n_heads, self.d_head, self.d_model)

    @_no_grad
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

    @_no_grad
    def value_map(self, layer: int, x: Tensor) -> Tensor:
        H, dh, d = self.n_heads, self.d_head, self.d_model
        h = self._sub(layer, self.ATTN_NORM)(self._in(x))
        qkv = self._sub(layer, self.V_SRC)
        w = qkv.weight.view(H, 3, dh, d)[:, 2].reshape(H * dh, d)
        b = None if qkv.bias is None else qkv.bias.view(H, 3, dh)[:, 2].reshape(H * dh)
        v = nn.functional.linear(h, w, b)
        return v.unflatten(-1, (H, dh)).to(x.dtype)


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

    @_no_grad
    def embed(self, ids: Tensor) -> Tensor:
        """Token embedding times sqrt(d), rounded to the embedding dtype as the model does. Where the scale
        lives moved between transformers releases: recent ones use ``Gemma2TextScaledWordEmbedding`` (the module
        scales, it has ``embed_scale``); 4.x used a plain ``nn.Embedding`` and ``Gemma2Model.forward``
        multiplied by ``torch.tensor(hidden_size**0.5, dtype=hidden_states.dtype)``."""
        e = super().embed(ids)
        if hasattr(self._embedding(), "embed_scale"):
            return e
        return e * torch.tensor(self.config.hidden_size**0.5, dtype=e.dtype)


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
        _get_path(_base_model(model), cls.LAYERS)
    except AttributeError as exc:
        raise ValueError(
            f"{type(model).__name__} (model_type={model_type!r}) has no `{cls.LAYERS}` in its base model: "
            "pass a transformers causal LM (e.g. from AutoModelForCausalLM) or its base model"
        ) from exc
    return cls(model)
