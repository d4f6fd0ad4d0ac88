"""The value maps of an :class:`~mfpipe.models.adapters.base.Adapter` (mixed in): where each head's values come out of
the value source (split, fused ``qkv``, GPT-NeoX's per-head layout, a chunked one, latent attention's), as the site
reads them off the source's output (``_values_from_src``) and as block pieces of the residual stream
(:meth:`ValueMaps.value_map`; :meth:`ValueMaps.value_weights`, the value projection as an affine map of the
attention-input norm's output, where it is one), each layer's own where the layers differ (each head's width, KV
heads and value source: :mod:`~mfpipe.models.adapters.layers`), zero-padded to the widest layer's width.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from mfpipe.models.adapters.convolved import on_rows
from mfpipe.models.adapters.forms import value_form
from mfpipe.models.adapters.latent import Latent, latent_input
from mfpipe.models.adapters.returned import returned_values, run_source, split_source
from mfpipe.models.adapters.layers import FORM_LAYOUTS, LayerForm, pad_heads
from mfpipe.models.adapters.linears import chunk_index
from mfpipe.models.adapters.streaming import holds_block

__all__ = ["ValueMaps", "block_piece", "no_grad"]


def no_grad(fn):  # torch's decorator: each call runs without autograd
    return torch.no_grad()(fn)


def block_piece(fn):
    """A block piece ``(self, layer, ...)``: under no_grad, block ``layer`` held (a streamed block's weights read)."""
    return holds_block(no_grad(fn))


class ValueMaps:
    """Mixin of :class:`~mfpipe.models.adapters.base.Adapter`: its value layouts and value maps. Uses the adapter's
    shapes (``n_heads``, ``n_kv_heads``, ``d_head``, ``d_model``, ``n_rep``), ``structure``, ``V_SRC`` and its module
    access (``_block``, ``_sub``, ``_opt_module``, ``_in``)."""

    def _place_values(self) -> None:
        """The value source's layout and each layer's form (adapters.layers), once per adapter (``__init__``): where
        the layers differ, ``d_head`` is the widest layer's width and ``n_kv_heads`` the most KV heads of a layer."""
        s = self.structure
        forms = tuple(s.layer_forms)
        ragged_gate = (s.output_gate or s.reads_norm) and len({f.head_dim for f in forms}) > 1  # one gate width
        if forms and (len(forms) != self.n_layers or s.value_layout not in FORM_LAYOUTS or ragged_gate):
            raise ValueError(f"{self.model_type}: per-layer attention forms need one per layer ({len(forms)} for "
                             f"{self.n_layers}), a value projection of their own or a chunked one ({FORM_LAYOUTS}, "
                             f"not {s.value_layout}) and, with an output gate, heads of one width")
        latent = None if s.latent_proj is None else Latent(s.latent_proj, s.latent_offset, s.latent_width,
                                                           s.latent_norm, s.latent_scale)
        self._forms = forms or (LayerForm(self.d_head, self.n_kv_heads, self.V_SRC, s.value_layout, s.value_chunks,
                                          s.value_offset, latent),) * self.n_layers
        bad = sorted({f.kv_heads for f in self._forms if self.n_heads % f.kv_heads})
        if bad:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of the KV heads {bad} of a layer")
        self.d_head = max(f.head_dim for f in self._forms)
        self.n_kv_heads = max(f.kv_heads for f in self._forms)
        # where the values sit among the value source's outputs: [q | k | v] fused, after H + KV heads of q and k
        self._v_offset = (self.n_heads + self.n_kv_heads) * self.d_head if s.value_layout == "qkv" else 0
        # "chunked": each layer's values' positions among its source's outputs (one per form: each kind's own)
        at = {}
        for l in self.attention_layers:
            f = self._forms[l]
            if f.value_layout == "chunked" and f not in at:
                src = self._sub(l, f.value_source)
                width = src.weight.shape[1] if self._conv1d(src) else src.weight.shape[0]
                at[f] = chunk_index(int(width), f.kv_heads * f.head_dim, f.value_chunks, f.value_offset)
        self._v_index = [at.get(f) for f in self._forms]
        self._latents = any(f.latent is not None for f in self._forms)

    def head_dim(self, layer: int) -> int:
        """Each head's value and read width in layer ``layer`` (``d_head`` but where the layers differ: the site and
        the block pieces pad it with zeros to ``d_head``, :mod:`~mfpipe.models.adapters.layers`)."""
        return self._forms[layer].head_dim

    def kv_heads(self, layer: int) -> int:
        """The KV heads of layer ``layer`` (``n_kv_heads`` but where the layers differ)."""
        return self._forms[layer].kv_heads

    def _returned(self, layer: int) -> int | None:
        """Which of its value source's outputs holds the values (Zaya's ``qkv_proj#2``: adapters.returned); None
        where the output is them."""
        return split_source(self._forms[layer].value_source)[1]

    def value_path(self, layer: int) -> str:
        """The value source of block ``layer`` (a path from the block)."""
        return split_source(self._forms[layer].value_source)[0]

    def values_read_at(self, layer: int) -> str:
        """Where the site reads block ``layer``'s values: its value source, or the convolution over positions of the
        source's output that the heads read (Inkling's ``v_sconv``: :mod:`~mfpipe.models.adapters.convolved`)."""
        return self.structure.value_conv or self.value_path(layer)

    # ------------------------------------------------------------------ layouts
    def _conv1d(self, m: nn.Module) -> bool:
        return type(m).__name__ == "Conv1D"  # transformers' GPT-2 projection: weight [d_in, d_out]

    def _expand_kv(self, v: Tensor, dim: int, layer: int | None = None) -> Tensor:
        rep = self.n_rep if layer is None else self.n_heads // self.kv_heads(layer)
        return v.repeat_interleave(rep, dim=dim) if rep > 1 else v

    def _values_from_src(self, src_out: Tensor, layer: int) -> Tensor:
        """[B,T,*] output of layer ``layer``'s value source (latent attention's: [B,1,T,*]) -> values [B,H,T,d_head]
        (GQA expanded, zero-padded to ``d_head``)."""
        if self._returned(layer) is not None:  # one of the module's outputs, [B, T, KV, dh] (adapters.returned)
            src_out = returned_values(src_out, self._returned(layer))
        B, T, src_out = src_out.shape[0], src_out.shape[-2], value_form(self.structure, src_out)  # clip, scale
        if self.structure.value_layout == "neox":  # per head [q | k | v], as HF: [B,H,T,3dh]
            qkv = src_out.view(B, T, self.n_heads, 3 * self.d_head).transpose(1, 2)
            return qkv[..., 2 * self.d_head :]
        KV, dh = self.kv_heads(layer), self.head_dim(layer)
        if self._v_offset:
            src_out = src_out[..., self._v_offset : self._v_offset + KV * dh]
        elif self._v_index[layer] is not None:
            src_out = src_out.index_select(-1, self._v_index[layer].to(src_out.device))
        v = src_out.reshape(B, T, KV, dh).transpose(1, 2)  # [B,KV,T,dh] (a value norm's: values_from_norm)
        return pad_heads(self._expand_kv(v, 1, layer), self.d_head)

    def _value_normed(self, layer: int, v: Tensor) -> Tensor:
        """Values ``[..., KV, dh]`` through the layer's value norm where it has one (Gemma-4's ``v_norm``: the model's
        own module on the model's own tensor, so to the bit), else ``v``."""
        path = self.structure.value_norm
        return v if path is None else self._sub(layer, path)(v)

    def values_from_norm(self, norm_out: Tensor, layer: int) -> Tensor:
        """[B,T,KV,dh] output of layer ``layer``'s value norm (``structure.value_norm``: what the heads read) -> values
        [B,H,T,d_head] (GQA expanded, zero-padded to ``d_head``): the site reads them there."""
        return pad_heads(self._expand_kv(norm_out.transpose(1, 2), 1, layer), self.d_head)

    # ------------------------------------------------------------------ block pieces
    @block_piece
    def value_map(self, layer: int, x: Tensor) -> Tensor:
        """v(x): residual stream ``[..., d]`` -> per-head values ``[..., H, d_head]`` (incl. the pre-attention
        norm and the value bias; GQA KV heads expanded to query heads; latent attention's latent norm on the way;
        zero-padded where the layer's heads are narrower, :mod:`~mfpipe.models.adapters.layers`)."""
        h = self._opt_module(layer, self.ATTN_NORM)(self._in(x))
        m = self.structure.attn_scales[0]  # the attention reads its norm's output times this (Falcon-H1's)
        h = latent_input(self._block(layer), self._forms[layer].latent, h if m == 1.0 else h * m)
        src = self._sub(layer, self.value_path(layer))
        H, KV, dh, d = self.n_heads, self.kv_heads(layer), self.head_dim(layer), self.d_model
        if self.structure.value_layout == "neox":  # rows laid out per head [H, (q|k|v), dh]
            w = src.weight.view(H, 3, dh, d)[:, 2].reshape(H * dh, d)
            b = None if src.bias is None else src.bias.view(H, 3, dh)[:, 2].reshape(H * dh)
            return nn.functional.linear(h, w, b).unflatten(-1, (H, dh)).to(x.dtype)
        if self._v_index[layer] is not None:  # chunked (Falcon, CodeGen): the value rows gathered
            idx = self._v_index[layer].to(src.weight.device)
            if self._conv1d(src):
                v = h @ src.weight[:, idx] + (0 if src.bias is None else src.bias[idx])
            else:
                v = nn.functional.linear(h, src.weight[idx], None if src.bias is None else src.bias[idx])
        elif self._v_offset and self._conv1d(src):  # GPT-2's Conv1D: weight [d, (q|k|v)]
            o, n = self._v_offset, KV * dh
            v = torch.addmm(src.bias[o : o + n], h.reshape(-1, d), src.weight[:, o : o + n])
            v = v.view(*h.shape[:-1], n)
        elif self._v_offset:  # one nn.Linear [(q|k|v), d] (Phi-3)
            o, n = self._v_offset, KV * dh
            v = nn.functional.linear(h, src.weight[o : o + n], None if src.bias is None else src.bias[o : o + n])
        elif self._returned(layer) is not None:  # the module that returns them runs (adapters.returned)
            v = run_source(src, h, self._returned(layer))
        else:
            v = src(h)
        if self.structure.value_conv is not None:  # over a sequence's positions; a row: a sequence of one position
            v = on_rows(self._sub(layer, self.structure.value_conv), v)
        v = self._expand_kv(self._value_normed(layer, value_form(self.structure, v).unflatten(-1, (KV, dh))), -2, layer)
        return pad_heads(v, self.d_head).to(x.dtype)

    @block_piece
    def value_weights(self, layer: int) -> tuple[Tensor, Tensor | None] | None:
        """``(W [H, d, dh], b [H, dh] or None)``: the value projection as an affine map of the attention-input norm's
        output ``h = attn_input_norm(layer, x)``, ``values[..., k, :] = h @ W[k] + b[k]`` (GQA KV heads expanded),
        ``value_map(layer, x)`` as that map of the norm; it maps a sum of ``h`` over n positions to the sum of their
        values, ``(sum h) @ W + n b`` (the statistics pass derives its value sums so); values scaled by a constant
        (MiMo-V2-Flash's) have ``W`` and ``b`` scaled. None for latent attention (a norm sits between), a hybrid,
        clamped values (DBRX's), normed ones (Gemma-4's ``v_norm``), convolved ones (Inkling's, over positions) and
        those a module returns (Zaya's, half of them the previous position's: adapters.returned): the pass then sums
        the values as read."""
        s = self.structure
        if (self._latents or self.hybrid or s.value_clip is not None or s.value_norm is not None or s.value_conv
                or self._returned(layer) is not None):
            return None
        src = self._sub(layer, self.value_path(layer))
        H, KV, dh, d = self.n_heads, self.kv_heads(layer), self.head_dim(layer), self.d_model
        wt, bias = src.weight.detach(), None if src.bias is None else src.bias.detach()
        if self.structure.value_layout == "neox":
            w = wt.view(H, 3, dh, d)[:, 2].transpose(1, 2)
            return w, None if bias is None else bias.view(H, 3, dh)[:, 2]
        o, n = self._v_offset, KV * dh
        if self._v_index[layer] is not None:  # chunked: the value rows gathered, as a split projection
            idx = self._v_index[layer].to(wt.device)
            wt = wt[:, idx] if self._conv1d(src) else wt[idx]
            bias = None if bias is None else bias[idx]
            o = 0
        if self._conv1d(src):  # [d, (q|k|v)] -> [KV, d, dh]
            w = wt[:, o : o + n].reshape(d, KV, dh).transpose(0, 1)
        else:  # nn.Linear: [KV*dh, d] -> [KV, d, dh]
            w = wt[o : o + n].view(KV, dh, -1).transpose(1, 2)
        b = None if bias is None else bias[o : o + n].view(KV, dh)
        w, b = self._expand_kv(w, 0, layer), None if b is None else self._expand_kv(b, 0, layer)
        c = self.structure.value_scale  # MiMo-V2-Flash's v_scale: (W s, b s), equal to rounding (derived sums only)
        w, b = (w, b) if c == 1.0 else (w * c, None if b is None else b * c)
        return pad_heads(w, self.d_head), None if b is None else pad_heads(b, self.d_head)
