"""Block forms beyond one attention module and one MLP, read as the model computes them:

* **no MLP** (Nemotron-H's attention blocks: a norm, the attention, the residual add; its MLP and MoE blocks are
  layers of a kind of their own, ``"mlp"``): the structure's ``mlp`` is None and the MLP branch is zero
  (:data:`NO_MLP` in the probe: a zero branch reading the block input plus the attention branch, where the block's
  output is exactly that);
* **a mixer beside the attention** (Falcon-H1: a Mamba mixer reads what the attention reads, and the residual after
  the attention is the block input plus both branches, the mixer's times a scale of the block's own; then the MLP):
  the structure's ``side_mixer`` / ``side_scale``. The heads are analysed as any attention's; the mixer's branch is
  the model's own wherever a forward runs (the site reads and patches the heads only, so a substitution keeps the
  model's own mixer output), and the rollout adds it at each centroid as the mixer computes it on that centroid as a
  sequence of one position (:func:`side_branch`, as :func:`~mfpipe.models.adapters.hybrid.mixer_block` runs a
  hybrid's other blocks); ``attn_out`` is the heads' branch alone, so ``mlp_out`` is read, never derived;
* **an attention the forward skips inside a block** (TrOCR's ``encoder_attn``, a cross-attention beside the
  self-attention, called only with encoder states): no part of the text's decoder (:func:`idle_attentions`), its norm
  never run either;
* **a block the forward skips** (Mllama's cross-attention layers on text-only input: :data:`IDENTITY_KINDS`): a layer
  of its own kind carried as the identity; the site reads the residual entering it where the last block run before
  it hands it on (:func:`skipped_capture`), the rollout passes the centroids through unchanged, and the forward's own
  hidden states, which have no entry for it, are expanded to one per layer for references (:func:`per_layer_hidden`);
* **the attention and its norms inside one module of the block** (DBRX's ``norm_attn_norm``: :func:`wrapped_attention`;
  the probe places those norms as the block's own), and **queries, keys and values clamped** to +-``clip_qkv``
  (DBRX's): the structure's ``value_clip``; **values scaled** by a constant (MiMo-V2-Flash's ``v_scale``, the
  config's ``attention_value_scale``): the structure's ``value_scale``; both applied, clamp then scale, wherever values
  are read or computed (:func:`value_form`), found by the attention's own attribute and confirmed by the value search;
  **values normed per head** by a norm of the attention's own (Gemma-4's ``v_norm``): the structure's ``value_norm``,
  found by name and confirmed by the value search (:func:`formed_sources`); Gemma-4's forms mfpipe does not place are
  refused by the config keys that turn them on (:func:`check_config_forms`).
* **a sink's factor on the reads** (Granite-SWA's ``sinks``: :mod:`~mfpipe.models.adapters.sinks`): the probe's
  value search reads the probabilities behind the reads, which the attention does not return.
* **a norm that is the identity in some blocks** (ModernBERT-decoder's first block: an ``nn.Identity`` at the path of
  the others' attention norm): the structure is placed by a block with the norm (:func:`placing_block`), and the
  identity, read at the same path, is that block's norm (its embedding one level down, with its norm:
  :mod:`~mfpipe.models.adapters.embedding`).

Forms that are no attention block writing a residual stream of blocks of their own are refused with the reason:
a whole decoder block nested in a layer, whose output feeds another mixer's input (Zamba's shared block:
:func:`wrapped_attention`), attention sublayers several to a block, or blocks run again in recurrent cycles
(LongCat-Flash's, HRM's: :func:`unstacked`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from mfpipe.models.adapters.capture import first_output
from mfpipe.models.adapters.probe import Seen, UnsupportedArchitectureError, is_norm, submodule
from mfpipe.models.adapters.residual import block_scales, branch_scale, snapped
from mfpipe.models.adapters.sinks import probe_sink
from mfpipe.models.adapters.streaming import held

__all__ = ["IDENTITY_KINDS", "NO_MLP", "block_forms", "check_skipped", "formed_sources", "idle_attentions", "per_layer_hidden", "placing_block",
           "side_branch", "source_form", "value_form", "check_source_forms",
           "has_side_mixer", "side_mixer", "skipped_capture", "unstacked", "wrapped_attention"]

IDENTITY_KINDS = ("cross_attention",)  # layers a decoder's forward skips on text-only input: carried as the identity
NO_MLP = "<no mlp>"  # the probe's name of the zero MLP branch of a block without one


def side_mixer(block: nn.Module, attn: str, is_mixer) -> str | None:
    """The one child of ``block`` beside its attention (``attn``'s top module) that ``is_mixer`` (by class name: a
    Mamba mixer) and holds parameters, or None."""
    top = attn.split(".")[0]
    found = [n for n, m in block.named_children() if n != top and not is_norm(m) and is_mixer(m)
             and any(True for _ in m.parameters())]
    return found[0] if len(found) == 1 else None


def wrapped_attention(block: nn.Module, attentions, mt) -> list[str]:
    """The attention one level down (``attentions(module)``: its ``*Attention`` children), in a child of ``block``
    that holds it and norms only (DBRX's ``norm_attn_norm``: ``norm_1``, ``attn``, ``norm_2``, which returns the
    residual after the attention and the MLP norm of it): its path, or none. A child that holds an attention and
    other modules besides norms (a whole decoder block nested in a layer: Zamba's shared transformer block) is
    refused."""
    found = []
    for n, c in block.named_children():
        inner = attentions(c)
        rest = [k for k, g in c.named_children() if k not in inner and not is_norm(g)]
        if len(inner) == 1 and not rest:
            found.append(f"{n}.{inner[0]}")
        elif inner:
            beside = [k for k in dict(block.named_children()) if k != n]
            raise UnsupportedArchitectureError(mt, f"its attention ({n}.{inner[0]}) sits in {type(c).__name__}, a "
                                                   f"block of its own ({', '.join(rest)} beside it) nested in a layer "
                                                   f"with {', '.join(beside)}: Zamba's shared transformer block, which "
                                                   "reads the residual concatenated with the token embeddings and "
                                                   "whose output enters the input of the layer's Mamba mixer, not "
                                                   "the residual stream; mfpipe reads heads whose output projection "
                                                   "writes a branch of the residual stream")
    return found


def idle_attentions(base: nn.Module, blocks) -> frozenset[str]:
    """The names of the blocks' ``*Attention`` children that one forward of three tokens runs in no block (TrOCR's
    ``encoder_attn``: a cross-attention in every block, which its forward calls only with encoder states), where a
    block has more than one such child (no forward otherwise; none where the forward fails)."""
    def attentions(b):
        return [(n, c) for n, c in b.named_children() if type(c).__name__.endswith("Attention")]

    if all(len(attentions(b)) <= 1 for b in blocks):
        return frozenset()
    ran: set[str] = set()
    handles = [c.register_forward_pre_hook(lambda *a, n=n: ran.add(n)) for b in blocks for n, c in attentions(b)]
    try:
        with torch.no_grad():
            ids = torch.tensor([[1, 8, 15]]).remainder(int(getattr(base.config, "vocab_size", 3) or 3))
            base(ids.to(next(base.parameters()).device), use_cache=False)  # (TrOCR's wrapper has no input embedding)
    except Exception:  # a forward that fails says nothing: the candidates stay as they are
        return frozenset()
    finally:
        for h in handles:
            h.remove()
    return frozenset(n for b in blocks for n, _ in attentions(b) if n not in ran)


def placing_block(blocks, kinds: list[str]) -> int:
    """The attention block a structure is placed by: the first that has no ``nn.Identity`` child at a name where
    another attention block has a norm (ModernBERT-decoder's first block, whose attention norm is the identity: it is
    placed by its second); the first attention block where every one has one."""
    attention = [l for l, k in enumerate(kinds) if k == "attention"]

    def thin(l: int) -> bool:
        return any(isinstance(c, nn.Identity) and any(is_norm(getattr(blocks[o], n, None) or c) for o in attention)
                   for n, c in blocks[l].named_children())

    return next((l for l in attention if not thin(l)), attention[0])


def unstacked(base: nn.Module, L: int, mt) -> list:
    """Where no module of ``base`` holds a list of its ``L`` (``num_hidden_layers``) blocks: a refusal that says what
    ``L`` counts instead, by the modules and one forward -- attention sublayers, several to a block (LongCat-Flash's
    two per block), or the calls of fewer blocks run again in recurrent cycles (HRM's two stacks); else none."""
    lists = {n: m for n, m in base.named_modules() if isinstance(m, nn.ModuleList) and len(m) and n.count(".") < 2}
    for n, blocks in lists.items():
        inner = [(k, len(g)) for k, g in blocks[0].named_children() if isinstance(g, nn.ModuleList) and len(g) > 1
                 and all(type(a).__name__.endswith(("Attention", "MLA")) for a in g)]
        moe = [f"{k} ({type(g).__name__})" for k, g in blocks[0].named_children() if "moe" in type(g).__name__.lower()]
        if inner and len(blocks) * inner[0][1] == L:
            raise UnsupportedArchitectureError(mt, f"each of its {len(blocks)} blocks ({n}) holds {inner[0][1]} "
                                                   f"attention sublayers (a list, {inner[0][0]}), which its "
                                                   f"num_hidden_layers ({L}) counts, and modules the sublayers share"
                                                   f"{': ' + ', '.join(moe) if moe else ''}: mfpipe reads one "
                                                   "attention module per block")
    calls: list[int] = []
    handles = [b.register_forward_pre_hook(lambda *a: calls.append(1)) for m in lists.values() for b in m]
    try:
        with torch.no_grad():
            ids = torch.tensor([[1, 8, 15]]).remainder(int(base.config.vocab_size))
            base(ids.to(base.get_input_embeddings().weight.device), use_cache=False)
    except Exception:  # a forward that fails says nothing more
        return []
    finally:
        for h in handles:
            h.remove()
    n_blocks = sum(len(m) for m in lists.values())
    if len(calls) > n_blocks:  # (a default config's num_hidden_layers counts the calls: HRM's)
        raise UnsupportedArchitectureError(mt, f"its forward runs its {n_blocks} blocks ({', '.join(lists)}) "
                                               f"{len(calls)} times, again in recurrent cycles (HRM's two stacks over "
                                               "two states, each stack ending in a norm of its state): no residual "
                                               "stream through blocks of their own, as mfpipe reads a decoder")
    return []


def block_forms(block: nn.Module, attn: str, side: str | None, no_mlp: bool, named_mlp: str | None, mt):
    """The probe's hook for the forms above (:func:`mfpipe.models.adapters.probe.probe`'s ``forms``): called on the
    probe forward's tensors ``seen`` (and ``same``, equality up to the model dtype's rounding) before the MLP and the
    norms are placed; it checks the form, adds or rewrites what the probe reads, and returns the probe's extra
    results. Its ``watch``: the norms of a module that holds the attention and its norms (:func:`wrapped_attention`),
    which the probe places as the block's own."""
    attn_mod = submodule(block, attn)
    form = source_form(attn_mod)  # DBRX's q, k, v clamped to +-clip_qkv; MiMo-V2-Flash's values scaled
    scales = block_scales(block)
    top = attn.split(".")[0]
    sink = probe_sink(attn_mod, attn)  # a sink's factor on the reads (Granite-SWA's): armed for the probe

    def forms(seen: dict, same) -> dict:
        formed_sources(attn_mod, seen)  # the value search reads them as the heads do
        found = sink(seen, same) if sink else {}  # ... and the probabilities behind the reads
        return place(seen, same) | form | found

    def place(seen: dict, same) -> dict:
        block_in, block_out, attn = seen["<block>"].x, seen["<block>"].y, seen["<attn>"]
        if no_mlp:
            if not same(block_out, block_in + attn.y):
                raise UnsupportedArchitectureError(mt, "its block without an MLP does not return its input plus its "
                                                       "attention's output")
            mid = block_in + attn.y  # the zero MLP reads the residual after the attention
            zero = torch.zeros_like(mid)
            seen[NO_MLP] = Seen(mid, zero, mid, zero, zero)
            return {"mlp_chain": [], "mlp_sequences": False}
        if side is None:
            return {}
        if side not in seen or named_mlp not in seen:
            raise UnsupportedArchitectureError(mt, f"a probe forward did not run its mixer beside the attention "
                                                   f"({side}) or its MLP")
        mixer = seen[side]
        m = 1.0 if same(mixer.x, attn.x) else branch_scale(attn.x, mixer.x, scales)  # Falcon-H1's attention_in_...
        if m is None or not same(m * mixer.x, attn.x):
            raise UnsupportedArchitectureError(mt, f"its mixer beside the attention ({side}) reads another input than "
                                                   "the attention (nor the same times a number): mfpipe reads both "
                                                   "from one norm of the residual")
        mid = block_out - seen[named_mlp].y - block_in  # what the block adds besides the MLP: both branches, scaled
        a, c = _two_scales(mid, attn.y, mixer.y, scales)  # Falcon-H1's attention_out_multiplier, ssm_out_multiplier
        if c is None or not same(block_in + a * attn.y + c * mixer.y, block_out - seen[named_mlp].y):
            raise UnsupportedArchitectureError(mt, f"its mixer beside the attention ({side}) and the attention join "
                                                   "the residual in a way mfpipe cannot place (not the block input "
                                                   "plus the attention's and the mixer's outputs, each times a scale)")
        # what the MLP reads is the block input plus both branches: the norms' roles are placed on their sum, the
        # attention's norm by what the mixer reads (the attention reads it times m)
        seen["<attn>"] = attn._replace(y=a * attn.y + c * mixer.y, x=mixer.x, x_obj=mixer.x_obj)
        return {"side_scale": c, "attn_scales": (m, a)}

    wrapper = submodule(block, top)
    forms.watch = {f"{top}.{n}": m for n, m in wrapper.named_children() if is_norm(m)} if top != attn else {}
    return forms


def check_skipped(base: nn.Module, blocks, kinds: list[str], mt) -> None:
    """Where ``kinds`` name any of :data:`IDENTITY_KINDS`: refuse unless the blocks the decoder's forward skips on
    text-only input (one forward of three tokens) are exactly those, and the first block runs."""
    if not any(k in IDENTITY_KINDS for k in kinds):
        return
    ran: set[int] = set()
    handles = [b.register_forward_pre_hook(lambda m, a, l=l: ran.add(l)) for l, b in enumerate(blocks)]
    vocab = int(getattr(base.config, "vocab_size", 3) or 3)
    try:
        with torch.no_grad():
            base(torch.tensor([[1, 8, 15]]).remainder(vocab).to(base.get_input_embeddings().weight.device),
                 use_cache=False)
    finally:
        for h in handles:
            h.remove()
    skipped = [l for l in range(len(blocks)) if l not in ran]
    identity = [l for l, k in enumerate(kinds) if k in IDENTITY_KINDS]
    if skipped != identity:
        raise UnsupportedArchitectureError(mt, f"its forward skips the blocks {skipped} on text-only input, and the "
                                               f"blocks {identity} are of a kind mfpipe carries as the identity "
                                               f"({', '.join(IDENTITY_KINDS)})")
    if skipped and skipped[0] == 0:
        raise UnsupportedArchitectureError(mt, "its forward skips its first block: mfpipe reads the residual entering "
                                               "a skipped block where the block before it hands it on")


def _two_scales(delta: Tensor, a: Tensor, b: Tensor, scales) -> tuple[float, float | None]:
    """``(x, y)`` with ``delta = x a + y b`` (least squares), each replaced by the one of ``scales`` it is to 1e-4 (the
    block's own number: then to the bit); ``x`` 1.0 where it is that to 1e-4, ``y`` None where it is undetermined."""
    A = torch.stack([a.reshape(-1), b.reshape(-1)], 1).double()
    if torch.linalg.matrix_rank(A) < 2:
        return 1.0, None
    x, y = (float(v) for v in torch.linalg.lstsq(A, delta.reshape(-1, 1).double()).solution.flatten())
    return snapped(x, [1.0, *scales]), snapped(y, [1.0, *scales])


def has_side_mixer(adapter) -> bool:
    """Whether the blocks hold a mixer beside the attention (Falcon-H1), whose branch :func:`side_branch` computes."""
    return getattr(getattr(adapter, "structure", None), "side_mixer", None) is not None


@torch.no_grad()
def side_branch(adapter, layer: int, x: Tensor) -> Tensor | None:
    """The branch of block ``layer``'s mixer beside the attention (Falcon-H1) on the residual sequences ``x [B, T, d]``
    (float32): the mixer on the attention-input norm of ``x``, times the block's scale, as the block computes it; None
    where the block has none. The rollout passes each centroid as a sequence of one position (no history before it:
    the mixer's state starts from zero)."""
    s = adapter.structure
    if s.side_mixer is None:
        return None
    block = adapter.block_module(layer)
    with held(block):
        h = adapter.attn_input_norm(layer, x.to(device=adapter.device, dtype=adapter.dtype), scaled=False)
        y = submodule(block, s.side_mixer)(h)
    y = first_output(y)
    return (y if s.side_scale == 1.0 else y * s.side_scale).float()


def skipped_capture(layers_env, kinds, layer: int, sel, patch_resid, make):
    """Inside the site's trace: None unless the forward skips block ``layer``; else its capture ``make(layer=layer,
    resid_in=...)`` (a :class:`~mfpipe.models.adapters.site.LayerCapture`): the residual entering it (float32, where
    ``sel`` asks for it) is read as the output of the last block run before it (in forward order: that block has run,
    the next has not), where ``patch_resid(layer, resid)`` may replace it, so that every later block reads that."""
    if kinds is None or kinds[layer] not in IDENTITY_KINDS:
        return None
    if patch_resid is None and "resid_in" not in sel:
        return make(layer=layer)
    prev = max(l for l in range(layer) if kinds[l] not in IDENTITY_KINDS)
    env = layers_env[prev]
    out = env.output
    raw = first_output(out)
    if patch_resid is not None:
        new = patch_resid(layer, raw.float())
        if new is not None:
            if not isinstance(new, Tensor) or tuple(new.shape) != tuple(raw.shape):
                raise ValueError(f"patch_resid(layer={layer}) returned {getattr(new, 'shape', type(new).__name__)}; "
                                 f"return the residual as a tensor of shape {list(raw.shape)} (or None)")
            raw = new.to(device=raw.device, dtype=raw.dtype)
            env.output = (raw, *out[1:]) if isinstance(out, (tuple, list)) else raw
    return make(layer=layer, resid_in=raw.float() if "resid_in" in sel else None)


def source_form(attn_mod: nn.Module) -> dict:
    """The structure's fields of what the attention does to its value source's outputs before the heads read them:
    ``value_clip`` where it clamps them (DBRX's ``clip_qkv``), ``value_scale`` where it multiplies them by a constant
    other than 1 (MiMo-V2-Flash's ``v_scale``), ``value_norm`` (its path from the attention) where a norm of its own
    normalises each head's values (Gemma-4's ``v_norm``, a scale-less RMS norm over each head's width); {} where it
    reads them as they are."""
    clip, scale = getattr(attn_mod, "clip_qkv", None), getattr(attn_mod, "v_scale", None)
    out = {"value_clip": float(clip)} if isinstance(clip, (int, float)) and not isinstance(clip, bool) else {}
    if isinstance(scale, (int, float)) and not isinstance(scale, bool) and float(scale) != 1.0:
        out["value_scale"] = float(scale)
    norm = getattr(attn_mod, "v_norm", None)
    if isinstance(norm, nn.Module) and is_norm(norm) and isinstance(getattr(attn_mod, "head_dim", None), int):
        out["value_norm"] = "v_norm"
    return out


def formed_sources(attn_mod: nn.Module, seen: dict) -> None:
    """The probe's value-source candidates (``seen["<src>..."]``) rewritten as ``attn_mod`` reads them
    (:func:`source_form`, as :func:`value_form` applies it; a value norm of each head's width ``attn_mod.head_dim``, the
    model's own module: Gemma-4's values, ``v_norm`` of ``v_proj``'s output, or of ``k_proj``'s where its full layers'
    keys are its values), for the value search (the probe's placed block, and each other attention kind's:
    :mod:`~mfpipe.models.adapters.layers`), which confirms the form against the reads."""
    form = source_form(attn_mod)
    norm, dh = getattr(attn_mod, form.get("value_norm", ""), None), getattr(attn_mod, "head_dim", None)
    for k in [k for k in seen if form and k.startswith("<src>")]:
        y = seen[k].y.clamp(min=-form["value_clip"], max=form["value_clip"]) if "value_clip" in form else seen[k].y
        y = y * form["value_scale"] if "value_scale" in form else y
        if norm is not None and y.shape[-1] % dh == 0:
            with torch.no_grad():
                y = norm(y.to(seen[k].y_obj.dtype).unflatten(-1, (-1, dh))).flatten(-2).float()
        seen[k] = seen[k]._replace(y=y)


def check_source_forms(blocks, attn: str, layers, mt) -> None:
    """Refuse attention layers that clamp or scale their values differently (the structure holds one form)."""
    forms = {str(source_form(submodule(blocks[l], attn))) for l in layers}
    if len(forms) > 1:
        raise UnsupportedArchitectureError(mt, f"its attention layers clamp or scale their values differently "
                                               f"({', '.join(sorted(forms))}): mfpipe reads one value form")


def value_form(structure, t: Tensor) -> Tensor:
    """``t`` (a value source's output, or values) as the heads read it: clamped to +-``structure.value_clip`` where
    the attention clamps its queries, keys and values so (DBRX's ``clip_qkv``), then times ``structure.value_scale``
    (MiMo-V2-Flash's ``v_scale``: a python float, as the attention multiplies, to the bit); else ``t``. (A value norm,
    ``structure.value_norm``, is the layer's own module: :mod:`~mfpipe.models.adapters.values` calls it per head.)"""
    c, s = structure.value_clip, structure.value_scale
    t = t if c is None else t.clamp(min=-c, max=c)
    return t if s == 1.0 else t * s


def per_layer_hidden(hidden: list, kinds) -> list:
    """The forward's ``output_hidden_states`` with one entry per layer (and the last): where the forward skipped blocks
    (:data:`IDENTITY_KINDS`) it recorded none for them; the residual entering a skipped block is the one entering the
    next block run (a list of the right length is returned as it is)."""
    kinds = list(kinds)
    run = [k for k in kinds if k not in IDENTITY_KINDS]
    if len(hidden) == len(kinds) + 1 or len(hidden) != len(run) + 1:
        return hidden
    out, i = [], 0
    for k in kinds:
        out.append(hidden[i])
        i += k not in IDENTITY_KINDS
    return [*out, hidden[-1]]
