"""Where a decoder keeps its pieces: the :class:`Structure` an adapter is built from, and :func:`describe`, which
places a loaded model by what its modules are and do, not by its ``model_type``.

A structure names (paths from the base model for the block list, the token embedding and the final norm; from one
block for the rest):

* the attention module (its output ``[0]`` is the attention branch before any post-norm, ``[1]`` the
  probabilities under eager attention), its output projection (input = the per-head reads) and where the values
  come from: a separate value projection, or a fused one in one of three layouts (``VALUE_LAYOUTS``);
* the norms by role: before attention, after attention (Gemma-2/3, OLMo-2), before the MLP (or the attention's
  own norm, shared: GPT-J, parallel StableLM), after the MLP; ``None`` where a block has none;
* whether the MLP reads the block input (parallel residual: GPT-J, GPT-NeoX / Pythia, parallel StableLM) or the
  residual after attention;
* the RMS norms' scale form (``weight`` or ``1 + weight``: the Gemma family), the scale the token embedding reaches
  the first block with (sqrt(d) where the model's forward multiplies and the embedding module does not), a learned
  absolute position table (GPT-2), and the final logit soft-cap (Gemma-2).

:func:`describe` finds the modules by their kind and shape (a list of ``num_hidden_layers`` blocks, the module the
model returns as its input embedding, one attention module per block, a projection from ``H * dh`` to ``d``...)
and the norms' roles and the residual form by one probe forward of three tokens, watching which tensor each norm
reads and writes. A model it cannot place raises :class:`UnsupportedArchitectureError` naming what did not match and
the conformance command (``mfpipe conformance``), which checks a placed model's pieces against its own forward.

Rotary embeddings are not part of the description: no analysis recomputes attention scores (the probabilities are
read from the forward), so a rotary share or style has nothing to be wrong about here.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import Tensor, nn

__all__ = ["Structure", "UnsupportedArchitectureError", "VALUE_LAYOUTS", "base_model", "describe"]

# how a block's values come out of its value source:
#   "split":  a projection of its own, [KV * dh] outputs (Llama, Mistral, Qwen, Gemma, OLMo-2, GPT-J, StableLM)
#   "qkv":    one projection, outputs [q (H dh) | k (KV dh) | v (KV dh)] (Phi-3's qkv_proj; GPT-2's Conv1D c_attn)
#   "neox":   one projection, outputs per head [H, (q | k | v), dh] (GPT-NeoX / Pythia's query_key_value)
VALUE_LAYOUTS = ("split", "qkv", "neox")
_VALUE_SOURCES = {"v_proj": "split", "qkv_proj": "qkv", "c_attn": "qkv", "query_key_value": "neox"}
_OUT_PROJ_NAMES = ("o_proj", "out_proj", "dense", "c_proj")
CONFORMANCE_HINT = "check a model with `mfpipe conformance MODEL` (docs/architectures.md)"


class UnsupportedArchitectureError(ValueError):
    """The model cannot be placed: :func:`describe` found no structure it knows (the message says what failed)."""

    def __init__(self, model_type: str | None, reason: str = "no structure mfpipe knows"):
        self.model_type = model_type
        self.reason = reason
        super().__init__(f"unsupported architecture: model_type={model_type!r}: {reason}; {CONFORMANCE_HINT}")


@dataclass(frozen=True)
class Structure:
    """A decoder's layout (see the module docstring). Paths are dotted attribute names."""

    layers: str
    embed: str
    final_norm: str
    attn: str
    value_source: str
    value_layout: str
    out_proj: str
    attn_norm: str | None
    post_attn_norm: str | None
    mlp: str
    mlp_norm: str | None
    post_mlp_norm: str | None
    parallel_residual: bool
    rms_offset: float = 0.0  # RMS norms scale by (rms_offset + weight): 1.0 in the Gemma family
    embed_scale: float = 1.0  # what the forward multiplies the embedding module's output by before block 0
    position_table: str | None = None  # a learned absolute position embedding of the base model (GPT-2's wpe)
    logit_softcap: float | None = None  # final logits -> tanh(logits / cap) * cap (Gemma-2)

    def as_dict(self) -> dict:
        return asdict(self)


def base_model(model: nn.Module) -> nn.Module:
    """The decoder stack of an HF model (``model.base_model``; the model itself if already bare)."""
    base = getattr(model, "base_model", None)
    return model if base is None else base


