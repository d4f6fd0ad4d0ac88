"""Blocks whose branches join the residual in a form of their own (``Structure.join == "model"``), run by the block's
own code: Doge's ``a ⊙ x + attn`` and ``b ⊙ mid + mlp`` with learned vectors, Beam's depth-scaled sums, MiniMax's
branches added to a norm of the residual (Zaya's residual-scaling modules and Dory's interpolation on the unit sphere
would be too; other parts of those models keep them refused). Each is a function of a position's own residual and attention branch; the model computes it, so mfpipe does
not write it out again.

:func:`run_block` runs block ``layer`` on residual rows, each a sequence of one position (the arguments the model's
forward hands the block on a one-token input: :func:`one_token_calls`), with its attention module's output replaced by
the given attention branch (the output projection's output, before any post-norm: what the attention returns): the
rollout's block step at the mean-field branch, and the residual the MLP branch reads (its norm's input). The placement
accepts such a join only where the block's output at every position of the probe forward is what
:func:`check_per_position` gets from that position alone: an attention branch mixed over positions after the attention
(Inkling's convolutions) stays refused.

A block the model hands an input of each token beside the residual (Gemma-4's per-layer inputs, PLE: after the MLP
``h + norm(W_p(act(W_g h) ⊙ e_l(token)))``, ``e_l`` a function of the token alone) is such a join too: its rows run
with the arguments of their own tokens (:func:`token_call`, a batch of one-token sequences of those ids), which
:func:`run_block` takes as ``ids`` or from an enclosing :func:`row_tokens` (a rollout's rows are its tracked types'
centroids: each row's token is its type, :func:`mfpipe.experiments.rollout.algorithm.on_types`)."""

from __future__ import annotations

import weakref
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from mfpipe.models.adapters.capture import first_output, hidden_input
from mfpipe.models.adapters.probe import PROBE_IDS, UnsupportedArchitectureError, submodule
from mfpipe.models.adapters.streaming import held

__all__ = ["check_per_position", "one_token_call", "one_token_calls", "reads_tokens", "row_tokens", "run_block",
           "token_call"]


