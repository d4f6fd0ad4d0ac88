"""An output gate between the heads' reads and the output projection: Qwen3-Next's and Qwen3.5's full-attention
layers (the query projection's second half of each head), LFM-3's and Ling's ``bailing_hybrid`` (a projection to one
gate per head), Laguna's (``g_proj``, one gate per head, through a softplus), AXK-2's (``q_gate_proj`` of its query
latent). The attention multiplies each head's
read by an activation (:data:`GATE_ACTIVATIONS`: a sigmoid; Laguna's softplus) of a slice of a projection of its own
input before the output projection::

    o_proj input[..., h, :] = reads[..., h, :] * act(gate[..., h, :]),   reads = probabilities x values

How mfpipe places it, so that the paper's definitions hold as written: a head's read stays probabilities x values (its
P, mu_t and zbar are the attention proper's), and the gate, a factor of the query position, is part of the path from
the read to the residual, as the output projection is:

* the site (:meth:`~mfpipe.models.adapters.site.TracedSite.run`) reads the gate off its source in the forward
  (:meth:`OutputGate.gate_site`) and hands on the reads as the projection's input divided by it; a replaced read goes
  through the model's own gate of its query position, as ``input + (new - reads) * gate`` (:func:`gated_input`),
  which is the model's own input, bit for bit, wherever the read written back is its own;
* the rollout (:mod:`mfpipe.experiments.rollout.algorithm`) computes the gate of each row it rolls out as the model
  computes it of a position's residual (:meth:`OutputGate.read_gate`: the attention-input norm, the source, the
  activation; where the source reads a latent of that input, AXK-2's ``q_gate_proj`` of its query latent, the block's
  own code on the row, read off the source), so a centroid's mean-field read enters the output projection times the
  centroid's own gate;
* the probe (:mod:`~mfpipe.models.adapters.probe`) finds the gate (:func:`gated_layout`) where no value layout gives
  the reads: the one slice of one of the attention's projections (of its input, or of a latent of it: AXK-2's, its
  gates at offset 48 of each head's 80 outputs) and the one activation whose gate, dividing the output projection's
  input, lets one do; and whether the source reads the attention's input itself (``gate_direct``). Nothing is named by
  family: a gate of another slice or source is found alike;
* a head's write to the residual is its read times the gate of its query, then O_h (:func:`gate_reads`): the J-lens
  agreement, the function vectors, the context lens and ``context_deviation(reads="resid")`` take the gate of each
  query position they run over; the statistics' ``zhat`` / ``zbar`` mapped through O_h take the gate of the query
  type's centroid, as the rollout does, and ``mu`` mapped so is refused (a key type has no query gate).

The sigmoid is taken in the source's dtype, as Qwen3-Next and LFM-3 take it (Ling's float32 sigmoid rounds to the
same within the model's dtype); the softplus in float32, then rounded to the source's dtype, as Laguna takes it; on a
float32 model the gate is the forward's to the bit.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import Tensor

from mfpipe.models.adapters.calls import one_token_call, untraced
from mfpipe.models.adapters.capture import module_at
from mfpipe.models.adapters.convolved import position_conv
from mfpipe.models.adapters.normed import reads_factor
from mfpipe.models.adapters.streaming import holds_block

__all__ = ["GATE_ACTIVATIONS", "OutputGate", "gate_fields", "gate_of", "gated_input", "gated_layout", "has_gate",
           "gate_reads"]

# the activations an output gate is found with, by the structure's gate_act: each as its family's attention takes it
GATE_ACTIVATIONS = {
    "sigmoid": torch.sigmoid,  # in the source's dtype (Qwen3-Next, LFM-3)
    "softplus": lambda t: F.softplus(t.float()).to(t.dtype),  # in float32, then the source's dtype (Laguna)
}


def _index(width: int, n: int, chunks: int, offset: int) -> Tensor:
    """The positions of ``n`` gate pre-activations among a projection's ``width`` outputs laid out as ``chunks`` equal
    chunks holding ``n / chunks`` each at ``offset`` (the value layouts' convention, ``probe.chunk_index``)."""
    cw, nw = width // chunks, n // chunks
    return (torch.arange(chunks)[:, None] * cw + offset + torch.arange(nw)[None]).reshape(-1)


def gate_of(out: Tensor, layout: tuple[int, int, int], H: int, dh: int, act: str = "sigmoid",
            bias: Tensor | None = None) -> Tensor:
    """The gate ``[..., H, dh]`` (float32) of the gate source's output ``out [..., W]`` in ``layout`` (n, chunks,
    offset): n = H x dh, one gate per read entry (Qwen3-Next), or n = H, one per head (LFM-3, Laguna), spread over its
    read; plus ``bias [H]``, one per head, where the attention adds one before the activation (Beam's ``gate_bias``);
    through the activation ``act`` (:data:`GATE_ACTIVATIONS`)."""
    n, chunks, offset = layout
    pre = out[..., _index(out.shape[-1], n, chunks, offset).to(out.device)]
    if bias is not None:  # in the source's dtype, as the attention adds it
        b = bias.detach().to(device=pre.device, dtype=pre.dtype)
        pre = pre + (b if n == H else b[:, None].expand(H, dh).reshape(-1))
    g = GATE_ACTIVATIONS[act](pre).float()
    return g[..., None].expand(*g.shape, dh) if n == H and n != H * dh else g.unflatten(-1, (H, dh))


def gated_input(flat: Tensor, new: Tensor, reads: Tensor, gate: Tensor) -> Tensor:
    """The output projection's input ``[B,T,H,dh]`` (float32) where the reads ``reads`` (its own input over the gate)
    are replaced by ``new``: its own input plus the change of the read times the model's own gate. Where ``new`` is
    ``reads`` the change is 0 exactly, and the input the model's own to the bit (``new * gate`` would round)."""
    return flat.view(reads.shape).float() + (new.to(device=flat.device, dtype=torch.float32) - reads) * gate


def gated_layout(seen: dict, attn_mod, out_proj: str, H: int, dh: int, order: list[str], layout) -> dict:
    """``layout(seen)`` (the probe's value layout) and ``gate`` None where it places the values; else ``layout`` of the
    probe's tensors with the output projection's input divided by each candidate gate (a slice of n = H x dh outputs,
    in any chunked layout, of one of the attention's projections that reads its input; n = H of one whose outputs are
    one per head), each through each of :data:`GATE_ACTIVATIONS`, and ``gate`` = (source, layout, whether it runs
    before the value source, activation) of the one candidate with which a layout is found. Without one, the refusal
    of ``layout(seen)``."""
    try:
        return dict(layout(seen), gate=None)
    except ValueError as e:  # UnsupportedArchitectureError (probe.py imports this module: caught by its base)
        refusal = e
    found = {}
    biases = [None] + [n for n, p in attn_mod.named_parameters(recurse=False) if tuple(p.shape) == (H,)]  # Beam's
    for name in (n for n, m in attn_mod.named_children() if n != out_proj and f"<src>{n}" in seen
                 and not position_conv(m)):  # (a convolution of a projection, Inkling's, is no gate's source)
        src = seen[f"<src>{name}"]  # a projection of the attention's input, or of a latent of it (AXK-2's q_gate_proj)
        W = src.y.shape[-1]
        # the gates at any offset of a chunk in steps that fit its other outputs (AXK-2: 48 query, then 32 gate)
        shapes = [(H * dh, c, o) for c in range(1, H + 1) if H % c == 0 and W % c == 0 and W // c >= H * dh // c
                  for o in range(0, W // c - H * dh // c + 1, math.gcd(dh, W // c - H * dh // c) or dh)] + (
            [(H, 1, 0)] if W == H else [])
        for lay, act, bias in ((lay, act, b) for lay in shapes for act in GATE_ACTIVATIONS for b in biases):
            trial = dict(seen)
            g = gate_of(src.y, lay, H, dh, act, None if bias is None else getattr(attn_mod, bias))
            trial["<out_proj>"] = seen["<out_proj>"]._replace(x=seen["<out_proj>"].x / g.flatten(-2))
            try:  # one gate in several layouts (an elementwise one, chunked or not) is one candidate
                found.setdefault((name, tuple(_index(W, *lay).tolist()), act, bias), (name, lay, act, bias,
                                                                                      layout(trial)))
            except ValueError:
                continue
    if len(found) != 1:
        raise refusal
    name, lay, act, bias, out = next(iter(found.values()))
    first = order.index(f"<src>{name}") < order.index(f"<src>{out['value_source']}")
    src_in, attn_in = seen[f"<src>{name}"].x, seen["<attn>"].x  # AXK-2's q_gate_proj reads a latent of the input
    direct = src_in.shape == attn_in.shape and bool(torch.equal(src_in, attn_in))
    return dict(out, gate=(name, lay, first, act, bias, direct))


def has_gate(adapter) -> bool:
    """Whether the attention of ``adapter``'s model gates its heads' reads (the structure's ``output_gate``) or norms
    them all together (``reads_norm``: a factor of each position's reads, :mod:`~mfpipe.models.adapters.normed`)."""
    s = getattr(adapter, "structure", None)
    return getattr(s, "output_gate", None) is not None or getattr(s, "reads_norm", None) is not None


def gate_reads(adapter, layer: int, reads: Tensor, resid: Tensor | None) -> Tensor:
    """A head's read as it enters the output projection: ``reads [..., H, dh]`` times the model's own gate of the query
    rows ``resid [..., d]`` (the residual entering block ``layer`` at those positions; :meth:`OutputGate.read_gate`),
    so ``gate_reads(...)[..., h, :] @ out_proj_slices(layer)[h]`` is head h's write to the residual (a norm of all
    the reads: times the factor of these reads, every head's, :mod:`~mfpipe.models.adapters.normed`). ``reads`` itself
    where the attention has no gate (``resid`` may then be None)."""
    if not has_gate(adapter):
        return reads
    if resid is None and adapter.structure.output_gate is not None:
        raise ValueError(f"layer {layer}: the model's attention gates its reads by the query position's residual, so "
                         "mapping a read to the residual needs the residual entering the block (select 'resid_in')")
    return reads * adapter.read_gate(layer, resid, reads).to(device=reads.device, dtype=reads.dtype)


class _Read(Exception):
    """Ends a block's forward once the gate's source has run (its output is all :func:`_source_output` needs)."""


def _source_output(adapter, layer: int, x: Tensor):
    """The output of block ``layer``'s gate source when the block runs on the rows ``x [..., d]``, each a sequence of
    one position (the arguments the model's forward gives it on one token:
    :func:`~mfpipe.models.adapters.calls.one_token_call`); the forward stops there. Only for a gate whose source does
    not read the attention's input (the structure's ``gate_direct``, the probe's); from inside a trace its caller,
    ``read_gate``, runs it under :func:`~mfpipe.models.adapters.calls.untraced`."""
    block = adapter.block_module(layer)
    seen: dict = {}

    def grab(mod, args, out):
        seen["out"] = out
        raise _Read

    args, kwargs = one_token_call(adapter, layer)  # (a forward of the model: before the hook)
    handle = module_at(block, adapter.structure.output_gate).register_forward_hook(grab)
    d = x.shape[-1]
    try:
        block(adapter._in(x).reshape(-1, 1, d), *args, **kwargs)
    except _Read:
        pass
    finally:
        handle.remove()
    return seen["out"].reshape(*x.shape[:-1], seen["out"].shape[-1])


class OutputGate:
    """Mixin of :class:`~mfpipe.models.adapters.base.Adapter`: the output gate's pieces (the structure's
    ``output_gate``: its source's path from a block, ``gate_layout``, ``gate_first``; none where it has no gate)."""

    @holds_block
    @torch.no_grad()
    def read_gate(self, layer: int, x: Tensor | None, reads: Tensor | None = None) -> Tensor | None:
        """The output gate ``[..., H, dh]`` (float32) of residual rows ``x [..., d]`` entering block ``layer`` (the
        attention-input norm, the gate's source, the activation: as the attention computes it of a position's residual),
        or None where the attention has no gate. A read of a row enters the output projection times it. Where the
        attention norms every head's reads together (``reads_norm``), the factor of the rows' reads ``reads [..., H,
        dh]`` (every head's: :func:`~mfpipe.models.adapters.normed.reads_factor`; ``x`` is not read)."""
        s = self.structure
        if s.reads_norm is not None:
            if reads is None:
                raise ValueError(f"layer {layer}: the model's attention norms every head's reads together before its "
                                 "output projection, so a read's write to the residual needs the reads of its position, "
                                 "every head's (select 'reads')")
            with untraced(self):  # (called from inside a trace: the norm is the traced model's module)
                z = reads.to(self.device).flatten(-2)
                return reads_factor(self._sub(layer, s.reads_norm), z).unflatten(-1, reads.shape[-2:])
        if s.output_gate is None:
            return None
        with untraced(self):  # (called from inside a trace: a query row's gate, the J-lens agreement's...)
            if s.gate_direct:
                h = self.attn_input_norm(layer, x.to(device=self.device))
                out = self._sub(layer, s.output_gate)(self._in(h))
            else:  # a projection of a latent of the input (AXK-2's): the block's own code on each row, off the source
                out = _source_output(self, layer, x)
        return gate_of(out, s.gate_layout, self.n_heads, self.d_head, s.gate_act, self.gate_bias(layer))

    def gate_bias(self, layer: int) -> Tensor | None:
        """The per-head bias the attention of block ``layer`` adds to its gate before the activation (Beam's), or
        None."""
        path = self.structure.gate_bias
        return None if path is None else functools.reduce(getattr, path.split("."), self.block_module(layer))

    def gate_site(self, layer_env, sel: frozenset[str], patch_reads, first: bool, layer: int) -> Tensor | None:
        """Inside the site's trace: the forward's own gate ``[B,T,H,dh]`` (float32) of the block ``layer_env``, read
        off its source where the reads are read or patched and the source runs at this point of the block (``first``:
        before the value source; nnsight reads in forward order), else None."""
        s = self.structure
        if s.output_gate is None or s.gate_first != first or ("reads" not in sel and patch_reads is None):
            return None
        src = module_at(layer_env, s.output_gate)  # its envoy
        return gate_of(src.output, s.gate_layout, self.n_heads, self.d_head, s.gate_act, self.gate_bias(layer))


def gate_fields(gate, attn: str, norm: str | None) -> dict:
    """The :class:`~mfpipe.models.adapters.structure.Structure`'s fields of the probe's ``gate`` (source, layout,
    first, activation, bias, direct) and ``norm``."""
    fields = {} if norm is None else {"reads_norm": f"{attn}.{norm}"}
    return fields if gate is None else fields | dict(output_gate=f"{attn}.{gate[0]}", gate_layout=gate[1],
                                                     gate_first=gate[2], gate_act=gate[3], gate_direct=gate[5],
                                                     gate_bias=gate[4] and f"{attn}.{gate[4]}")