def _is_norm(m: nn.Module) -> bool:
    return isinstance(m, nn.LayerNorm) or "norm" in type(m).__name__.lower()


def _linear_shape(m: nn.Module) -> tuple[int, int] | None:
    """(in, out) of an nn.Linear or a transformers Conv1D (weight [in, out]); None for other modules."""
    w = getattr(m, "weight", None)
    if not isinstance(w, Tensor) or w.ndim != 2:
        return None
    if type(m).__name__ == "Conv1D":
        return int(w.shape[0]), int(w.shape[1])
    if isinstance(m, nn.Linear):
        return int(w.shape[1]), int(w.shape[0])
    return None


def _one(found: list[str], what: str, model_type) -> str:
    if len(found) != 1:
        why = "none" if not found else f"{len(found)} candidates ({', '.join(found)})"
        raise UnsupportedArchitectureError(model_type, f"cannot place {what}: {why}")
    return found[0]


def describe(model: nn.Module) -> Structure:
    """The :class:`Structure` of a loaded causal LM (or its base model), in eval mode with eager attention.
    Raises :class:`UnsupportedArchitectureError` naming the first piece it cannot place."""
    cfg = model.config
    mt = getattr(cfg, "model_type", None)
    base = base_model(model)
    L = int(getattr(cfg, "num_hidden_layers", 0) or 0)
    H = int(getattr(cfg, "num_attention_heads", 0) or 0)
    if not L or not H or not getattr(cfg, "hidden_size", None):
        raise UnsupportedArchitectureError(mt, "its config has no num_hidden_layers / num_attention_heads / hidden_size")
    if getattr(cfg, "is_encoder_decoder", False) or getattr(cfg, "add_cross_attention", False):
        raise UnsupportedArchitectureError(mt, "it has cross-attention (mfpipe reads decoder-only models)")
    d = int(cfg.hidden_size)
    KV = int(getattr(cfg, "num_key_value_heads", None) or H)
    dh = int(getattr(cfg, "head_dim", None) or d // H)
    children = dict(base.named_children())
    layers = _one([n for n, m in children.items() if isinstance(m, nn.ModuleList) and len(m) == L],
                  f"the list of its {L} blocks among the base model's modules", mt)
    emb = base.get_input_embeddings() if hasattr(base, "get_input_embeddings") else None
    embed = _one([n for n, m in children.items() if m is emb], "the token embedding", mt)
    final_norm = _one([n for n, m in children.items() if _is_norm(m)], "the final norm", mt)
    n_pos = getattr(cfg, "max_position_embeddings", None)
    position_table = [n for n, m in children.items()
                      if isinstance(m, nn.Embedding) and m is not emb and m.num_embeddings == n_pos]
    block = getattr(base, layers)[0]
    attn = _one([n for n, m in block.named_children() if type(m).__name__.endswith("Attention")],
                "one attention module in a block", mt)
    attn_mod = getattr(block, attn)
    out_proj = _one([n for n, m in attn_mod.named_children()
                     if n in _OUT_PROJ_NAMES and _linear_shape(m) == (H * dh, d)],
                    f"the attention's output projection ({H} x {dh} -> {d})", mt)
    want_out = {"split": KV * dh, "qkv": (H + 2 * KV) * dh, "neox": 3 * H * dh}
    sources = [(n, lay) for n, lay in _VALUE_SOURCES.items()
               if isinstance(getattr(attn_mod, n, None), nn.Module)
               and _linear_shape(getattr(attn_mod, n)) == (d, want_out[lay])]
    value_source, layout = sources[0] if len(sources) == 1 else (None, None)
    if value_source is None:
        _one([n for n, _ in sources], "the value projection (v_proj, or a fused qkv_proj / c_attn / query_key_value)", mt)
    mlp = _one([n for n, m in block.named_children() if type(m).__name__.lower().endswith("mlp")],
               "one MLP module in a block", mt)
    table = getattr(base, position_table[0]) if len(position_table) == 1 else None
    roles = _probe_roles(model, base, layers, attn, mlp, table, mt)
    norm = getattr(block, roles["attn_norm"]) if roles["attn_norm"] else None
    return Structure(
        layers=layers, embed=embed, final_norm=final_norm, attn=attn, value_source=f"{attn}.{value_source}",
        value_layout=layout, out_proj=f"{attn}.{out_proj}", attn_norm=roles["attn_norm"],
        post_attn_norm=roles["post_attn_norm"], mlp=mlp, mlp_norm=roles["mlp_norm"],
        post_mlp_norm=roles["post_mlp_norm"], parallel_residual=roles["parallel"],
        rms_offset=_rms_offset(norm, mt) if norm is not None else _rms_offset(getattr(base, final_norm), mt),
        embed_scale=roles["embed_scale"], position_table=position_table[0] if len(position_table) == 1 else None,
        logit_softcap=getattr(cfg, "final_logit_softcapping", None) or None,
    )


def _rms_offset(norm: nn.Module, mt) -> float:
    """0.0 or 1.0: whether an RMS norm scales by ``weight`` or ``1 + weight`` (told apart on a probe row; a
    LayerNorm: 0.0)."""
    if isinstance(norm, nn.LayerNorm):
        return 0.0
    w = getattr(norm, "weight", None)
    eps = getattr(norm, "variance_epsilon", None) or getattr(norm, "eps", None) or 1e-6
    if not isinstance(w, Tensor) or w.ndim != 1:
        return 0.0
    with torch.no_grad():
        x = torch.linspace(-1.0, 2.0, w.numel(), dtype=torch.float32, device=w.device)[None]
        got = norm(x.to(w.dtype)).float()
        z = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + float(eps))
        errs = {off: (z * (off + w.float()) - got).abs().max().item() for off in (0.0, 1.0)}
    best = min(errs, key=errs.get)
    scale = got.abs().max().item()
    if errs[best] > 1e-2 * max(scale, 1e-6):
        raise UnsupportedArchitectureError(mt, f"its norm {type(norm).__name__} is neither an RMS norm by weight nor "
                                               "by 1 + weight, nor a LayerNorm")
    return best


