"""The probe forward of :func:`~mfpipe.models.adapters.structure.describe`: one forward of three tokens through the
decoder stack with hooks on block 0's children, its attention and output projection, the value source's candidates,
the norms outside the blocks, the last block and the token embedding. What each module reads and writes decides what
names and shapes cannot:

* the norms' roles in a block and the residual form (:func:`norm_roles`);
* the MLP: one module, or the chain of block children that hands each one's output to the next (OPT's ``fc1``,
  ``activation_fn``, ``fc2``), and how it is called (a mixture of experts takes ``[B, T, d]`` only);
* the value layout: the one (source, KV heads, chunks, offset) whose values, weighted by the forward's attention
  probabilities, give the output projection's input, the reads (:func:`value_layout`); the source may be a latent
  attention's decompressing projection (:mod:`~mfpipe.models.adapters.latent`), the reads gated (:mod:`~.gate`) or
  normed all heads together (:mod:`~.normed`);
* the final norm among several norms outside the blocks (the one that reads the last block's output) and a norm on
  the embedding (BLOOM's), the embedding's scale and a learned position table's row offset
  (:func:`~mfpipe.models.adapters.residual.embed_scale`); the final logits' scale against the LM head's output is
  :func:`~mfpipe.models.adapters.residual.logit_scale`'s, from a forward of its own.

It also holds what it and :mod:`~mfpipe.models.adapters.structure` need of a module: the refusal of a model that
cannot be placed, the sizes placed by (:class:`Shape`), what kind a module is (:func:`is_norm`, :func:`linear_shape`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor, nn

from mfpipe.models.adapters.asked import reads_ahead
from mfpipe.models.adapters.capture import first_output, path_within
from mfpipe.models.adapters.convolved import conv_watch, position_conv, value_convs
from mfpipe.models.adapters.gate import gated_layout
from mfpipe.models.adapters.linears import attention_linears, canonical_layout, chunk_index, off_linear
from mfpipe.models.adapters.normed import normed_layout
from mfpipe.models.adapters.residual import (PROBE_IDS, attn_adds_residual, block_scales, branch_scale, closed_chain,
                                             closing_modules, embed_scale, input_embedding, mlp_needs_sequences,
                                             mlp_residual, mlp_siblings, post_norm)
from mfpipe.models.adapters.returned import returned_sources, returning_children
from mfpipe.models.adapters.streaming import held

__all__ = ["probe", "probe_forward", "Seen", "norm_roles", "value_layout", "Shape", "UnsupportedArchitectureError",
           "CONFORMANCE_HINT", "is_norm", "linear_shape", "same_within", "submodule"]

CONFORMANCE_HINT = "check a model with `mfpipe conformance MODEL` (docs/architectures.md)"


class UnsupportedArchitectureError(ValueError):
    """The model cannot be placed (the message says what failed); ``kind``: the census's kind of refusal, "modelling"
    where the model has no heads of one probability row each (:mod:`mfpipe.models.census`), else "mfpipe"."""

    def __init__(self, model_type: str | None, reason: str = "no structure mfpipe knows", kind: str = "mfpipe"):
        self.model_type, self.reason, self.kind = model_type, reason, kind
        super().__init__(f"unsupported architecture: model_type={model_type!r}: {reason}; {CONFORMANCE_HINT}")


def is_norm(m: nn.Module) -> bool:
    return isinstance(m, nn.LayerNorm) or "norm" in type(m).__name__.lower()


def linear_shape(m: nn.Module) -> tuple[int, int] | None:
    """(in, out) of an nn.Linear or a transformers Conv1D (weight [in, out]); None for other modules."""
    w = getattr(m, "weight", None)
    if not isinstance(w, Tensor) or w.ndim != 2:
        return None
    if type(m).__name__ == "Conv1D":
        return int(w.shape[0]), int(w.shape[1])
    if isinstance(m, nn.Linear):
        return int(w.shape[1]), int(w.shape[0])
    return None


@dataclass
class Shape:
    """The sizes describe() places by: layers L, heads H, KV heads (the config's), head width dh, width d."""

    L: int
    H: int
    KV: int
    dh: int
    d: int


def submodule(root: nn.Module, path: str) -> nn.Module:
    """``root.a.b`` for ``path`` "a.b" (a trailing or leading dot ignored; "" is ``root``)."""
    obj = root
    for part in path.strip(".").split("."):
        obj = getattr(obj, part) if part else obj
    return obj


class Seen(NamedTuple):
    """What the probe forward saw of one module: its first input and its output ([0] of a tuple) as float32 copies,
    the same two tensors themselves (kept alive: a tensor a module hands on is the very object the next one reads),
    its raw output and its other positional arguments (BLOOM's and MPT's MLP take the residual second)."""

    x: Tensor
    y: Tensor
    x_obj: Tensor
    y_obj: Tensor
    out: object
    args: tuple = ()


def probe(model, base, blocks, attn: str, out_proj: str, outer_norms: list[str], table, shape: Shape, mt,
          named_mlp: str | None, named_value: tuple[str, str] | None, find_latents=None, at=0, forms=None) -> dict:
    """Everything :func:`describe` decides by the probe forward (see the module docstring), as a dict. ``find_latents``:
    :func:`mfpipe.models.adapters.latent.latent_sources`; ``at``: the block placed by (a hybrid's first attention
    block; the embedding is read where block 0 reads it); ``forms``: :func:`~.forms.block_forms`."""
    block = blocks[at]
    attn_mod = submodule(block, attn)
    inside = path_within(out_proj, attn)  # None: beside it (GIT's)
    linears, sources = attention_linears(attn_mod, inside, shape.d)  # a wrapped one too (Moshi's o_proj.linear)
    watch = {n: m for n, m in block.named_children()} | getattr(forms, "watch", {})  # DBRX's wrapped norms (forms)
    closing = closing_modules(block, attn, is_norm)  # BERT's output modules: residual added, the sum normed (GIT's)
    watch.update({p: submodule(block, p) for pair in closing.values() for p in pair})
    watch.update({f"<close>{n}": submodule(block, n) for n in closing})
    emb = input_embedding(model, base)
    watch.update({"<attn>": attn_mod, "<out_proj>": submodule(block, out_proj), "<block>": block,
                  "<first>": blocks[0], "<last>": blocks[-1], "<embed>": emb})
    watch.update({f"<src>{n}": submodule(attn_mod, n) for n in linears})  # latent attention's too (mfpipe...latent)
    watch.update(conv_watch(attn_mod) | returning_children(attn_mod, linears))  # Inkling's v_sconv, Zaya's qkv_proj
    watch.update({f"<anorm>{n}": m for n, m in attn_mod.named_children() if is_norm(m)})
    watch.update({f"<outer>{n}": submodule(base, n) for n in outer_norms})  # paths from the base model
    seen, order = probe_forward(model, base, watch)
    if "<attn>" not in seen or "<block>" not in seen:
        raise UnsupportedArchitectureError(mt, "a probe forward did not run its first block's attention")
    if reads_ahead(seen["<attn>"].out):
        raise UnsupportedArchitectureError(mt, "its attention reads later positions (an encoder; a BERT-style decoder "
                                               "without is_decoder=True): mfpipe reads causal decoders", "modelling")
    same = same_within(emb.weight.dtype)
    extra = forms(seen, same) if forms else {}  # no MLP, a mixer beside the attention (mfpipe.models.adapters.forms)
    chain = [named_mlp] if named_mlp else _mlp_chain(seen, order, block, attn.split(".")[0], mt)
    chain = closed_chain(seen, closing, chain)  # an MLP whose last module adds the residual and norms the sum (GIT's)
    if chain[0] not in seen or chain[-1] not in seen:
        raise UnsupportedArchitectureError(mt, "a probe forward did not run its first block's MLP")
    first, last = seen[chain[0]], seen[chain[-1]]
    with held(block):  # called outside a forward: a streamed block's weights are read for it
        residual = mlp_residual(block, chain, last, same)
    # the MLP's branch: its output, less the residual it adds itself where it does (BLOOM, MPT), plus the outputs of
    # modules beside it reading its input where the block adds them (Granite's mixture of experts beside its MLP)
    own = last.y if residual is None else last.y - residual.float()
    siblings = [] if residual is not None else mlp_siblings(seen, order, block, chain, lambda n, m: n == attn.split(
        ".")[0] or is_norm(m) or position_conv(m), same)
    branch = own + sum(seen[n].y for n in siblings)
    seen["<mlp>"] = Seen(first.x, branch, first.x_obj, last.y_obj if residual is None and not siblings else branch,
                         last.out)
    attn_residual = attn_adds_residual(seen, same)
    if attn_residual or inside is None:  # BLOOM: the attention returns block input + branch; GIT's projection sits
        # beside the attention proper, which returns the reads: the branch is the output projection's output
        seen["<attn>"] = seen["<attn>"]._replace(y=seen["<out_proj>"].y, y_obj=seen["<out_proj>"].y_obj)
    final_norm, embed_norm = _outer_norms(seen, outer_norms, mt)
    norms = [n for n, m in watch.items() if n[:1] != "<" and n != attn.split(".")[0] and n in seen
             and (is_norm(m) or position_conv(m))]  # a branch's convolution over positions: its post-norm's role
    scales = block_scales(block)  # a block's own branch scale
    out = dict(final_norm=final_norm, embed_norm=embed_norm, mlp_chain=chain,
               mlp_siblings=tuple(n for n in order if n in {*chain, *siblings}) if siblings else (),
               attn_residual=attn_residual, mlp_residual=residual is not None,
               roles=norm_roles(seen, norms, "<attn>", "<mlp>", same, mt, scales))
    if (attn_residual or inside is None) and out["roles"]["post_attn_norm"]:
        raise UnsupportedArchitectureError(mt, "its attention's branch is its output projection's output, and a norm "
                                               "of the branch alone follows it")
    scaled = embed_scale(base, seen, table, embed_norm, same)
    if isinstance(scaled, str):
        raise UnsupportedArchitectureError(mt, scaled)
    out["embed_scale"], out["position_row_offset"], out["embed_affine"] = scaled
    latents = find_latents(seen, attn_mod, inside, shape.d, same) if find_latents else {}
    with held(block):  # (a norm of the reads is run on the probe's reads: a streamed block's weights read for it)
        out.update(normed_layout(seen, attn_mod, same, lambda t: gated_layout(  # an output gate, a norm of the reads
            t, attn_mod, inside, shape.H, shape.dh, order,
            lambda s: value_layout(s, [*sources, *returned_sources(s, shape.dh)], named_value, shape, mt,
                                   emb.weight.dtype, latents, value_convs(s, attn_mod, sources)))))
        # the maps mfpipe takes them for: not a quantized layer's (BitNet's AutoBitLinear: its input quantized)
        odd = off_linear(seen, block, {out_proj: "<out_proj>", f"{attn}.{out['value_source']}":
                                       f"<src>{out['value_source']}"}, same)
    if odd:
        raise UnsupportedArchitectureError(mt, f"its projection {odd} is not the linear map of its weight (a quantized "
                                               "layer); use a full-precision (dequantized) checkpoint")
    out["mlp_tuple"] = isinstance(last.out, tuple)
    out["mlp_sequences"] = any(mlp_needs_sequences(blocks, block, c, first.x, w, same, residual is not None)
                               for c, w in [(chain, own), *(([n], seen[n].y) for n in siblings)])
    return out | extra


def probe_forward(model, base, watch: dict[str, nn.Module]) -> tuple[dict[str, Seen], list[str]]:
    """One forward of three tokens with a hook on every module of ``watch`` -> (name -> :class:`Seen`, the names in
    call order)."""
    seen: dict[str, Seen] = {}
    order: list[str] = []
    handles = []

    def hook(name):
        def fn(mod, args, kwargs, out):
            x = args[0] if args else kwargs.get("hidden_states", kwargs.get("input"))
            y = first_output(out)  # GPT-1's blocks return a list
            if name not in seen and isinstance(x, Tensor) and isinstance(y, Tensor):
                seen[name] = Seen(x.detach().float().clone(), y.detach().float().clone(), x, y, out, tuple(args[1:]))
                order.append(name)
        return fn

    for name, m in watch.items():
        handles.append(m.register_forward_hook(hook(name), with_kwargs=True))
    emb = input_embedding(model, base)
    vocab = int(getattr(model.config, "vocab_size", 3) or 3)
    try:
        with torch.no_grad():
            base((PROBE_IDS % vocab)[None].to(emb.weight.device), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return seen, order


def same_within(dtype: torch.dtype):
    """``same(a, b)``: equal up to the rounding of the model's dtype (a bfloat16 block adds its branches in
    bfloat16)."""
    eps = max(1e-6, 4 * torch.finfo(dtype).eps) if dtype.is_floating_point else 1e-6

    def same(a, b):
        # equal shapes, or the same rows flattened (OPT runs its MLP on [B * T, d])
        if a.shape != b.shape and (a.numel() != b.numel() or a.shape[-1] != b.shape[-1]):
            return False
        a = a.reshape(b.shape)
        return torch.allclose(a, b, rtol=10 * eps, atol=eps * float(b.abs().max().clamp_min(1)))

    return same


def _mlp_chain(seen: dict, order: list[str], block: nn.Module, attn_top: str, mt) -> list[str]:
    """The block children (not the attention, not a norm) the forward ran, in call order, less parameter-free ones
    at either end (dropouts): one module, or a chain in which each reads what the one before wrote (OPT)."""
    kids = dict(block.named_children())
    ran = [n for n in order if n in kids and n != attn_top and not is_norm(kids[n]) and not position_conv(kids[n])]
    joins = [n for n in ran if _joins(seen[n])]  # handed a branch and the residual (Zaya's residual scaling)
    ran = [n for n in ran if n not in joins] if 0 < len(joins) < len(ran) else ran  # joins: run by the block
    while ran and not any(True for _ in kids[ran[0]].parameters()):
        ran.pop(0)
    while ran and not any(True for _ in kids[ran[-1]].parameters()):
        ran.pop()
    if not ran:
        raise UnsupportedArchitectureError(mt, "cannot place one MLP module in a block: none")
    for a, b in zip(ran, ran[1:]):
        if not (seen[b].x_obj is seen[a].y_obj or torch.equal(seen[b].x, seen[a].y)):
            raise UnsupportedArchitectureError(mt, f"cannot place one MLP module in a block: {len(ran)} candidates "
                                                   f"({', '.join(ran)}) that are no chain")
    return ran


def _joins(seen_one) -> bool:
    """Whether a module was called with two tensors of the residual's shape (a branch and the residual it joins)."""
    r = seen_one.args[0] if seen_one.args else None
    return isinstance(r, Tensor) and tuple(r.shape) == tuple(seen_one.x.shape) and r is not seen_one.x_obj


def _outer_norms(seen: dict, outer: list[str], mt) -> tuple[str, str | None]:
    """(the final norm, a norm on the embedding or None) among the norms outside the blocks: with one, it is the
    final norm; with more, the final norm reads the last block's output, an embedding norm the embedding's. A norm of
    another width is of neither (Gemma-4's of its per-layer token inputs, ``per_layer_projection_norm``)."""
    d = seen["<last>"].y.shape[-1]
    outer = [n for n in outer if f"<outer>{n}" not in seen or seen[f"<outer>{n}"].x.shape[-1] == d]
    if not outer:  # no final norm: the LM head reads the last block's output
        return None, None
    if len(outer) == 1:  # NanoChat's one norm also reads the embedding, first: the final norm and the embedding's
        seen_one = seen.get(f"<outer>{outer[0]}")  # (GIT's reads it plus positions, added in place: not as it was)
        if seen_one is not None and seen_one.x_obj is seen["<embed>"].y_obj and torch.equal(seen_one.x, seen[
                "<embed>"].y):
            return outer[0], outer[0]
        first = seen.get("<first>")
        if seen_one is not None and first is not None and seen_one.y_obj is first.x_obj:
            return None, outer[0]  # block 0 reads it (TrOCR's of the embedding plus positions), no final norm
        return outer[0], None
    last_out, emb_out = seen["<last>"].y_obj, seen["<embed>"].y_obj
    final = [n for n in outer if f"<outer>{n}" in seen and seen[f"<outer>{n}"].x_obj is last_out]
    embn = [n for n in outer if f"<outer>{n}" in seen and seen[f"<outer>{n}"].x_obj is emb_out]
    if len(final) != 1 or len(embn) > 1 or len(final) + len(embn) != len(outer):
        raise UnsupportedArchitectureError(mt, f"cannot place the final norm: {len(outer)} candidates "
                                               f"({', '.join(outer)})")
    return final[0], embn[0] if embn else None


def norm_roles(seen: dict, norms: list[str], attn: str, mlp: str, same, mt, scales=()) -> dict:
    """The probed ``norms``' roles around the attention ``attn`` and the MLP ``mlp`` and the residual form
    (``parallel``: the MLP reads the block input; ``branch_scale``: the attention branch enters the residual times
    this, one of ``scales`` where one is it exactly: MiniCPM-3) from the probe forward's tensors
    (:func:`probe_forward`)."""
    block_in = seen["<block>"].x
    attn_in, attn_out = seen[attn].x, seen[attn].y
    mlp_in, mlp_out = seen[mlp].x, seen[mlp].y

    def role(pick, what, obj_pick=None):
        # the tensor a module hands on is the very object the next one reads: that decides first (two norms of
        # equal weights, as at initialisation, give equal values); equal values (up to the dtype) otherwise
        hits = [n for n in norms if obj_pick(seen[n].x_obj, seen[n].y_obj)] if obj_pick else []
        hits = hits or [n for n in norms if pick(seen[n].x, seen[n].y)]
        if len(hits) > 1:
            raise UnsupportedArchitectureError(mt, f"{len(hits)} norms could be its {what}: {', '.join(hits)}")
        return hits[0] if hits else None

    attn_in_obj, attn_out_obj = seen[attn].x_obj, seen[attn].y_obj
    mlp_in_obj, mlp_out_obj = seen[mlp].x_obj, seen[mlp].y_obj
    attn_norm = role(lambda x, y: same(y, attn_in), "pre-attention norm", lambda x, y: y is attn_in_obj)
    if attn_norm is None and not same(attn_in, block_in):
        raise UnsupportedArchitectureError(mt, "its attention reads neither the block input nor a norm of it")
    post_attn_norm = role(lambda x, y: same(x, attn_out), "post-attention norm", lambda x, y: x is attn_out_obj)
    post_mlp_norm = role(lambda x, y: same(x, mlp_out), "post-MLP norm", lambda x, y: x is mlp_out_obj)
    mlp_norm = role(lambda x, y: same(y, mlp_in) and not same(y, attn_in), "pre-MLP norm",
                    lambda x, y: y is mlp_in_obj and y is not attn_in_obj)
    attn_branch = seen[post_attn_norm].y if post_attn_norm else attn_out
    if mlp_norm is None and attn_norm is not None and same(mlp_in, attn_in):
        mlp_norm, mlp_reads = attn_norm, block_in  # the MLP shares the attention's norm: it reads the block input
    else:
        mlp_reads = seen[mlp_norm].x if mlp_norm else mlp_in
    scale, join = 1.0, "sum"
    if same(mlp_reads, block_in):
        parallel = True
    elif same(mlp_reads, block_in + attn_branch):
        parallel = False
    else:
        parallel, scale = False, branch_scale(mlp_reads - block_in, attn_branch, scales)
        if scale is None or not same(mlp_reads, block_in + scale * attn_branch):
            # a join of its own (Doge's a ⊙ x + attn, Beam's depth-scaled sums...): the block's code runs it
            # (mfpipe.models.adapters.joins; describe checks that it is one of each position's own tensors)
            scale, join = 1.0, "model"
    unplaced = [n for n in norms if n not in (attn_norm, post_attn_norm, mlp_norm, post_mlp_norm)]
    block_norm, carried = post_norm(seen, unplaced, mlp_norm, mlp_reads, parallel, same) if join == "sum" \
        else (None, False)
    join = "model" if block_norm is False else join  # a closing norm of another form: the block runs it too
    unplaced = [n for n in unplaced if n != block_norm]
    if unplaced and join == "sum":  # a piece of the block's own beside its branches (Gemma-4's per-layer input of
        join = "model"  # each token, with its norm post_per_layer_input_norm): the block runs it too
    return dict(attn_norm=attn_norm, post_attn_norm=post_attn_norm, mlp_norm=mlp_norm, post_mlp_norm=post_mlp_norm,
                parallel=parallel, branch_scale=scale, block_norm=block_norm or None, norm_carried=carried, join=join)


def value_layout(seen: dict, sources: list[str], named: tuple[str, str] | None, shape: Shape, mt,
                 dtype: torch.dtype = torch.float32, latents: dict | None = None, convs: dict | None = None) -> dict:
    """The value source and layout: the one named (:func:`~mfpipe.models.adapters.structure._value_by_name`) where
    its values reproduce the reads, else the one (source, KV heads, chunks, offset) among all chunked layouts of the
    attention's projections from the width d, and of the latent ones (``latents``: name -> where it reads,
    :mod:`~mfpipe.models.adapters.latent`), that does; ``latent`` says where the source reads (None: the norm's output).
    A layout that is one of the named ones keeps its name (a latent source's stays chunked). ``convs``: a position
    convolution of the attention -> the projection it reads (:func:`~.convolved.value_convs`), tried as a source of
    values only (a split layout: the value map convolves all of its outputs)."""
    latents, convs = latents or {}, convs or {}
    attn_out = seen["<attn>"].out
    probs = attn_out[1] if isinstance(attn_out, (tuple, list)) and len(attn_out) > 1 else None
    if not isinstance(probs, Tensor) or "<out_proj>" not in seen:
        raise UnsupportedArchitectureError(mt, "its attention returns no probabilities under eager attention")
    probs, reads = probs.detach().double(), seen["<out_proj>"].x.double()
    H, dh = shape.H, shape.dh
    # a wrong layout misses by the size of the reads themselves; the right one by the model dtype's rounding
    tol = max(1e-4, 20 * torch.finfo(dtype).eps) if dtype.is_floating_point else 1e-4

    def fits(src: str, kv: int, index: Tensor) -> bool:
        y = seen[f"<src>{src}"].y  # [1, T, W]; a latent source's [1, 1, T, W]
        v = y.reshape(1, -1, y.shape[-1]).double()[..., index]  # [1, T, kv * dh]
        v = v.unflatten(-1, (kv, dh)).transpose(1, 2).repeat_interleave(H // kv, dim=1)  # [1, H, T, dh]
        got = torch.einsum("bhqk,bhkd->bqhd", probs, v).flatten(-2)
        return got.shape == reads.shape and float((got - reads).norm()) <= tol * float(reads.norm().clamp_min(1e-30))

    if named is not None:
        n, lay = named
        kv = {"split": shape.KV, "qkv": shape.KV, "neox": H}[lay]
        chunks, offset = {"split": (1, 0), "qkv": (1, (H + shape.KV) * dh), "neox": (H, 2 * dh)}[lay]
        if f"<src>{n}" in seen and fits(n, kv, chunk_index(seen[f"<src>{n}"].y.shape[-1], kv * dh, chunks, offset)):
            return dict(value_source=n, value_layout=lay, kv_heads=None, value_chunks=1, value_offset=0, latent=None)
    found = {}
    for n in [*sources, *latents, *convs]:
        if f"<src>{n}" not in seen:
            continue
        W = seen[f"<src>{n}"].y.shape[-1]
        for kv in (k for k in range(1, H + 1) if H % k == 0 and (n not in convs or W == k * dh)):  # convolved: split
            for chunks in (c for c in range(1, kv + 1) if kv % c == 0 and W % c == 0):
                # a latent source's values sit after each head's key part, whose width need not be a multiple of dh
                rest = W // chunks - kv * dh // chunks
                for offset in range(0, rest + 1, (math.gcd(dh, rest) or dh) if n in latents else dh):
                    index = chunk_index(W, kv * dh, chunks, offset)
                    if fits(n, kv, index):
                        found.setdefault((n, kv, tuple(index.tolist())), (chunks, offset))
    if len(found) != 1:
        why = "none" if not found else f"{len(found)} candidates"
        raise UnsupportedArchitectureError(mt, f"cannot place the value projection (a projection whose outputs, in any "
                                               f"chunked layout, give the attention's reads): {why}")
    (n, kv, _), (chunks, offset) = next(iter(found.items()))
    W = seen[f"<src>{n}"].y.shape[-1]
    lay = "chunked" if n in latents else canonical_layout(W, kv, chunks, offset, shape.H, shape.dh)
    return dict(value_source=convs.get(n, n), value_layout=lay, kv_heads=None if kv == shape.KV else kv,
                value_chunks=chunks if lay == "chunked" else 1, value_offset=offset if lay == "chunked" else 0,
                latent=latents.get(n), value_conv=n if n in convs else None)