@torch.no_grad()
def one_token_calls(base: nn.Module, blocks, device, ids: Tensor | None = None) -> dict[int, tuple[tuple, dict]]:
    """Per block: (the positional arguments after the hidden states, the keyword arguments) the forward of ``base``
    calls it with on one-token inputs, without its hidden states (no cache is kept): token 0 alone, or ``ids [N]`` as
    a batch of N sequences of one token each (the arguments of a block that reads each token's own input, Gemma-4's
    per-layer inputs, are then each row's)."""
    calls: dict[int, tuple[tuple, dict]] = {}

    def hook(l):
        def pre(mod, args, kwargs):
            calls[l] = (tuple(args[1:]), {k: v for k, v in kwargs.items() if k != "hidden_states"})
        return pre

    tokens = torch.zeros(1, 1, dtype=torch.long) if ids is None else torch.as_tensor(ids, dtype=torch.long).reshape(-1, 1)
    handles = [b.register_forward_pre_hook(hook(l), with_kwargs=True) for l, b in enumerate(blocks)]
    try:
        base(tokens.to(device), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return calls


def _differ(a, b) -> bool:
    if isinstance(a, Tensor) and isinstance(b, Tensor):
        return a.shape != b.shape or not torch.equal(a, b)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) != len(b) or any(_differ(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() != b.keys() or any(_differ(a[k], b[k]) for k in a)
    return False


def reads_tokens(base: nn.Module, blocks, device) -> bool:
    """Whether the model hands its blocks an input of each token beside the residual (Gemma-4's per-layer inputs,
    PLE): the arguments of a one-token call differ between two tokens."""
    a, b = (one_token_calls(base, blocks, device, torch.tensor([t])) for t in (0, 1))
    return any(_differ(a[l], b[l]) for l in a)


_CALLS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # adapter -> {layer: (args, kwargs)}
_TOKENS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # adapter -> (reads tokens, (ids, calls) or None)
_ROWS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # adapter -> the token ids of the rows run now


@contextmanager
def row_tokens(adapter, ids):
    """Within the block: the residual rows ``adapter``'s blocks are run on (:func:`run_block` without ``ids``) are of
    the tokens ``ids [N]``: a rollout's rows are its tracked types' centroids, each of its type's token."""
    before = _ROWS.get(adapter)
    _ROWS[adapter] = torch.as_tensor(ids, dtype=torch.long).reshape(-1).cpu()
    try:
        yield
    finally:
        if before is None:
            _ROWS.pop(adapter, None)
        else:
            _ROWS[adapter] = before


def one_token_call(adapter, layer: int) -> tuple[tuple, dict]:
    """:func:`one_token_calls` of ``adapter``'s model for block ``layer``, captured once per adapter."""
    calls = _CALLS.get(adapter)
    if calls is None:
        calls = _CALLS[adapter] = one_token_calls(
            adapter.base, [adapter.block_module(l) for l in range(adapter.n_layers)], adapter.device)
    return calls[layer]


def token_call(adapter, layer: int, ids: Tensor | None, rows: int) -> tuple[tuple, dict]:
    """The arguments block ``layer`` runs ``rows`` one-position rows with: :func:`one_token_call`'s, or where the
    model hands its blocks an input of each token (:func:`reads_tokens`), those of the rows' tokens ``ids [rows]``
    (required then, or those of the enclosing :func:`row_tokens`; the last ids' calls are kept: a rollout asks for the
    same rows layer after layer)."""
    blocks = [adapter.block_module(l) for l in range(adapter.n_layers)]
    if adapter not in _TOKENS:
        _TOKENS[adapter] = (reads_tokens(adapter.base, blocks, adapter.device), None)
    reads, kept = _TOKENS[adapter]
    if not reads:
        return one_token_call(adapter, layer)
    ids = _ROWS.get(adapter) if ids is None else ids
    if ids is None:
        raise ValueError(f"block {layer} of {getattr(adapter, 'name', 'the model')} adds an input of each token (a "
                         "per-layer input, PLE): running it on residual rows needs the rows' token ids (ids=)")
    ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1).cpu()
    if ids.numel() != rows:
        raise ValueError(f"{ids.numel()} token ids for {rows} residual rows")
    if kept is None or not torch.equal(kept[0], ids):
        kept = (ids, one_token_calls(adapter.base, blocks, adapter.device, ids))
        _TOKENS[adapter] = (True, kept)
    return kept[1][layer]


def _replaced(attn: nn.Module, branch: Tensor):
    """A forward hook on ``attn`` that returns ``branch`` as its output ``[0]`` (its other outputs kept)."""
    def hook(mod, args, out):
        if isinstance(out, tuple):
            return (branch.to(first_output(out).dtype), *out[1:])
        if isinstance(out, list):  # GPT-1's attentions return lists
            return [branch.to(out[0].dtype), *out[1:]]
        return branch.to(out.dtype)
    return attn.register_forward_hook(hook)


def _call(block, rows: Tensor, call: tuple[tuple, dict], attn: nn.Module, branch: Tensor, grab: nn.Module | None):
    seen: list[Tensor] = []
    handles = [_replaced(attn, branch)]
    if grab is not None:
        handles.append(grab.register_forward_pre_hook(
            lambda mod, args, kwargs: seen.append(hidden_input(args, kwargs)) if not seen else None, with_kwargs=True))
    try:
        with held(block):
            y = first_output(block(rows, *call[0], **call[1]))
    finally:
        for h in handles:
            h.remove()
    return y, (seen[0] if seen else None)


@torch.no_grad()
def run_block(adapter, layer: int, x: Tensor, branch: Tensor, ids: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``(mlp_in, out)``, float32 ``[N, d]``: block ``layer`` on the rows ``x [N, d]`` with its attention's output
    replaced by ``branch [N, d]`` (what the attention module returns: the output projection's output plus its bias),
    each row a sequence of one position; ``mlp_in`` is what the MLP's norm (or the MLP, without one) reads, ``out``
    the residual the block hands on. ``ids [N]``: each row's token, which a block reading an input of each token
    (Gemma-4's per-layer inputs) needs (:func:`token_call`): a type centroid's is its type's."""
    s = adapter.structure
    block = adapter.block_module(layer)
    d = x.shape[-1]
    rows = x.reshape(-1, 1, d).to(device=adapter.device, dtype=adapter.dtype)
    first = s.mlp_norm or (s.mlp_chain[0] if s.mlp_chain else s.mlp)
    y, mlp_in = _call(block, rows, token_call(adapter, layer, ids, rows.shape[0]), submodule(block, s.attn),
                      branch.reshape(-1, 1, d).to(device=adapter.device), submodule(block, first) if first else None)
    mlp_in = rows if mlp_in is None else mlp_in
    return mlp_in.reshape(x.shape).float(), y.reshape(x.shape).float()


@torch.no_grad()
def check_per_position(base: nn.Module, blocks, at: int, attn_path: str, mt) -> None:
    """Refuses a block whose output at some position of a probe forward is not what the block gives that position
    alone, as one-position sequence with the attention's output it had (:func:`run_block`'s premise)."""
    block, attn = blocks[at], submodule(blocks[at], attn_path)
    rec: dict[str, Tensor] = {}

    def keep(key, t):  # a hook that returns None: the forward unchanged
        rec.setdefault(key, t)

    handles = [block.register_forward_pre_hook(lambda m, a, k: keep("x", hidden_input(a, k)), with_kwargs=True),
               block.register_forward_hook(lambda m, a, o: keep("y", first_output(o))),
               attn.register_forward_hook(lambda m, a, o: keep("a", first_output(o)))]
    device = next(base.parameters()).device
    vocab = int(getattr(base.config, "vocab_size", 3) or 3)
    try:
        base((PROBE_IDS % vocab)[None].to(device), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    x, a = rec["x"][0][:, None], rec["a"][0][:, None]  # [T, 1, d]: each position a sequence of its own, of its token
    y, _ = _call(block, x, one_token_calls(base, blocks, device, PROBE_IDS % vocab)[at], attn, a, None)
    want, got = rec["y"][0].float(), y[:, 0].float()
    eps = max(1e-6, 4 * torch.finfo(y.dtype).eps)  # the model's rounding (y: the block's output, in its dtype)
    if not torch.allclose(got, want, rtol=10 * eps, atol=eps * float(want.abs().max().clamp_min(1))):
        raise UnsupportedArchitectureError(mt, "its blocks join the attention branch to the residual in a form of "
                                               "their own, and a block's output at a position depends on more than "
                                               "that position's residual and attention branch")