def _probe_roles(model, base, layers: str, attn: str, mlp: str, table, mt) -> dict:
    """The norms' roles in block 0, the residual form and the embedding's scale, from one forward of three tokens
    with hooks on block 0's children: which norm's output the attention and the MLP read, which norm reads the
    attention's or the MLP's output, and whether the MLP's input comes from the block input or from it plus the
    attention branch."""
    block = getattr(base, layers)[0]
    names = [n for n, m in block.named_children() if _is_norm(m)] + [attn, mlp]
    seen, objs, emb = _probe_forward(model, base, block, names)
    if attn not in seen or mlp not in seen or "<block>" not in seen:
        raise UnsupportedArchitectureError(mt, "a probe forward did not run its first block's attention and MLP")
    norms = [n for n in names[:-2] if n in seen]
    same = _same_within(emb.weight.dtype)
    roles = _norm_roles(seen, objs, norms, attn, mlp, same, mt)
    roles["embed_scale"] = _embed_scale(base, seen, table, same, mt)
    return roles


def _probe_forward(model, base, block, names: list[str]) -> tuple[dict, dict, nn.Module]:
    """One forward of three tokens with hooks on block 0's children ``names``, the block and the token embedding
    -> (name -> (its first input, its output [0]) as float32 copies, the same tensors themselves, the embedding)."""
    seen: dict[str, tuple[Tensor, Tensor]] = {}  # module name -> (its first input, its output [0]), float32 copies
    objs: dict[str, tuple[Tensor, Tensor]] = {}  # the same tensors themselves (kept alive: identity is unambiguous)
    handles = []

    def hook(name):
        def fn(mod, args, kwargs, out):
            x = args[0] if args else kwargs.get("hidden_states")
            y = out[0] if isinstance(out, tuple) else out
            if name not in seen and isinstance(x, Tensor) and isinstance(y, Tensor):
                seen[name] = (x.detach().float().clone(), y.detach().float().clone())
                objs[name] = (x, y)
        return fn

    for n in names:
        handles.append(getattr(block, n).register_forward_hook(hook(n), with_kwargs=True))
    handles.append(block.register_forward_hook(hook("<block>"), with_kwargs=True))
    emb = base.get_input_embeddings()
    handles.append(emb.register_forward_hook(hook("<embed>"), with_kwargs=True))
    vocab = int(getattr(model.config, "vocab_size", 3) or 3)
    ids = (torch.arange(3) * 7 + 1) % vocab
    dev = emb.weight.device
    try:
        with torch.no_grad():
            base(ids[None].to(dev), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return seen, objs, emb


def _same_within(dtype: torch.dtype):
    """``same(a, b)``: equal up to the rounding of the model's dtype (a bfloat16 block adds its branches in
    bfloat16)."""
    eps = max(1e-6, 4 * torch.finfo(dtype).eps) if dtype.is_floating_point else 1e-6

    def same(a, b):
        return a.shape == b.shape and torch.allclose(a, b, rtol=10 * eps, atol=eps * float(b.abs().max().clamp_min(1)))

    return same


def _norm_roles(seen: dict, objs: dict, norms: list[str], attn: str, mlp: str, same, mt) -> dict:
    """The probed ``norms``' roles around the attention ``attn`` and the MLP ``mlp`` and the residual form
    (``parallel``: the MLP reads the block input) from the probe forward's tensors (:func:`_probe_forward`)."""
    block_in = seen["<block>"][0]
    attn_in, attn_out = seen[attn]
    mlp_in, mlp_out = seen[mlp]

    def role(pick, what, obj_pick=None):
        # the tensor a module hands on is the very object the next one reads: that decides first (two norms of
        # equal weights, as at initialisation, give equal values); equal values (up to the dtype) otherwise
        hits = [n for n in norms if obj_pick(*objs[n])] if obj_pick else []
        hits = hits or [n for n in norms if pick(*seen[n])]
        if len(hits) > 1:
            raise UnsupportedArchitectureError(mt, f"{len(hits)} norms could be its {what}: {', '.join(hits)}")
        return hits[0] if hits else None

    attn_in_obj, attn_out_obj = objs[attn]
    mlp_in_obj, mlp_out_obj = objs[mlp]
    attn_norm = role(lambda x, y: same(y, attn_in), "pre-attention norm", lambda x, y: y is attn_in_obj)
    if attn_norm is None and not same(attn_in, block_in):
        raise UnsupportedArchitectureError(mt, "its attention reads neither the block input nor a norm of it")
    post_attn_norm = role(lambda x, y: same(x, attn_out), "post-attention norm", lambda x, y: x is attn_out_obj)
    post_mlp_norm = role(lambda x, y: same(x, mlp_out), "post-MLP norm", lambda x, y: x is mlp_out_obj)
    mlp_norm = role(lambda x, y: same(y, mlp_in) and not same(y, attn_in), "pre-MLP norm",
                    lambda x, y: y is mlp_in_obj and y is not attn_in_obj)
    attn_branch = seen[post_attn_norm][1] if post_attn_norm else attn_out
    if mlp_norm is None and attn_norm is not None and same(mlp_in, attn_in):
        mlp_norm, mlp_reads = attn_norm, block_in  # the MLP shares the attention's norm: it reads the block input
    else:
        mlp_reads = seen[mlp_norm][0] if mlp_norm else mlp_in
    if same(mlp_reads, block_in):
        parallel = True
    elif same(mlp_reads, block_in + attn_branch):
        parallel = False
    else:
        raise UnsupportedArchitectureError(mt, "its MLP reads neither the block input nor the block input plus the "
                                               "attention branch")
    unplaced = [n for n in norms if n not in (attn_norm, post_attn_norm, mlp_norm, post_mlp_norm)]
    if unplaced:
        raise UnsupportedArchitectureError(mt, f"its norm(s) {', '.join(unplaced)} sit where mfpipe has no place")
    return dict(attn_norm=attn_norm, post_attn_norm=post_attn_norm, mlp_norm=mlp_norm, post_mlp_norm=post_mlp_norm,
                parallel=parallel)


def _embed_scale(base, seen: dict, table, same, mt) -> float:
    """The scale the token embedding reaches block 0 with (1, or sqrt(d)), the position table ``table`` added where
    there is one."""
    block_in = seen["<block>"][0]
    e = seen["<embed>"][1]
    scale = 1.0
    if table is not None:  # a learned absolute position table (GPT-2): block 0 reads token + position embeddings
        e = e + table.weight[: e.shape[-2]].detach().float()
    if not same(e, block_in):
        # the forward scales the embedding by sqrt(d) in the model's dtype (the Gemma family, where the embedding
        # module does not do it itself)
        scale = float(base.config.hidden_size) ** 0.5
        if not same(e * torch.tensor(scale, dtype=block_in.dtype), block_in):
            raise UnsupportedArchitectureError(mt, "its first block reads the token embedding changed in a way mfpipe "
                                                   "cannot place (neither as is, nor scaled by sqrt(d), nor plus a "
                                                   "learned position table)")
    return scale
