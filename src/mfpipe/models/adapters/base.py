"""The adapter base class: module paths, shapes and the block pieces of one loaded HF causal LM.

An :class:`Adapter` wraps a loaded ``transformers`` causal LM (eager attention, eval mode) and offers two things:

1. The read/patch site (:class:`~mfpipe.models.adapters.site.TracedSite`, mixed in): ``run`` — ONE nnsight-traced
   forward pass that hands the selected :class:`LayerCapture` fields of each layer to a callback *while the forward
   is running*, can replace every head's read at the output projection's input and that projection's output
   (``patch_out``), and can return the logits and the next-token loss; ``capture`` — all fields, no LM head.
2. Block pieces (``embed``, ``position_table`` / ``position_offset``, ``attn_input_norm``, ``value_map`` /
   ``value_weights`` (:mod:`~mfpipe.models.adapters.values`, mixed in), ``out_proj_slices``, ``out_proj_bias``,
   ``post_attn_norm``, ``mlp``, ``final_norm``): pure functions of tensors with the frozen weights of each
   architecture's real block, for the open-loop mean-field rollout (paper Alg. 1, App. E); ``unembed`` (final norm +
   LM head) for the logit lens of App. P.

A model's pieces are where its :class:`~mfpipe.models.adapters.structure.Structure` says (found by what they do).

Conventions shared by all adapters
----------------------------------
* Heads: ``H = n_heads`` query heads whose values and reads are ``d_head`` wide (latent attention's ``v_head_dim``);
  grouped-query KV heads expanded as HF's ``repeat_kv`` does: query head ``h`` reads KV head ``h // (H // n_kv_heads)``.
  Where the layers differ (:mod:`~mfpipe.models.adapters.layers`), layer ``l``'s heads are ``head_dim(l)`` wide with
  ``kv_heads(l)`` KV heads, and every head-space tensor is zero-padded to ``d_head``, the widest (an exact embedding).
* ``reads[..., h, :]``, head ``h``'s read, is ``sum_j probs[h, i, j] * values[h, j]``; the attention branch before any
  post-norm is ``sum_h (reads_h * g_h) @ out_proj_slices(l)[h] + out_proj_bias(l)``, ``g_h`` 1 or an output gate of
  the query's residual (``read_gate(l, resid_in)``: Qwen3-Next's, :mod:`~mfpipe.models.adapters.gate`).
* ``attn_out`` / ``mlp_out`` are what the attention / MLP branch adds to the residual stream (after a post-norm, times
  a branch scale, where present; ``resid_mid = resid_in + attn_out``). Sequential blocks: ``resid_in[l+1] = resid_mid
  + mlp_out``; parallel ones (GPT-NeoX): ``resid_in[l+1] = resid_in + attn_out + mlp(l, resid_in)``; a block that
  scales its output (Gemma-4's ``layer_scalar``) hands on that sum times its scale (:meth:`Adapter.block_output`), a
  post-norm block (GPT-1, TrOCR) a norm of it (:meth:`Adapter.block_join`, which every consumer composes blocks by).
  :meth:`Adapter.mlp` takes the residual stream the MLP branch reads (``resid_mid`` or ``resid_in``).
* Shapes: a piece maps ``[..., d]``; where a model mixes positions in a piece (Inkling's short convolutions:
  :mod:`~mfpipe.models.adapters.convolved`) a 3-D ``[B, T, d]`` is a batch of sequences and a 2-D ``[N, d]`` rows,
  each a sequence of one position (the rollout's type centroids).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from mfpipe.models.adapters.asked import ask_for_probabilities
from mfpipe.models.adapters.capture import first_output
from mfpipe.models.adapters.configs import config_value
from mfpipe.models.adapters.convolved import on_rows, position_conv
from mfpipe.models.adapters.gate import has_gate
from mfpipe.models.adapters.hybrid import check_attention, layer_kinds
from mfpipe.models.adapters.layers import pad_heads
from mfpipe.models.adapters.residual import affine_embedding, table_rows
from mfpipe.models.adapters.site import LayerCapture, TracedSite, module_at
from mfpipe.models.adapters.streaming import holds_block
from mfpipe.models.adapters.structure import Structure, base_model
from mfpipe.models.adapters.values import ValueMaps, block_piece, no_grad

__all__ = ["Adapter", "LayerCapture", "NormForm", "base_model"]


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


_identity = nn.Identity()  # an absent norm


class Adapter(ValueMaps, TracedSite):  # the value maps: adapters.values
    """Architecture adapter for one loaded HF causal LM. Build it with :func:`get_adapter`, which places the model by
    structure (:func:`~mfpipe.models.adapters.structure.describe`).

    Attributes: ``model`` (the HF model given), ``base`` (its decoder stack, ``model.base_model``), ``config``,
    ``structure`` and the shape fields below. The module paths (``LAYERS`` / ``EMBED`` / ``FINAL_NORM`` from the base
    model, the rest from one block) are the structure's; the value layouts (fused or not, Conv1D, latent) are
    :mod:`~mfpipe.models.adapters.values`'s."""

    def __init__(self, model: nn.Module, structure: Structure):
        self.model = model
        self.base: nn.Module = base_model(model)
        self.config = cfg = model.config
        self.structure = s = structure
        self.model_type: str = str(cfg.model_type)
        self.LAYERS, self.EMBED, self.FINAL_NORM = s.layers, s.embed, s.final_norm
        self.ATTN, self.V_SRC, self.O_PROJ = s.attn, s.value_source, s.out_proj
        self.ATTN_NORM, self.POST_ATTN_NORM = s.attn_norm, s.post_attn_norm
        self.MLP, self.MLP_NORM, self.POST_MLP_NORM = s.mlp, s.mlp_norm, s.post_mlp_norm
        self.n_layers: int = int(cfg.num_hidden_layers)
        self.n_heads: int = int(cfg.num_attention_heads)
        # a per-layer attribute (Gemma-4's): layer 0's; the other layers' are their forms' (adapters.layers)
        self.n_kv_heads: int = int(s.kv_heads or config_value(cfg, "num_key_value_heads") or self.n_heads)
        self.d_model: int = int(cfg.hidden_size)
        self.d_head: int = int(s.value_head_dim or config_value(cfg, "head_dim") or self.d_model // self.n_heads)
        self.parallel_residual: bool = bool(s.parallel_residual)
        self.has_post_attn_norm: bool = self.POST_ATTN_NORM is not None
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        self._layer_modules = module_at(self.base, self.LAYERS)
        if len(self._layer_modules) != self.n_layers:
            raise ValueError(f"{self.model_type}: config says {self.n_layers} layers, has {len(self._layer_modules)}")
        self.layer_kinds, self.attention_layers, self.hybrid = layer_kinds(s, self.n_layers)  # pieces: attention only
        self._place_values()  # the value source's layout (adapters.values)
        self._install_sinks()  # the taps of an attention sink's factor (adapters.sinks: Granite-SWA's)
        # GPT-1's attention returns its probabilities only when asked (adapters.asked; describe asks too, for its
        # probe: here for an adapter built from a structure given)
        ask_for_probabilities(self._sub(l, self.ATTN) for l in self.attention_layers)

    # ------------------------------------------------------------------ basic properties
    def __repr__(self) -> str:
        return (f"Adapter(model_type={self.model_type!r}, n_layers={self.n_layers}, n_heads={self.n_heads}, n_kv_heads="
                f"{self.n_kv_heads}, d_model={self.d_model}, d_head={self.d_head}, parallel_residual="
                f"{self.parallel_residual}, has_post_attn_norm={self.has_post_attn_norm})")

    @property
    def dtype(self) -> torch.dtype:
        return self._embedding().weight.dtype

    @property
    def device(self) -> torch.device:
        return self._embedding().weight.device

    @property
    def state_in_cache(self) -> bool:
        """Whether the model's cache holds a state its next token updates in place: a hybrid's state-space or recurrent
        state, Inkling's convolution states (:mod:`~mfpipe.models.adapters.convolved`); the Jacobians and the J-lens
        products then run each window whole, not the token after a kept prefix."""
        block = self.block_module(self.attention_layers[0])
        return self.hybrid or any(isinstance(m, nn.Conv1d) and position_conv(m) for m in block.modules())

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
        check_attention(self, layer, path)  # a hybrid's block of another mixer has none of the pieces
        return module_at(self._layer_modules[layer], path)

    def _opt_module(self, layer: int, path: str | None) -> Callable[[Tensor], Tensor]:
        return _identity if path is None else self._sub(layer, path)

    def _in(self, x: Tensor) -> Tensor:
        return x.to(device=self.device, dtype=self.dtype)

    # ------------------------------------------------------------------ block pieces
    @no_grad
    def embed(self, ids: Tensor, offset: Tensor | None = None) -> Tensor:
        """Token embedding ``[..., d]`` incl. any embedding scale (the Gemma family: sqrt(d), in the embedding module
        or, where the forward applies it, here as the forward does: a tensor of the embedding's dtype), plus
        ``offset [d]`` where given (a position row, or a mean of them: :meth:`position_offset`), then the embedding's
        norm where block 0 reads one (BLOOM's of the embedding; TrOCR's of the embedding plus its position row)."""
        e = self._embedding()(ids.to(self.device))
        if self.structure.embed_scale != 1.0:
            e = e * torch.tensor(self.structure.embed_scale, dtype=e.dtype)
        if self.structure.embed_affine is not None:  # (e + b) * s by the base model's own vectors (Zaya's)
            e = affine_embedding(self.base, e, self.structure.embed_affine).to(e.dtype)
        if offset is not None:
            e = e + offset.to(device=e.device, dtype=e.dtype)
        if self.structure.embed_norm is not None:
            e = module_at(self.base, self.structure.embed_norm)(e)
        return e

    @no_grad
    def position_table(self) -> Tensor | None:
        """The absolute position table ``W_pos [n_positions, d]`` (row p: position p; GPT-2's learned, XGLM's and CTRL's
        sinusoidal), or None where positions are not a table added to the embedding (rotary)."""
        if self.structure.position_table is None:
            return None  # below: position p's row is p + position_row_offset (OPT's table starts at row 2)
        table = table_rows(module_at(self.base, self.structure.position_table))
        return table.detach()[self.structure.position_row_offset:]

    def position_offset(self, context_length: int | None = None, position_count=None) -> Tensor | None:
        """Mean positional embedding ``[d]`` over the positions tracked queries occupy: ``1..T-1`` (position 0 holds
        BOS, never a query: left out), or None without a table (rotary).

        A type's true layer-0 centroid is its embedding plus the table's mean over ITS occurrences; one offset for all
        types comes closest to those (occurrence-weighted squared error) as the table weighted by ``position_count
        [T]`` (the statistics half's tracked-query count per position); without it uniform over ``1..T-1`` (packed
        full windows). ``context_length`` T defaults to ``len(position_count)``, else to the whole table."""
        wpe = self.position_table()
        if wpe is None:
            return None
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

    @block_piece
    def attn_input_norm(self, layer: int, x: Tensor, scaled: bool = True) -> Tensor:
        """The norm applied to the residual stream before attention (identity where absent: OLMo-2), times the number
        the block multiplies the attention's input by (Falcon-H1's ``attention_in_multiplier``; not where ``scaled`` is
        False: what its mixer beside the attention reads)."""
        h = self._opt_module(layer, self.ATTN_NORM)(self._in(x))
        m = self.structure.attn_scales[0]
        return (h if m == 1.0 or not scaled else h * m).to(x.dtype)

    @holds_block
    def attn_input_norm_form(self, layer: int) -> NormForm | None:
        """:meth:`attn_input_norm` as a :class:`NormForm` (its weights, no copies), or None where it has none the
        statistics pass can use: a norm of another kind, or a model not float32 (its norm rounds to its dtype; a form's
        sums would not). nn.LayerNorm -> ``layer``; an RMS norm with ``variance_epsilon`` (or ``eps``) and a
        ``weight`` it multiplies by, or by ``1 + weight`` (the Gemma family: ``rms_offset``) -> ``rms``; none (OLMo-2)
        -> ``identity``. The statistics pass checks the form against the module on a probe before it uses it."""
        if self.dtype != torch.float32 or self.hybrid or self.structure.attn_scales[0] != 1.0:  # a hybrid's other
            return None  # layers have no attention-input norm; an input scale is no norm's form
        if self.ATTN_NORM is None:
            return NormForm("identity")
        m = self._sub(layer, self.ATTN_NORM)
        if type(m) is nn.Identity:  # a block without the others' norm (ModernBERT-decoder's first)
            return NormForm("identity")
        if type(m) is nn.LayerNorm:
            return NormForm("layer", float(m.eps), m.weight, m.bias)
        w = getattr(m, "weight", None)
        eps = getattr(m, "variance_epsilon", None)
        eps = getattr(m, "eps", None) if eps is None else eps
        if isinstance(w, Tensor) and w.ndim == 1 and isinstance(eps, float) and self.structure.norm_centred:
            return NormForm("layer", eps, w, None)  # a LayerNorm without a bias (Cohere)
        if isinstance(w, Tensor) and w.ndim == 1 and isinstance(eps, float):
            off = self.structure.rms_offset  # the Gemma family scales by 1 + weight
            return NormForm("rms", eps, w if not off else off + w.detach())
        return None

    @block_piece
    def out_proj_slices(self, layer: int) -> Tensor:
        """``[H, dh, d]`` so that ``sum_h reads[..., h, :] @ W[h] + out_proj_bias`` = output projection (NaN at a
        hybrid's layer of another mixer: it has none, and what is made of it is NaN, as its statistics are; a layer of
        narrower heads has its rows zero-padded to ``d_head``, as its reads are)."""
        if layer not in self.attention_layers:
            return torch.full((self.n_heads, self.d_head, self.d_model), float("nan"), dtype=self.dtype,
                              device=self.device)
        proj = self._sub(layer, self.O_PROJ)
        w = proj.weight.detach() if self._conv1d(proj) else proj.weight.detach().t()  # -> [H*dh, d]
        w = w.reshape(self.n_heads, self.head_dim(layer), self.d_model)  # rows zero-padded to d_head: adapters.layers
        return w if self.head_dim(layer) == self.d_head else pad_heads(w.transpose(1, 2), self.d_head).transpose(1, 2)

    def out_proj_module(self, layer: int) -> nn.Module:
        """The output projection of block ``layer`` (its input is the per-head reads, but where :meth:`reads_module`
        is another module)."""
        return self._sub(layer, self.O_PROJ)

    def reads_module(self, layer: int) -> nn.Module:
        """The module of block ``layer`` whose input is the per-head reads: the output projection, or the norm of every
        head's reads before it (BitNet's, :mod:`~mfpipe.models.adapters.normed`): where a plain torch hook that
        replaces the reads goes (the conformance check's reference for the site's write-back)."""
        return self._sub(layer, self.structure.reads_norm or self.O_PROJ)

    def block_module(self, layer: int) -> nn.Module:
        """Block ``layer`` of the decoder stack; its hidden-states input (first positional argument or the
        ``hidden_states`` keyword, by transformers version) is the residual stream entering it, ``resid_in[layer]``:
        where a plain torch pre-hook reads or replaces that residual (the J-lens's ``block`` point, mfpipe.jlens)."""
        return self._block(layer)

    def final_norm_module(self) -> nn.Module:
        """The decoder stack's final norm (an identity where it has none); its input is the final residual."""
        return nn.Identity() if self.FINAL_NORM is None else module_at(self.base, self.FINAL_NORM)

    @block_piece
    def out_proj_bias(self, layer: int) -> Tensor | None:
        extra = None if self.structure.attn_bias is None else self._sub(layer, self.structure.attn_bias)
        b = self._sub(layer, self.O_PROJ).bias  # and the bias the attention returns, added (GPT-NeoX-Japanese's)
        b = b if extra is None else extra if b is None else b + extra
        return None if b is None else b.detach()

    @holds_block
    def attn_out_weights(self, layer: int) -> tuple[Tensor, Tensor | None] | None:
        """``(W [H, dh, d], b [d] or None)`` where ``attn_out`` is that affine map of the per-head reads,
        ``attn_out = sum_h reads[..., h, :] @ W[h] + b`` (the output projection, :meth:`out_proj_slices` /
        :meth:`out_proj_bias`): the statistics pass then derives its attn_out sums from its read sums. None where
        it is not: a norm after the projection (Gemma-2, OLMo-2), an output gate or a norm of the reads before it, or a
        model that is not float32 (its attn_out is rounded to the model's dtype)."""
        if self.POST_ATTN_NORM is not None or self.dtype != torch.float32 or self.hybrid or has_gate(self):
            return None
        c, w, b = self._attn_scale(), self.out_proj_slices(layer), self.out_proj_bias(layer)
        return (w, b) if c == 1.0 else (w * c, None if b is None else b * c)

    @property
    def mlp_out_from_resid(self) -> bool:
        """Whether ``mlp_out`` is, to float32 rounding, what the residual stream gained in the block besides
        ``attn_out``: ``mlp_out = resid_in[l+1] - resid_in[l] - attn_out`` (sequential and parallel blocks alike, the
        convention above; ``resid_in[L]`` is the final residual). The statistics pass then derives its mlp_out sums
        from its residual and attn_out sums and does not read the MLP's output. False for a model that is not float32:
        its residual additions round to the model's dtype (bfloat16: 2^-9 of the residual, not of mlp_out)."""
        return (self.dtype == torch.float32 and not self.hybrid and self.structure.side_mixer is None  # 3 branches
                and not self._scales_blocks()  # a block that scales its sum (Gemma-4's layer_scalar != 1)
                and self.structure.block_norm is None  # post-norm: the block hands on a norm of its sum
                and self.structure.join == "sum")  # a join of the block's own (adapters.joins)

    def _scales_blocks(self) -> bool:
        return self.structure.resid_scale is not None and any(
            bool((self._sub(l, self.structure.resid_scale) != 1).any()) for l in self.attention_layers)

    @no_grad  # not held: a buffer stays resident where blocks are streamed (adapters.streaming)
    def block_output(self, layer: int, x: Tensor) -> Tensor:
        """The residual block ``layer`` hands on, of the sum ``x`` of its input and its branches: ``x`` times the
        block's own scale where it multiplies its output so (Gemma-4's ``layer_scalar`` buffer, a tensor as the block
        multiplies: to the bit in the model's dtype), else ``x``; so ``resid_in[l+1] = s_l (resid_mid + mlp_out)``."""
        path = self.structure.resid_scale
        return x if path is None else x * self._sub(layer, path).to(device=x.device, dtype=x.dtype)

    @block_piece
    def block_join(self, layer: int, mid: Tensor, mlp_out: Tensor) -> Tensor:
        """The residual block ``layer`` hands on, of ``mid = resid_in + attn_out`` (``resid_mid``; a parallel block's
        sum of its input and attention branch too) and its MLP branch ``mlp_out``: :meth:`block_output` of their sum;
        in a post-norm block (``structure.block_norm``) of the block's norm of it, where the MLP branch joins the MLP's
        norm's output instead of ``mid`` (``norm_carried``: GPT-1's ``ln_2(ln_1(x + a) + mlp_out)``)."""
        s = self.structure
        if s.block_norm is None:
            return self.block_output(layer, mid + mlp_out)
        carried = self._sub(layer, s.mlp_norm)(self._in(mid)).to(mid.dtype) if s.norm_carried else mid
        x = carried + mlp_out.to(mid.dtype)
        return self.block_output(layer, self._sub(layer, s.block_norm)(self._in(x)).to(x.dtype))

    @block_piece
    def post_attn_norm(self, layer: int, x: Tensor) -> Tensor:
        """The attention branch's post-norm (identity where absent; Inkling's convolution over positions, on rows ``[N,
        d]`` each a sequence of one position: :mod:`~mfpipe.models.adapters.convolved`), times the branch scale."""
        x = on_rows(self._opt_module(layer, self.POST_ATTN_NORM), self._in(x))
        a = self.structure.attn_scales[1]  # the attention's output alone (Falcon-H1's attention_out_multiplier)
        return self._scaled(x if a == 1.0 else x * a).to(x.dtype)

    def _scaled(self, x: Tensor) -> Tensor:  # times a python float, as the block multiplies: to the bit
        return x if self.structure.branch_scale == 1.0 else x * self.structure.branch_scale

    def _attn_scale(self) -> float:
        """The attention branch's factor from the output projection's output to the residual: the branch scale
        (both branches') times the attention output's own (Falcon-H1's)."""
        return self.structure.branch_scale * self.structure.attn_scales[1]

    @block_piece
    def mlp(self, layer: int, x_resid: Tensor) -> Tensor:
        """The MLP branch of the residual it reads (``resid_mid``; parallel: ``resid_in``): norms, MLP, scale."""
        h = self._mlp_proper(layer, self._opt_module(layer, self.MLP_NORM)(self._in(x_resid)))
        return self._scaled(on_rows(self._opt_module(layer, self.POST_MLP_NORM), h)).to(x_resid.dtype)

    def _mlp_proper(self, layer: int, h: Tensor) -> Tensor:
        """The MLP module (or chain of modules: OPT) on its input ``h [..., d]``; a mixture of experts is called on
        ``[1, n, d]`` as the block calls it, so that each row is routed as the model routes a token."""
        if self.MLP is None:  # no MLP in the block (Nemotron-H's attention blocks: mfpipe.models.adapters.forms)
            return torch.zeros_like(h)
        s, shape = self.structure, h.shape
        if s.mlp_sequences:
            h = h.reshape(1, -1, shape[-1])
        if s.mlp_siblings:  # modules on one input, their outputs added (Granite's experts beside its MLP)
            return sum(first_output(self._sub(layer, p)(h)).reshape(h.shape) for p in s.mlp_siblings).reshape(shape)
        for path in s.mlp_chain or (self.MLP,):
            h = self._sub(layer, path)(h, *((torch.zeros_like(h),) if s.mlp_residual else ()))  # BLOOM: its branch
            h = first_output(h)
        return h.reshape(*shape[:-1], h.shape[-1])  # as its input: DBRX's returns [n, 1, d] of [n, d]

    @no_grad
    def final_norm(self, x: Tensor) -> Tensor:
        return self.final_norm_module()(self._in(x)).to(x.dtype)

    @no_grad
    def unembed(self, x: Tensor) -> Tensor:
        """Logits ``[..., V]`` (float32) of residual-stream vectors ``[..., d]``: the final norm, then the LM head
        (``get_output_embeddings``; through the structure's ``head_transform`` where the forward runs one before it:
        ModernBERT-decoder's prediction head), then any final logit transform of the architecture
        (:meth:`_final_logits`).
        The raw logit lens of a vector inserted into the residual stream (App. P). Needs the causal LM."""
        if not self.has_lm_head:
            raise ValueError(f"unembed needs the causal LM, but this adapter wraps the bare {type(self.base).__name__}")
        h = self.final_norm_module()(self._in(x))
        h = module_at(self.model, self.structure.head_transform)(h) if self.structure.head_transform else h
        return self._final_logits(self.model.get_output_embeddings()(h)).float()

    def _final_logits(self, logits: Tensor) -> Tensor:
        """The architecture's final logit transform: Gemma-2's soft-cap, as ``Gemma2ForCausalLM.forward`` applies it."""
        if self.structure.logit_scale != 1.0:  # Cohere's logit_scale, Granite's 1 / logits_scaling
            logits = logits * self.structure.logit_scale
        cap = self.structure.logit_softcap
        return logits if not cap else torch.tanh(logits / cap) * cap
