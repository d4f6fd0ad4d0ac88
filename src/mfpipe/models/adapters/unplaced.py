"""Why a decoder cannot be placed, said precisely: :func:`explain` re-reads a refusal of
:func:`~mfpipe.models.adapters.structure.describe` that names only what it did not find ("cannot place the value
projection: none") and, by a forward of the probe's tokens with hooks on its modules, names what stands
between its heads and mfpipe's reading of them (each head's read = its probability row times its values, the
output projection's input):

* differential attention (DiffLlama: each head reads ``(softmax_1 - λ softmax_2) V``, normalised per head): no head
  has one probability row -- a refusal of the ``modelling`` kind (:mod:`mfpipe.models.census`);
* a norm between the reads and the output projection (BitNet's ``attn_sub_norm`` over all heads' reads together);
* the reads equal to the probability-weighted values times a constant (MiMo-V2-Flash's ``attention_value_scale``),
  times a factor per position and head in (0, 1) that the returned probabilities leave out (a sink of another
  form than ``sigmoid(logsumexp(scores) - sink)``, which is placed: :mod:`~.sinks`), or times a gate -- a sigmoid
  or softplus of a projection, per head or per channel (AX-K2's gate half of a fused projection of another input;
  where the projection reads the attention's input, as AFMoE's ``gate_proj``, Dots3's and Laguna's ``g_proj``,
  Qwen3-Next's gated attention output, :mod:`~.gate` places it and the refusal says what else stands in the way);
* heads routed per token (JetMoE's mixture of attention heads: no projection from ``H x dh`` to ``d`` of its own);
* a block that keeps no residual stream mfpipe reads: several streams (Gemma-3n's AltUp, hyper-connections,
  Reformer's reversible halves, Inkling-2's attention residuals over earlier blocks' residuals), a norm of the residual
  at its end inside a module that adds the residual itself, of a form the placement does not find (post-norm: GPT-1's,
  TrOCR's and GIT's are placed), the attention's output passed through another module before the residual (Inkling's
  short convolutions over positions are placed: :mod:`~mfpipe.models.adapters.convolved`) (a residual scaled or
  renormalised by the block is run by the block's own code: :mod:`~mfpipe.models.adapters.joins`);
* an LM head that reads the final norm's output through more than one module (ModernBERT-decoder's one prediction
  head is placed: :func:`~mfpipe.models.adapters.residual.head_transform`).

Each test compares tensors of the forward (the probabilities the attention returns, what its projections write, the
output projection's input, what the block's modules read and write) up to float32 rounding; where none explains
what failed, the refusal stays as :func:`describe` gave it. The census (:mod:`mfpipe.models.census`) calls it on each
refusal.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mfpipe.models.adapters.convolved import position_conv
from mfpipe.models.adapters.linears import linear_paths
from mfpipe.models.adapters.structure import base_model, blocks

__all__ = ["explain"]

_TOL = 1e-4  # relative: a float32 tiny model's rounding is ~1e-6; a wrong relation misses by the reads' size
_IDS = torch.arange(3) * 7 + 1


def _forward(model, base, watch: dict[str, nn.Module], whole: bool = False) -> dict[str, tuple]:
    """One forward of the probe's tokens (through the base model; the causal LM where ``whole``) with a hook on each
    module of ``watch``: name -> (input, output, raw output, its other positional arguments) of its first call."""
    seen, handles = {}, []

    def hook(name):
        def fn(mod, args, kwargs, out):
            x = args[0] if args else kwargs.get("hidden_states")
            y = out[0] if isinstance(out, (tuple, list)) else getattr(out, "last_hidden_state", out)
            if name not in seen and isinstance(x, Tensor) and isinstance(y, Tensor):
                seen[name] = (x, y, out, tuple(args[1:]))
        return fn

    for n, m in watch.items():
        handles.append(m.register_forward_hook(hook(n), with_kwargs=True))
    emb = base.get_input_embeddings()
    vocab = int(getattr(model.config, "vocab_size", 3) or 3)
    try:
        with torch.no_grad():
            (model if whole else base)((_IDS % vocab)[None].to(emb.weight.device), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return seen


def _same(a: Tensor, b: Tensor) -> bool:  # one tensor, or a view of it (the LM head reads a slice of positions)
    return a.shape == b.shape and torch.equal(a, b)


def _norm(m: nn.Module) -> bool:
    return isinstance(m, nn.LayerNorm) or "norm" in type(m).__name__.lower()


def _close(a: Tensor, b: Tensor) -> bool:
    return a.shape == b.shape and float((a - b).norm()) <= _TOL * float(b.norm().clamp_min(1e-30))


def _weighted_values(probs: Tensor, seen: dict, srcs: list[str], H: int, dh: int):
    """Every (source, kv heads, chunked layout) of the attention's projections, as the probe's value search tries
    them (``chunks`` equal chunks holding ``kv * dh / chunks`` values each at one offset: a split projection, a fused
    one, latent attention's per-head ``[k_nope | v]``): the values weighted by the probabilities, ``[T, H, dh]``."""
    for n in srcs:
        y = seen[n][1].detach().double()
        y = y.reshape(-1, y.shape[-1])  # [T, W]
        W = y.shape[-1]
        for kv in (k for k in range(1, H + 1) if H % k == 0):
            for chunks in (c for c in range(1, kv + 1) if kv % c == 0 and W % c == 0):
                cw, vw = W // chunks, kv * dh // chunks
                for offset in range(0, cw - vw + 1):
                    index = (torch.arange(chunks)[:, None] * cw + offset + torch.arange(vw)[None]).reshape(-1)
                    v = y[:, index].unflatten(-1, (kv, dh)).repeat_interleave(H // kv, dim=1)
                    yield n, torch.einsum("hqk,khd->qhd", probs, v)


def _gate(want: Tensor, seen: dict, srcs: list[str], H: int) -> tuple[str, str, str] | None:
    """(the activation, the projection, where among its outputs) of the gate ``want`` ``[T, n]``: the sigmoid or the
    softplus of ``n`` of a projection's outputs in ``chunks`` (dividing H) equal chunks at one offset each (AX-K2's
    ``[q | gate]`` per head); None where none is."""
    n_out = want.shape[-1]
    for n in srcs:
        y = seen[n][1].detach().double().reshape(want.shape[0], -1)
        W = y.shape[-1]
        for chunks in (c for c in range(1, H + 1) if H % c == 0 and W % c == 0 and n_out % c == 0):
            cw, gw = W // chunks, n_out // chunks
            for offset in range(0, cw - gw + 1):
                index = (torch.arange(chunks)[:, None] * cw + offset + torch.arange(gw)[None]).reshape(-1)
                for act, f in (("sigmoid", torch.sigmoid), ("softplus", F.softplus)):
                    if _close(f(y[:, index]), want):
                        each = f" of each of its {chunks} chunks" if chunks > 1 else ""
                        return act, n, "" if W == n_out else f" (its outputs {offset}..{offset + gw - 1}{each})"
    return None


def _gate_reason(gate: tuple[str, str, str], per: str, n: str, seen: dict, norm: str | None = None) -> str:
    """The refusal of reads gated by ``gate`` (:func:`_gate`), ``per`` head or channel, values from ``n``; ``norm``: a
    norm of all the heads' reads together the gated reads pass before the output projection (Dory's)."""
    act, src, where = gate
    said = (f"its reads ({n} weighted by its probabilities) are multiplied {per} by a gate, {act} of {src}{where}, "
            f"before {norm or 'the output projection'}")
    if seen[src][0] is seen[""][0] and norm:  # a gate mfpipe places, and a norm of the gated reads after it
        return (f"{said}, a norm of all its heads' reads together: mfpipe places a gate of the reads "
                "(mfpipe.models.adapters.gate) or a norm of them (BitNet's: mfpipe.models.adapters.normed), not both")
    if seen[src][0] is seen[""][0]:  # a gate mfpipe.models.adapters.gate places (either activation): not the cause
        return f"{said}, a gate mfpipe places; but no layout of its values is found with it"
    return (f"{said}: the {act} of a projection ({src}) of another input, in a layout mfpipe.models.adapters.gate "
            "does not find (it places a sigmoid or softplus of a slice of a projection of the attention's input or of "
            "a latent of it)")


def _values_reason(attn_mod, seen: dict, out_proj: str, H: int, dh: int, cfg, norm: str | None = None) -> str | None:
    """What the reads are, where the probability-weighted values of no layout are (see the module docstring);
    ``norm``: what the output projection reads is a norm of all the heads' reads together, ``seen[out_proj]`` its
    input (a norm of the reads themselves is placed: BitNet's, mfpipe.models.adapters.normed)."""
    reads = seen[out_proj][0]
    for n, (x, y, *_) in seen.items():
        if n and n != out_proj and y is reads and _norm(attn_mod.get_submodule(n)) and norm is None:
            said = (f"a norm of all its heads' reads together ({n}: {type(attn_mod.get_submodule(n)).__name__}) "
                    "sits between the attention and its output projection")
            inner = _values_reason(attn_mod, {**seen, out_proj: (x, *seen[out_proj][1:])}, out_proj, H, dh, cfg, n)
            return inner or (f"{said}, and what it norms is no probability-weighted values of a layout mfpipe finds "
                             "(it places a norm of the reads themselves, BitNet's: mfpipe.models.adapters.normed)")
    out = seen[""][2]
    probs = out[1] if isinstance(out, (tuple, list)) and len(out) > 1 else None
    if not isinstance(probs, Tensor):
        return None
    probs, R = probs.detach().double()[0], reads.detach().double().reshape(-1, H, dh)
    srcs = [n for n in linear_paths(attn_mod) if n != out_proj and n in seen]
    for n, pv in _weighted_values(probs, seen, srcs, H, dh):
        c = float((R * pv).sum() / (pv * pv).sum().clamp_min(1e-30))
        if abs(c - 1) > 1e-4 and _close(c * pv, R):  # (times 1: the values fit, nothing to explain)
            named = [k for k, v in vars(cfg).items() if isinstance(v, float) and abs(v - c) <= 1e-4 * abs(c)]
            what = f" (the config's {named[0]})" if named else ""
            return (f"its values are its value projection's ({n}) outputs times {c:.4g}{what}: mfpipe's value map "
                    "has no such factor")
        s = (R * pv).sum(-1) / (pv * pv).sum(-1).clamp_min(1e-30)  # [T, H]
        if not _close(pv, R) and _close(s[..., None] * pv, R):
            sinks = [k for k, p in attn_mod.named_parameters(recurse=False) if tuple(p.shape) == (H,)]
            if sinks and bool(((s > 0) & (s < 1)).all()):
                return (f"each head's reads are its probability-weighted values ({n}) times a factor in (0, 1) per "
                        f"position that the probabilities it returns leave out (its {sinks[0]} parameter: an "
                        "attention sink, its factor not sigmoid(logsumexp(scores) - sink) of the scores' logsumexp "
                        "the attention computes, the form mfpipe reads: Granite-SWA's)")
            gate = _gate(s, seen, srcs, H) if bool((s > 0).all()) else None  # a gate is positive
            if gate:
                return _gate_reason(gate, "head by head", n, seen, norm)
        ok = pv.abs() > 1e-6 * float(pv.abs().max())
        g = torch.where(ok, R / torch.where(ok, pv, torch.ones_like(pv)), torch.zeros_like(pv))
        gate = _gate(g.flatten(1), seen, srcs, H) if bool(ok.all() and (g > 0).all()) else None
        if gate:
            return _gate_reason(gate, "channel by channel", n, seen, norm)
    return None


def _differential(attn_mod: nn.Module) -> bool:
    """Differential attention (DiffLlama): the module holds the λ of ``softmax_1 - λ softmax_2`` (its
    re-parametrisation ``lambda_q1``, ``lambda_k1``, ...) and its ``lambda_init``."""
    names = {n for n, _ in attn_mod.named_parameters(recurse=False)}
    return hasattr(attn_mod, "lambda_init") and {"lambda_q1", "lambda_k1"} <= names


def _attention(model) -> tuple[nn.Module | None, str | None, int, int]:
    """(the first block's softmax attention module as the probe would place it -- the first ``*Attention`` module
    of a block, not a mixer of a hybrid's by name --, its output projection's path: a projection to the model width
    from ``H x dv``, the heads ``H`` and their read width ``dv``); None where there is none."""
    cfg = model.config
    H, d = int(getattr(cfg, "num_attention_heads", 0) or 0), int(getattr(cfg, "hidden_size", 0) or 0)
    for block in blocks(model):
        found = [m for m in block.modules() if type(m).__name__.endswith("Attention") and not any(
            t in type(m).__name__.lower() for t in ("linear", "delta", "mamba", "recurrent", "conv"))]
        if not found or not H:
            continue
        inner = [m for m in found[1:] if any(m is c for c in found[0].modules())]  # GPT-Neo's wraps the proper one
        attn = inner[0] if inner else found[0]
        outs = [(n, m.weight.shape) for n, m in linear_paths(attn).items() if (int(m.weight.shape[0]) == d and
                int(m.weight.shape[1]) % H == 0 and type(m).__name__ != "Conv1D")]
        named = [o for o in outs if o[0].split(".")[0] in ("o_proj", "out_proj", "dense", "c_proj")]
        out = named or outs
        return attn, (out[0][0] if len(out) == 1 else None), H, (int(out[0][1][1]) // H if len(out) == 1 else 0)
    return None, None, H, 0


_STREAM_KEYS = ("altup_num_inputs", "hc_count", "hc_mult")


def _streams(model, base, d: int) -> str | None:
    """Several residual streams: a count of them in the config (Gemma-3n's AltUp ``altup_num_inputs``,
    hyper-connections' ``hc_count`` / ``hc_mult``), a stack of earlier residual states ``[B, T, n, d]`` handed to the
    last block beside its input (Inkling-2's ``block_states``), or a norm outside the blocks ``k x d`` wide
    (Reformer's reversible residual: its final norm reads ``[x1 | x2]``)."""
    for key in _STREAM_KEYS:
        n = getattr(model.config, key, None)
        if isinstance(n, int) and not isinstance(n, bool) and n > 1:
            return (f"its blocks carry {n} residual streams ({key}), mixed in every block: mfpipe reads one residual "
                    "stream of summed branches")
    stacks = _forward(model, base, {"": blocks(model)[-1]})  # the last block: the stack grows from none at block 0
    held = [a for a in stacks.get("", (None, None, None, ()))[3] if isinstance(a, Tensor) and a.ndim == 4
            and a.shape[-1] == d and a.shape[-2] > 0]
    if held:  # Inkling-2's block_states: the residuals at earlier block boundaries, [B, T, n, d]
        return (f"its blocks mix the residuals of earlier blocks by an attention over them (attention residuals: a "
                f"stack of earlier residual states handed beside the residual, {held[0].shape[-2]} at its last "
                "block): mfpipe reads one residual stream of summed branches")
    inside = {id(m) for b in blocks(model) for m in b.modules()}
    for n, m in base.named_modules():
        w = getattr(m, "weight", None)
        if _norm(m) and id(m) not in inside and isinstance(w, Tensor) and w.ndim == 1 and w.numel() % d == 0 \
                and w.numel() > d:
            return (f"its blocks carry {w.numel() // d} residual streams side by side (its norm {n} reads "
                    f"{w.numel() // d} x {d}: a reversible residual, each block adding its attention to one stream "
                    "and its MLP to the other): mfpipe reads one residual stream of summed branches")
    return None


def _block_form(model, base, attn_mod: nn.Module) -> str | None:
    """What in the first attention block's forward keeps it from a residual stream mfpipe reads: a norm of the residual
    at its end inside a module of the block's that the placement did not place (a post-norm whose norm is a module of
    the block is placed, GPT-1's: ``Structure.block_norm``, and one whose norm sits in a module that adds the residual
    to its one projection's output, BERT's output modules: GIT's), the
    attention's output passing through another module before the residual (a short convolution over positions is
    placed: Inkling's, :mod:`~mfpipe.models.adapters.convolved`). (A join of another form, scaled or renormalised, is
    run by the block's own code: :mod:`~mfpipe.models.adapters.joins`.)"""
    block = next(b for b in blocks(model) if any(m is attn_mod for m in b.modules()))
    attn = next(n for n, m in block.named_modules() if m is attn_mod)
    kids = {n: m for n, m in block.named_modules() if n and (_norm(m) or "." not in n)}
    seen = _forward(model, base, {"<block>": block, **kids, attn: attn_mod})
    if "<block>" not in seen or attn not in seen:
        return None
    x0, y0 = seen["<block>"][0], seen["<block>"][1]
    norms = [n for n in seen if n in kids and _norm(kids[n]) and seen[n][0].shape == x0.shape]  # of the residual
    ends = [n for n in norms if seen[n][1] is y0]
    if ends:
        return (f"its blocks end in a norm of the residual inside a module of their own ({ends[0]}: post-norm, the "
                "residual added inside that module): mfpipe places a post-norm whose norm is a module of the block or of a "
                "module that adds the residual to its one projection's output (BERT's output modules)")
    a_out = seen[attn][1]
    after = [n for n in seen if n in kids and "." not in n and n != attn and seen[n][0] is a_out and not _norm(kids[n])
             and any(True for _ in kids[n].parameters()) and not position_conv(kids[n])]  # not a dropout; a short
    # convolution over positions is placed (Inkling's: mfpipe.models.adapters.convolved)
    if after:
        return (f"its attention's output passes through {after[0]} ({type(kids[after[0]]).__name__}) before it joins "
                "the residual: mfpipe reads the attention branch as the attention returns it (a norm after it at "
                "most)")
    return None


def _pieces(model, base) -> str | None:
    """An LM head that reads the final norm's output through more than one module of the causal LM (one is placed:
    ModernBERT-decoder's prediction head, :func:`~mfpipe.models.adapters.residual.head_transform`; so is a first block
    whose attention norm is the identity, :func:`~mfpipe.models.adapters.forms.placing_block`)."""
    head = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None
    if head is None or model is base:
        return None
    outer = {n: m for n, m in model.named_children() if m is not base and m is not head and any(
        True for _ in m.parameters())}
    seen = _forward(model, base, {"<head>": head, "<base>": base, **outer}, whole=True)
    if "<head>" in seen and "<base>" in seen and not _same(seen["<head>"][0], seen["<base>"][1]):
        on = [n for n in outer if n in seen and _same(seen[n][1], seen["<head>"][0])]
        if len(on) != 1 or not _same(seen[on[0]][0], seen["<base>"][1]):
            return ("its LM head reads the final residual through modules of the causal LM other than one module "
                    "of the final norm's output: mfpipe's unembedding is the final norm, at most one such module, and "
                    "one linear map")
    return None


def _attention_kinds(model) -> str | None:
    """Layers whose attentions differ in their heads' count or width (Inkling-2's full and sliding attentions)."""
    kinds = {}
    for b in blocks(model):
        for m in b.modules():
            if type(m).__name__.endswith("Attention") and isinstance(getattr(m, "head_dim", None), int):
                kinds.setdefault(type(m).__name__, (getattr(m, "num_heads", None), m.head_dim))
                break
    if len(set(kinds.values())) < 2:
        return None
    said = ", ".join(f"{k}: {h} heads of {dh}" for k, (h, dh) in kinds.items())
    return f"its layers' attentions differ in their heads ({said}): mfpipe reads heads of one count and width per model"


_VAGUE = ("cannot place one attention module at one path", "cannot place the token embedding",
          "cannot place the final norm", "cannot place one MLP module", "its MLP reads neither", "cannot place the attention's output projection", "cannot place the list of")


def _why(reason: str, model, attn_mod, out_proj, H: int, dv: int) -> str | None:
    """The precise reason for the placement's refusal ``reason`` (only a vague one is re-worded), or None."""
    base, d = base_model(model), int(model.config.hidden_size)
    if reason.startswith("cannot place the value projection"):
        if attn_mod is None or out_proj is None:
            return None
        watch = {"": attn_mod, **linear_paths(attn_mod), **{n: m for n, m in attn_mod.named_children() if _norm(m)}}
        seen = _forward(model, base, watch)
        return _values_reason(attn_mod, seen, out_proj, H, dv, model.config) if "" in seen and out_proj in seen \
            else None
    if reason.startswith("its first block reads the token embedding changed"):  # Gemma-3n's: one of its AltUp
        return _streams(model, base, d)  # streams (an embedding changed otherwise: as it says)
    if not reason.startswith(_VAGUE):
        return None
    kinds = _attention_kinds(model) if reason.startswith("cannot place one attention module at one path") else None
    if kinds:
        return kinds
    experts = [n for n, m in attn_mod.named_children() if callable(getattr(m, "reduce", None))
               and callable(getattr(m, "map", None))] if attn_mod is not None else []
    if experts:  # (a projection of the width d inside, its keys' and values' kv_proj, is no output projection)
        return (f"its heads are routed per token (a mixture of attention heads: {experts[0]} "
                f"({type(attn_mod.get_submodule(experts[0])).__name__}) picks each token's query experts, each with "
                "its own output projection): mfpipe reads a fixed set of heads per layer")
    return (_streams(model, base, d) or (_block_form(model, base, attn_mod) if attn_mod is not None else None)
            or _pieces(model, base))


def explain(error, model):
    """``error`` (an ``UnsupportedArchitectureError`` of :func:`~mfpipe.models.adapters.structure.describe` on the
    causal LM ``model``) with a precise reason where the model's forward shows one (the module docstring; ``kind``
    "modelling" for differential attention), else ``error`` itself."""
    cls, mt = type(error), error.model_type
    try:
        attn_mod, out_proj, H, dv = _attention(model)
        if attn_mod is not None and _differential(attn_mod):
            return cls(mt, "differential attention: each head reads (softmax_1 - λ softmax_2) V, two softmax maps "
                           "subtracted, normalised per head (its lambda_q1, lambda_k1, lambda_init): no head reads "
                           "its values under one probability row, the object of the mean-field analysis",
                       kind="modelling")
        why = _why(error.reason, model, attn_mod, out_proj, H, dv)
    except Exception:  # a forward or a model that fails says nothing more than the refusal
        return error
    return cls(mt, why) if why else error
