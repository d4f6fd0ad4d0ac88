"""How a block's branches join the residual stream, where not as ``resid + branch`` of the modules' outputs, and how
positions join the embedding: found in the probe forward (:mod:`~mfpipe.models.adapters.probe`).

* the residual added inside a module (BLOOM's fused ``dropout_add``): the attention returns the block input plus its
  output projection's output (:func:`attn_adds_residual`: its branch is the projection's output), the MLP takes
  ``(input, residual)`` and returns its branch plus the residual (:func:`mlp_residual`, BLOOM and MPT: its branch is its
  output with a zero residual); a module that adds the residual to its one projection's output and norms the sum
  (BERT's layout, GIT's ``attention.output`` and ``output``: :func:`closing_modules`), its projection's output the
  branch, its norm the next one's (a post-norm's, whose roles the probe decides);
* a branch scale (MiniCPM-3 multiplies each branch by ``scale_depth / sqrt(L)``: :func:`branch_scale`, a block's own
  number where it is one, :func:`block_scales`), a bias the
  attention returns for the block to add (:func:`returned_bias`: GPT-NeoX-Japanese's), and a scalar the block
  multiplies its output by (:func:`scalar_buffer`: Gemma-4's ``layer_scalar``);
* an absolute position table as a tensor (:func:`table_rows`: a learned one, or a sinusoidal buffer; the candidates:
  :func:`position_tables`), and the input embedding a base model leaves to its causal LM (:func:`input_embedding`:
  TrOCR's wrapper);
* an MLP branch that is the sum of several modules reading the same input (Granite-4.0-H's and GraniteMoeShared's
  mixture of experts beside a shared MLP: :func:`mlp_siblings`); a block whose output is a norm of its sum
  (:func:`post_norm`: GPT-1's, TrOCR's);
* how the MLP is called: on ``[B, T, d]`` only where one block's MLP reads its input's shape (a mixture of experts,
  also after a dense first block: :func:`mlp_needs_sequences`), with a zero residual where it adds its own;
* how the embedding enters the stream and the logits leave it: the embedding's scale and a position table's row
  offset (:func:`embed_scale`), the final logits' scale against the LM head's output (:func:`logit_scale`), and a
  module the forward runs between the final norm and the LM head (:func:`head_transform`: ModernBERT-decoder's
  prediction head).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor, nn

from mfpipe.models.adapters.capture import first_output
from mfpipe.models.adapters.streaming import held

__all__ = ["PROBE_IDS", "affine_candidates", "affine_embedding", "attn_adds_residual", "block_scales", "branch_scale",
           "closed_chain", "closing_modules", "embed_scale", "head_transform", "input_embedding", "logit_scale",
           "mlp_needs_sequences", "mlp_residual", "mlp_siblings", "post_norm", "position_tables", "returned_bias",
           "scalar_buffer", "snapped", "table_rows"]

PROBE_IDS = (torch.arange(3) * 7 + 1)  # the probe's three tokens (mod the vocabulary)


def input_embedding(model: nn.Module, base: nn.Module) -> nn.Module:
    """The base model's input embedding; the causal LM's where the base model leaves it to it (TrOCR's wrapper)."""
    try:
        return base.get_input_embeddings()
    except NotImplementedError:
        return model.get_input_embeddings()


def table_rows(obj) -> Tensor | None:
    """The rows ``[n, d]`` of an absolute position table: a tensor (CTRL's sinusoidal ``pos_encoding`` buffer), or a
    module's ``weight`` (an nn.Embedding: GPT-2's learned ``wpe``) or ``weights`` (XGLM's sinusoidal one), or None."""
    for t in (obj, getattr(obj, "weight", None), getattr(obj, "weights", None)):
        if isinstance(t, Tensor) and t.ndim == 2 and t.is_floating_point():
            return t
    return None


def position_tables(stack_mod: nn.Module, emb, d: int, n_pos) -> list[str]:
    """The candidates for an absolute position table beside the blocks: a child (an nn.Embedding, XGLM's sinusoidal
    module) or a buffer of its own (CTRL's ``pos_encoding``) with ``d`` wide rows, as many as the positions (or up to
    two more: OPT's and XGLM's start at row 2); the probe checks the one found against what block 0 reads."""
    found = {n: m for n, m in stack_mod.named_children()  # a module with a weight: an nn.Embedding (not a projection)
             if m is not emb and (isinstance(m, nn.Embedding) or getattr(m, "weight", None) is None)}
    found.update(dict(stack_mod.named_buffers(recurse=False)))
    return [n for n, m in found.items() if (t := table_rows(m)) is not None and t.shape[1] == d
            and isinstance(n_pos, int) and 0 <= t.shape[0] - n_pos <= 2]


def returned_bias(blocks, attn: str, d: int) -> str | None:
    """The bias an attention module returns beside its output for the block to add (GPT-NeoX-Japanese's ``dense_bias``:
    a ``[d]`` parameter of the attention module itself that some blocks' attention holds and the others' set to None),
    as a path from the block; None where there is none. The conformance rebuild checks it."""
    mods = [functools.reduce(getattr, attn.split("."), b) for b in blocks if hasattr(b, attn.split(".")[0])]
    mods = [m for m in mods if isinstance(m, nn.Module)]
    names = {n for m in mods for n, p in m.named_parameters(recurse=False)
             if tuple(p.shape) == (d,) and any(n in vars(o) and getattr(o, n) is None for o in mods)}
    return f"{attn}.{names.pop()}" if len(names) == 1 else None


def scalar_buffer(block: nn.Module, name: str) -> bool:
    """Whether ``block`` holds a one-element float buffer ``name`` of its own (Gemma-4's ``layer_scalar``, which its
    forward multiplies the block's output by: the conformance rebuild checks it where it is not 1)."""
    t = dict(block.named_buffers(recurse=False)).get(name)
    return isinstance(t, Tensor) and t.numel() == 1 and t.is_floating_point()


def mlp_residual(block, chain: list[str], last, same) -> Tensor | None:
    """The residual a one-module MLP adds to its branch itself (BLOOM's and MPT's ``mlp(h, residual)``), or None: its
    second positional argument, where the module called on its input and a zero residual gives its output less it."""
    r = last.args[0] if len(chain) == 1 and last.args else None
    if not isinstance(r, Tensor) or r.shape != last.y_obj.shape:
        return None
    try:
        with torch.no_grad():
            y = getattr(block, chain[0])(last.x_obj, torch.zeros_like(r))
    except Exception:  # a second argument of another meaning
        return None
    y = first_output(y).float()
    return r if same(y + r.float(), last.y) and not same(y, last.y) else None


def mlp_siblings(seen: dict, order: list[str], block: nn.Module, chain: list[str], skip, same) -> list[str]:
    """The block's other children the probe forward (``seen``, ``order``) ran on the very input of a one-module MLP
    ``chain`` and whose outputs, of its output's shape, join its output in the block's output: Granite-4.0-H's
    ``block_sparse_moe(h) + shared_mlp(h)``. ``skip(name, module)``: the attention, norms, convolutions over positions.
    The sum is checked where the block's output is its input plus its two branches, both times one scale (no
    post-norms; Granite's ``residual_multiplier``): with them that holds, without them not."""
    if len(chain) != 1:
        return []
    first, kids = seen[chain[0]], dict(block.named_children())
    found = [n for n in order if n in kids and n != chain[0] and not skip(n, kids[n])
             and any(True for _ in kids[n].parameters()) and seen[n].x_obj is first.x_obj
             and seen[n].y.shape == first.y.shape]
    if not found:
        return []
    delta = seen["<block>"].y - seen["<block>"].x

    def joins(mlp_branch: Tensor) -> bool:
        both = seen["<attn>"].y + mlp_branch
        c = branch_scale(delta, both, block_scales(block))
        return c is not None and same(c * both, delta)

    return found if joins(first.y + sum(seen[n].y for n in found)) and not joins(first.y) else []


def post_norm(seen: dict, unplaced: list[str], mlp_norm: str | None, mlp_reads, parallel: bool,
              same) -> tuple[str | None | bool, bool]:
    """``(block_norm, norm_carried)``: the norm a block's output is (post-norm: GPT-1's ``ln_2``, TrOCR's
    ``final_layer_norm``; None where the block hands on a plain sum; False where it reads neither form below) and
    whether the residual its MLP branch joins is the MLP's norm's output (GPT-1: ``ln_2(ln_1(x + a) + mlp(ln_1(x +
    a)))``, the stream carries ``ln_1``'s output) rather than ``resid_mid`` (a norm of the plain sum)."""
    ends = [n for n in unplaced if seen[n].y_obj is seen["<block>"].y_obj]
    if not ends:
        return None, False
    into, mlp_branch = seen[ends[0]].x, seen["<mlp>"].y
    if not parallel and mlp_norm is not None and same(into, seen[mlp_norm].y + mlp_branch):
        return ends[0], True
    if same(into, mlp_reads + mlp_branch) or (parallel and same(into, seen["<block>"].x + seen["<attn>"].y
                                                                 + mlp_branch)):
        return ends[0], False
    return False, False


def attn_adds_residual(seen: dict, same) -> bool:
    """Whether the attention returns the block input plus its output projection's output (BLOOM's dropout_add)."""
    if "<out_proj>" not in seen:
        return False
    a, o = seen["<attn>"].y, seen["<out_proj>"].y
    return a.shape == o.shape and not same(a, o) and same(a, seen["<block>"].x + o)


def closing_modules(block: nn.Module, attn: str, is_norm) -> dict[str, tuple[str, str]]:
    """The block's modules outside the attention proper ``attn`` that hold one projection, one norm (``is_norm``) and
    parameter-free modules only, by path: (its projection's path, its norm's path). BERT's output modules (GIT's
    ``attention.output`` and ``output``: ``LayerNorm(dropout(dense(h)) + residual)``) are of this form; the probe keeps
    those its forward called with the residual beside their input."""
    found = {}
    for n, m in block.named_modules():
        if not n or n == attn or n.startswith(attn + ".") or attn.startswith(n + "."):
            continue
        kids = dict(m.named_children())
        lin = [k for k, c in kids.items() if isinstance(c, nn.Linear)]
        norms = [k for k, c in kids.items() if is_norm(c)]
        if len(lin) == 1 and len(norms) == 1 and all(k in lin or k in norms or not any(True for _ in c.parameters())
                                                     for k, c in kids.items()):
            found[n] = (f"{n}.{lin[0]}", f"{n}.{norms[0]}")
    return found


def closed_chain(seen: dict, closing: dict[str, tuple[str, str]], chain: list[str]) -> list[str]:
    """The MLP's chain ending at its last module's projection where that module is one of ``closing``
    (:func:`closing_modules`) and was handed the residual (its second argument, of its output's shape) in the probe
    forward (``seen``); the projections and norms of those it was not are dropped from ``seen`` (no block's norms)."""
    def closes(one) -> bool:
        r = one.args[0] if one is not None and one.args else None
        return isinstance(r, Tensor) and tuple(r.shape) == tuple(one.y.shape)

    for n in [n for n in closing if not closes(seen.get(f"<close>{n}"))]:
        for p in closing.pop(n):
            seen.pop(p, None)
    return [*chain[:-1], closing[chain[-1]][0]] if chain[-1] in closing else chain


def block_scales(block: nn.Module) -> list[float]:
    """The block's own numbers (its float attributes: Granite's ``residual_multiplier``, Falcon-H1's multipliers), which
    a fitted scale is replaced by where it is one of them (:func:`snapped`)."""
    return [float(v) for v in vars(block).values() if isinstance(v, float)]


def snapped(c: float, scales) -> float:
    """``c``, or the one of ``scales`` it is to 1e-4 (the block's own number: the adapter then scales as the block
    does, to the bit)."""
    return next((v for v in scales if abs(v - c) <= 1e-4 * abs(c)), c)


def branch_scale(delta: Tensor, branch: Tensor, scales) -> float | None:
    """The factor ``c`` with ``delta = c * branch`` (least squares), :func:`snapped` to ``scales``; None where
    ``branch`` is 0."""
    nb = float((branch.double() ** 2).sum())
    if nb <= 0:
        return None
    return snapped(float((delta.double() * branch.double()).sum()) / nb, scales)


def mlp_needs_sequences(blocks, block, chain: list[str], x3: Tensor, want: Tensor, same, residual: bool) -> bool:
    """:func:`_needs_sequences` of the placed ``block`` (against the probe's output ``want``) or of one block of each
    other MLP class (against its own call on ``[B, T, d]``): a mixture of experts after a dense first block (DeepSeek,
    Qwen-MoE's ``mlp_only_layers``) is called as the mixture needs. One block per class: a streamed model's weights
    are read for each."""
    def at(b, path):  # a path in the block (GIT's MLP ends at output.dense), None where it has none
        try:
            return b.get_submodule(path)
        except AttributeError:
            return None

    kinds = {type(at(block, chain[-1]))}  # none: a block without an MLP (mfpipe...forms.NO_MLP)
    others = []
    for b in blocks:
        mlp = at(b, chain[-1]) if all(at(b, n) is not None for n in chain) else None
        if isinstance(mlp, nn.Module) and type(mlp) not in kinds:
            kinds.add(type(mlp))
            others.append(b)
    for b, w in [(block, want), *[(b, None) for b in others]]:
        with held(b):  # called outside a forward: a streamed block's weights are read for it
            if _needs_sequences(b, chain, x3, w, same, residual):
                return True
    return False


def _needs_sequences(block, chain: list[str], x3: Tensor, want: Tensor | None, same, residual: bool = False) -> bool:
    """Whether the MLP takes ``[B, T, d]`` only: called on the rows of the probe's input as one ``[n, d]`` matrix it
    fails or gives another result than ``want`` (None: its own output on ``x3``) (a mixture of experts reads its
    input's shape); ``residual``: with a zero residual (:func:`~mfpipe.models.adapters.residual.mlp_residual`)."""
    def run(y):
        for name in chain:
            y = block.get_submodule(name)(y, *([torch.zeros_like(y)] if residual else []))
            y = first_output(y)
        return y

    try:
        with torch.no_grad():
            x = x3.to(next(block.parameters()).dtype)
            want = run(x).float() if want is None else want
            return not same(run(x[0]).float(), want[0])
    except Exception:
        return True


def embed_scale(base, seen: dict, table, embed_norm: str | None, same) -> tuple[float, int, tuple | None] | str:
    """(the scale the token embedding reaches block 0 with: 1, sqrt(d) or a number of its config; the row offset of
    the position table ``table`` added where there is one; an affine map of the base model's own vectors, :func:`affine_candidates`, where
    it applies one), through the embedding norm ``embed_norm`` where there is one; where none fits, why (the probe
    refuses the model so). Of the forms that fit to the model's rounding (``same``), the closest: a 16-bit model's
    rounding would also let ``e`` stand for ``(e + b) * s`` with ``s`` near 1 (an equally close simpler form wins)."""
    block_in = seen["<first>" if "<first>" in seen else "<block>"].x  # block 0's input (of any kind in a hybrid)
    if embed_norm is not None:  # block 0 reads the norm's output; the norm reads the (scaled) embedding
        if not same(seen[f"<outer>{embed_norm}"].y, block_in):
            return f"its first block does not read its embedding norm {embed_norm}"
        block_in = seen[f"<outer>{embed_norm}"].x
    e = seen["<embed>"].y
    T = e.shape[-2]
    rows = None if table is None else table_rows(table)
    offsets = [0] if rows is None else range(rows.shape[0] - T + 1)
    fits: list[tuple[float, tuple]] = []

    def consider(y: Tensor, found: tuple) -> None:
        y = y.to(block_in.dtype)
        if same(y, block_in):
            fits.append((float((y.float() - block_in.float()).abs().max()), found))

    for offset in offsets[:3]:
        # an absolute position table (GPT-2's learned one; OPT's starts at row 2; XGLM's and CTRL's sinusoidal ones):
        # block 0 reads token + position rows
        pos = 0.0 if rows is None else rows[offset: offset + T].detach().float()
        # the forward may scale the token embedding by sqrt(d) in the model's dtype, before the positions are added
        # (the Gemma family, CTRL: where the embedding module does not do it itself)
        for scale in (1.0, float(base.config.hidden_size) ** 0.5, *_config_scales(base.config)):
            consider((e if scale == 1.0 else e * torch.tensor(scale, dtype=block_in.dtype)) + pos, (scale, offset, None))
    if rows is None:
        for pair, y in affine_candidates(base, seen["<embed>"].y_obj):  # in the embedding's dtype, as the forward
            consider(y, (1.0, 0, pair))
    if fits:
        return min(fits, key=lambda f: f[0])[1]  # the first of equally close ones: the simplest
    return ("its first block reads the token embedding changed in a way mfpipe cannot place (neither as is, nor scaled "
            "by sqrt(d) or a number of its config, nor plus an absolute position table, nor by an affine map of the "
            "base model's own vectors)")


def _config_scales(config) -> list[float]:
    """The numbers of ``config`` an embedding may be multiplied by, not 0 or 1 and not an epsilon's size (Granite's
    ``embedding_multiplier``, MiniCPM's ``scale_emb``: 12 in their checkpoints, 1 in their default configs)."""
    return [float(v) for v in vars(config).values()  # an int too: a config.json may write 12 for 12.0
            if isinstance(v, (int, float)) and not isinstance(v, bool) and 1e-3 <= abs(v) <= 1e4 and v != 1]


def affine_candidates(base, e: Tensor):
    """``((bias, scale), (e + bias) * scale)`` for each pair of the base model's own ``[d]`` parameters (not its
    modules'; either may be None, not both), the embedding module's output ``e`` as block 0 would read it so (Zaya's
    ``input_hidden_states_bias`` / ``_scale``), the pairs before the single ones."""
    own = [n for n, p in base.named_parameters(recurse=False) if p.dim() == 1 and p.shape[0] == e.shape[-1]]
    pairs = [(b, s) for b in own for s in own if b != s] + [(b, None) for b in own] + [(None, s) for s in own]
    with torch.no_grad():
        for pair in pairs:
            yield pair, affine_embedding(base, e, pair)


def affine_embedding(base, e: Tensor, affine: tuple[str | None, str | None]) -> Tensor:
    """``(e + bias) * scale`` with the parameter names ``affine`` of ``base`` (:func:`affine_candidates`; either None:
    left out), in ``e``'s dtype, as the forward computes it."""
    b, s = (None if n is None else base.get_parameter(n).detach() for n in affine)
    y = e if b is None else e + b.to(device=e.device, dtype=e.dtype)
    return y if s is None else y * s.to(device=e.device, dtype=e.dtype)


def head_transform(model, base) -> str | None:
    """The child of the causal LM (not its decoder stack, not its LM head) that its forward runs on the stack's output
    to give what the LM head reads (ModernBERT-decoder's ``lm_head``, a prediction head: dense, GELU, LayerNorm, before
    the unembedding ``decoder``), by one forward of the probe's tokens; None where the LM head reads the stack's output
    itself, no one child does it, or the model is a bare stack."""
    head = model.get_output_embeddings() if model is not base and hasattr(model, "get_output_embeddings") else None
    outer = {n: m for n, m in model.named_children() if m is not base and m is not head
             and any(True for _ in m.parameters())} if head is not None else {}
    if not outer:
        return None
    seen, handles = {}, []

    def hook(name):
        def fn(mod, args, kwargs, out):
            x = args[0] if args else kwargs.get("hidden_states", kwargs.get("input"))
            y = getattr(out, "last_hidden_state", None)
            seen.setdefault(name, (x, y if y is not None else first_output(out)))
        return fn

    for n, m in {"<head>": head, "<base>": base, **outer}.items():
        handles.append(m.register_forward_hook(hook(n), with_kwargs=True))
    vocab = int(getattr(model.config, "vocab_size", 3) or 3)
    try:
        with torch.no_grad():
            model((PROBE_IDS % vocab)[None].to(head.weight.device), use_cache=False)
    finally:
        for h in handles:
            h.remove()

    def same(a, b):  # one tensor, or a slice of its positions (the logits of the kept positions)
        return isinstance(a, Tensor) and isinstance(b, Tensor) and a.shape == b.shape and torch.equal(a, b)

    if "<head>" not in seen or "<base>" not in seen or same(seen["<head>"][0], seen["<base>"][1]):
        return None
    found = [n for n in outer if n in seen and same(seen[n][0], seen["<base>"][1])
             and seen[n][1] is seen["<head>"][0]]
    return found[0] if len(found) == 1 else None


def logit_scale(model, base, mt, transform: str | None = None) -> float:
    """The factor the causal LM's logits are the LM head's output times (Cohere's ``logit_scale``, Granite's
    ``1 / logits_scaling``; 1 for most), from one forward of the probe's tokens; 1 where the model is a bare
    decoder stack or has a soft-cap (whose transform the structure applies itself). ``transform``: the child the LM
    head reads through (:func:`head_transform`)."""
    head = model.get_output_embeddings() if model is not base and hasattr(model, "get_output_embeddings") else None
    if head is None or getattr(model.config, "final_logit_softcapping", None):
        return 1.0
    vocab = int(getattr(model.config, "vocab_size", 3) or 3)
    through = getattr(model, transform) if transform else nn.Identity()
    with torch.no_grad():
        out = model((PROBE_IDS % vocab)[None].to(head.weight.device), use_cache=False, output_hidden_states=True)
        lm, logits = head(through(out.hidden_states[-1])).double(), out.logits.double()
    if logits.shape != lm.shape or torch.allclose(logits, lm, rtol=1e-4, atol=1e-5):
        return 1.0
    c = float((logits * lm).sum() / (lm * lm).sum().clamp_min(1e-30))
    if not torch.allclose(logits, c * lm, rtol=1e-3, atol=1e-4 * float(logits.abs().max())):
        return 1.0  # not a scale: the conformance check's unembedding row says what is wrong
    named = [float(v) for v in vars(model.config).values() if isinstance(v, (int, float)) and not isinstance(v, bool)
             and v]
    for v in named + [1.0 / v for v in named]:  # the config's own number, exactly, where one names the factor
        if abs(v - c) <= 1e-4 * abs(c):
            return v
    return c
