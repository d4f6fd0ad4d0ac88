"""The adapter base class: module paths, shapes and the block pieces of one loaded HF causal LM.

An :class:`Adapter` wraps an already-loaded ``transformers`` causal LM (eager attention, eval mode) and
offers two things:

1. The read/patch site (:class:`~mfpipe.models.adapters.site.TracedSite`, mixed in): ``run`` — ONE
   nnsight-traced forward pass that hands the selected :class:`LayerCapture` fields of each layer
   (residual stream in, attention probabilities, per-head values and reads, attention / MLP branch
   outputs) to a callback *while the forward is running*, can replace every head's read at the output
   projection's input, and can return the logits and the next-token loss (the statistics pass runs it with
   the fields its reducer reads); ``capture`` — all fields, no LM head.
2. Block pieces (``embed``, ``position_offset``, ``attn_input_norm``, ``value_map`` / ``value_weights``,
   ``out_proj_slices``, ``out_proj_bias``, ``post_attn_norm``, ``mlp``, ``final_norm``): pure functions of
   tensors with the frozen weights of each architecture's real block, for the open-loop mean-field
   rollout (paper Alg. 1, App. E); ``unembed`` (final norm + LM head) for the logit lens of App. P.

The per-architecture subclasses (module paths, fused-QKV / Conv1D layouts) are in ``architectures.py``.

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
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor, nn

from mfpipe.models.adapters.site import LayerCapture, TracedSite, module_at

__all__ = ["Adapter", "LayerCapture", "NormForm"]


@dataclass(frozen=True)
class NormForm:
    """A norm written as ``scale * z + shift`` of the normalised row ``z`` (float32 ``x`` of width d):
    ``"layer"``: ``z = (x - mean(x)) / sqrt(var(x) + eps)``; ``"rms"``: ``z = x / sqrt(mean(x²) + eps)``;
    ``"identity"``: ``z = x``. ``scale`` / ``shift`` [d] (None: 1 / 0). Affine in ``z``, so a sum over n rows is
    ``scale * sum z + n shift`` (the statistics pass sums ``z`` in its own loop instead of calling the module)."""

    kind: str
    eps: float = 0.0
    scale: Tensor | None = None
    shift: Tensor | None = None


def _identity(x: Tensor) -> Tensor:
    return x


def no_grad(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with torch.no_grad():
            return fn(*args, **kwargs)

    return wrapper


def base_model(model: nn.Module) -> nn.Module:
    """The decoder stack of an HF model (``model.base_model``; the model itself if already bare)."""
    base = getattr(model, "base_model", None)
    return model if base is None else base


class Adapter(TracedSite):
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
        self.base: nn.Module = base_model(model)
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
        self._layer_modules = module_at(self.base, self.LAYERS)
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
        return module_at(self.base, self.EMBED)

    def _block(self, layer: int) -> nn.Module:
        return self._layer_modules[layer]

    def _sub(self, layer: int, path: str) -> nn.Module:
        return module_at(self._layer_modules[layer], path)

    def _opt_module(self, layer: int, path: str | None) -> Callable[[Tensor], Tensor]:
        return _identity if path is None else self._sub(layer, path)

    def _in(self, x: Tensor) -> Tensor:
        return x.to(device=self.device, dtype=self.dtype)

    # ------------------------------------------------------------------ layouts
    def _values_from_src(self, src_out: Tensor) -> Tensor:
        """[B,T,*] output of ``V_SRC`` -> values [B,H,T,dh] (GQA expanded)."""
        B, T = src_out.shape[:2]
        v = src_out.view(B, T, self.n_kv_heads, self.d_head).transpose(1, 2)  # [B,KV,T,dh]
        if self.n_rep > 1:
            v = v.repeat_interleave(self.n_rep, dim=1)
        return v

    # ------------------------------------------------------------------ block pieces
    @no_grad
    def embed(self, ids: Tensor) -> Tensor:
        """Token embedding ``[..., d]`` incl. any embedding scale (Gemma-2: sqrt(d)); no positions."""
        return self._embedding()(ids.to(self.device))

    def position_offset(self, context_length: int | None = None, position_count=None) -> Tensor | None:
        """Mean learned positional embedding ``[d]`` over the positions tracked queries occupy (``1..T-1``,
        weighted by ``position_count [T]`` when given), or None where positions are rotary (GPT-2 overrides).

        ``context_length`` T defaults to the whole learned table; pass the window length.
        """
        return None

    @no_grad
    def attn_input_norm(self, layer: int, x: Tensor) -> Tensor:
        """The norm applied to the residual stream before attention (identity where absent: OLMo-2)."""
        return self._opt_module(layer, self.ATTN_NORM)(self._in(x)).to(x.dtype)

    def attn_input_norm_form(self, layer: int) -> NormForm | None:
        """:meth:`attn_input_norm` as a :class:`NormForm` (its weights, no copies), or None where it has none the
        statistics pass can use: a norm module of another kind, or a model that is not float32 (its norm rounds its
        output to the model's dtype; a form's sums would not). nn.LayerNorm -> ``layer``; an RMS norm with
        ``variance_epsilon`` and a ``weight`` it multiplies by (Llama, Qwen-3) -> ``rms``; none (OLMo-2) ->
        ``identity``. Architectures whose norm differs (Gemma-2: ``1 + weight``) override this; the statistics pass
        also checks the form against the module on a probe before it uses it."""
        if self.dtype != torch.float32:
            return None
        if self.ATTN_NORM is None:
            return NormForm("identity")
        m = self._sub(layer, self.ATTN_NORM)
        if type(m) is nn.LayerNorm:
            return NormForm("layer", float(m.eps), m.weight, m.bias)
        w, eps = getattr(m, "weight", None), getattr(m, "variance_epsilon", None)
        if isinstance(w, Tensor) and w.ndim == 1 and isinstance(eps, float):
            return NormForm("rms", eps, w)
        return None

    @no_grad
    def value_map(self, layer: int, x: Tensor) -> Tensor:
        """v(x): residual stream ``[..., d]`` -> per-head values ``[..., H, dh]`` (incl. the pre-attention
        norm and the value bias; GQA KV heads expanded to query heads)."""
        h = self._opt_module(layer, self.ATTN_NORM)(self._in(x))
        v = self._sub(layer, self.V_SRC)(h)
        v = v.unflatten(-1, (self.n_kv_heads, self.d_head))
        if self.n_rep > 1:
            v = v.repeat_interleave(self.n_rep, dim=-2)
        return v.to(x.dtype)

    @no_grad
    def value_weights(self, layer: int) -> tuple[Tensor, Tensor | None]:
        """``(W [H, d, dh], b [H, dh] or None)``: the value projection as an affine map of the attention-input norm's
        output ``h = attn_input_norm(layer, x)``, ``values[..., k, :] = h @ W[k] + b[k]`` (GQA KV heads expanded to
        query heads), so that ``value_map(layer, x)`` is that map of the norm. Being affine, it maps a sum of ``h``
        over n positions to the sum of their values: ``sum v = (sum h) @ W + n b`` (the statistics pass derives its
        per-head value sums from the norm's sums this way)."""
        proj = self._sub(layer, self.V_SRC)
        KV, dh = self.n_kv_heads, self.d_head
        w = proj.weight.detach().view(KV, dh, -1).transpose(1, 2)  # nn.Linear: [KV*dh, d] -> [KV, d, dh]
        b = None if proj.bias is None else proj.bias.detach().view(KV, dh)
        if self.n_rep > 1:
            w = w.repeat_interleave(self.n_rep, dim=0)
            b = None if b is None else b.repeat_interleave(self.n_rep, dim=0)
        return w, b

    @no_grad
    def out_proj_slices(self, layer: int) -> Tensor:
        """``[H, dh, d]`` so that ``sum_h reads[..., h, :] @ W[h] + out_proj_bias`` = output projection."""
        w = self._sub(layer, self.O_PROJ).weight  # nn.Linear: [d, H*dh]
        return w.detach().t().reshape(self.n_heads, self.d_head, self.d_model)

    @no_grad
    def out_proj_bias(self, layer: int) -> Tensor | None:
        b = self._sub(layer, self.O_PROJ).bias
        return None if b is None else b.detach()

    def attn_out_weights(self, layer: int) -> tuple[Tensor, Tensor | None] | None:
        """``(W [H, dh, d], b [d] or None)`` where ``attn_out`` is that affine map of the per-head reads,
        ``attn_out = sum_h reads[..., h, :] @ W[h] + b`` (the output projection, :meth:`out_proj_slices` /
        :meth:`out_proj_bias`): the statistics pass then derives its attn_out sums from its read sums. None where
        it is not: a norm after the projection (Gemma-2, OLMo-2), or a model that is not float32 (its attn_out is
        rounded to the model's dtype)."""
        if self.POST_ATTN_NORM is not None or self.dtype != torch.float32:
            return None
        return self.out_proj_slices(layer), self.out_proj_bias(layer)

    @property
    def mlp_out_from_resid(self) -> bool:
        """Whether ``mlp_out`` is, to float32 rounding, what the residual stream gained in the block besides
        ``attn_out``: ``mlp_out = resid_in[l+1] - resid_in[l] - attn_out`` (sequential and parallel blocks alike, the
        convention above; ``resid_in[L]`` is the final residual). The statistics pass then derives its mlp_out sums
        from its residual and attn_out sums and does not read the MLP's output. False for a model that is not float32:
        its residual additions round to the model's dtype (bfloat16: 2^-9 of the residual, not of mlp_out)."""
        return self.dtype == torch.float32

    @no_grad
    def post_attn_norm(self, layer: int, x: Tensor) -> Tensor:
        """The norm on the attention output before it joins the residual (identity where absent)."""
        return self._opt_module(layer, self.POST_ATTN_NORM)(self._in(x)).to(x.dtype)

    @no_grad
    def mlp(self, layer: int, x_resid: Tensor) -> Tensor:
        """The MLP branch as a function of the residual stream it reads (``resid_mid`` for sequential
        blocks, the block input for GPT-NeoX parallel residual): pre-norm, MLP, post-norm where present."""
        h = self._opt_module(layer, self.MLP_NORM)(self._in(x_resid))
        h = self._sub(layer, self.MLP)(h)
        return self._opt_module(layer, self.POST_MLP_NORM)(h).to(x_resid.dtype)

    @no_grad
    def final_norm(self, x: Tensor) -> Tensor:
        return module_at(self.base, self.FINAL_NORM)(self._in(x)).to(x.dtype)

    @no_grad
    def unembed(self, x: Tensor) -> Tensor:
        """Logits ``[..., V]`` (float32) of residual-stream vectors ``[..., d]``: the final norm, then the LM head
        (``get_output_embeddings``), then any final logit transform of the architecture (:meth:`_final_logits`).
        The raw logit lens of a vector inserted into the residual stream (App. P). Needs the causal LM."""
        if not self.has_lm_head:
            raise ValueError(f"unembed needs the causal LM, but this adapter wraps the bare {type(self.base).__name__}")
        h = module_at(self.base, self.FINAL_NORM)(self._in(x))
        return self._final_logits(self.model.get_output_embeddings()(h)).float()

    def _final_logits(self, logits: Tensor) -> Tensor:
        return logits
