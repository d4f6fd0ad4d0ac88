"""Blocks whose branches join the residual in a form of their own (``Structure.join == "model"``), run by the block's
own code: Doge's ``a ⊙ x + attn`` and ``b ⊙ mid + mlp`` with learned vectors, Beam's depth-scaled sums, MiniMax's
branches added to a norm of the residual, Zaya's residual-scaling modules (``(a + b1) ⊙ s1 + (x + b2) ⊙ s2``; its
blocks also hand the next one their router state: ``carry`` below); Dory's interpolation on the unit sphere would be
too (other parts of it keep it refused). Each is a function of a position's own residual and attention branch (and
of a state the block before handed on); the model computes it, so mfpipe does not write it out again.

:func:`run_block` runs block ``layer`` on residual rows, each a sequence of one position (the arguments the model's
forward hands the block on a one-token input: :func:`~mfpipe.models.adapters.calls.one_token_calls`), with its
attention module's output replaced by the given attention branch (the output projection's output, before any
post-norm: what the attention returns): the
rollout's block step at the mean-field branch, and the residual the MLP branch reads (its norm's input). The placement
accepts such a join only where the block's output at every position of the probe forward is what
:func:`check_per_position` gets from that position alone (Inkling's convolutions over positions after its branches
are no such join: they take the post-norm's role, :mod:`~mfpipe.models.adapters.convolved`).

A block the model hands an input of each token beside the residual (Gemma-4's per-layer inputs, PLE: after the MLP
``h + norm(W_p(act(W_g h) ⊙ e_l(token)))``, ``e_l`` a function of the token alone) is such a join too: its rows run
with the arguments of their own tokens (:func:`~mfpipe.models.adapters.calls.token_call`, a batch of one-token
sequences of those ids), which :func:`run_block` takes as ``ids`` or from an enclosing
:func:`~mfpipe.models.adapters.calls.row_tokens` (a rollout's rows are its tracked types' centroids: each row's token
is its type, :func:`mfpipe.experiments.rollout.algorithm.on_types`)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from mfpipe.models.adapters.calls import carried_state, one_token_calls, token_call, with_carried
from mfpipe.models.adapters.capture import first_output, hidden_input
from mfpipe.models.adapters.probe import PROBE_IDS, UnsupportedArchitectureError, submodule
from mfpipe.models.adapters.streaming import held

__all__ = ["check_per_position", "run_block"]


def _replaced(attn: nn.Module, branch: Tensor):
    """A forward hook on ``attn`` that returns ``branch`` as its output ``[0]`` (its other outputs kept)."""
    def hook(mod, args, out):
        if isinstance(out, tuple):
            return (branch.to(first_output(out).dtype), *out[1:])
        if isinstance(out, list):  # GPT-1's attentions return lists
            return [branch.to(out[0].dtype), *out[1:]]
        return branch.to(out.dtype)
    return attn.register_forward_hook(hook)


def _call(block, rows: Tensor, call: tuple[tuple, dict], attn: nn.Module, branch: Tensor, grab: nn.Module | None,
          out: list | None = None):
    seen: list[Tensor] = []
    handles = [_replaced(attn, branch)]
    if grab is not None:
        handles.append(grab.register_forward_pre_hook(
            lambda mod, args, kwargs: seen.append(hidden_input(args, kwargs)) if not seen else None, with_kwargs=True))
    try:
        with held(block):
            raw = block(rows, *call[0], **call[1])
            y = first_output(raw)
            if out is not None:  # the block's whole output (a state it returns beside the residual: calls.with_carried)
                out.append(raw)
    finally:
        for h in handles:
            h.remove()
    return y, (seen[0] if seen else None)


@torch.no_grad()
def run_block(adapter, layer: int, x: Tensor, branch: Tensor, ids: Tensor | None = None,
              carry: dict | None = None) -> tuple[Tensor, Tensor]:
    """``(mlp_in, out)``, float32 ``[N, d]``: block ``layer`` on the rows ``x [N, d]`` with its attention's output
    replaced by ``branch [N, d]`` (what the attention module returns: the output projection's output plus its bias),
    each row a sequence of one position; ``mlp_in`` is what the MLP's norm (or the MLP, without one) reads, ``out``
    the residual the block hands on. ``ids [N]``: each row's token, which a block reading an input of each token
    (Gemma-4's per-layer inputs) needs (:func:`~mfpipe.models.adapters.calls.token_call`): a type centroid's is
    its type's. ``carry``: where the blocks hand each other a state of each position beside the residual (Zaya's router
    state: :func:`~mfpipe.models.adapters.calls.with_carried`), the dict that keeps it between the blocks a caller
    runs in order on the same rows (``{}`` before the first; this block's state is left in it)."""
    s = adapter.structure
    block = adapter.block_module(layer)
    d = x.shape[-1]
    rows = x.reshape(-1, 1, d).to(device=adapter.device, dtype=adapter.dtype)
    first = s.mlp_norm or (s.mlp_chain[0] if s.mlp_chain else s.mlp)
    call = with_carried(adapter, layer, token_call(adapter, layer, ids, rows.shape[0]), carry)
    raw: list = []
    y, mlp_in = _call(block, rows, call, submodule(block, s.attn), branch.reshape(-1, 1, d).to(device=adapter.device),
                      submodule(block, first) if first else None, raw)
    if carry is not None and (carried := carried_state(adapter)) is not None:
        carry["state"] = raw[0][carried[1]]
    mlp_in = rows if mlp_in is None else mlp_in
    return mlp_in.reshape(x.shape).float(), y.reshape(x.shape).float()


@torch.no_grad()
def check_per_position(base: nn.Module, blocks, at: int, attn_path: str, mt,
                       branch_at_projection: bool = False) -> None:
    """Refuses a block whose output at some position of a probe forward is not what the block gives that position
    alone, as one-position sequence with the attention's output it had (:func:`run_block`'s premise), or whose
    attention's output is not its branch (``branch_at_projection``: BLOOM's adds the residual, GIT's projection sits
    beside it): :func:`run_block` replaces that output by the branch."""
    if branch_at_projection:
        raise UnsupportedArchitectureError(mt, "its branches join the residual in a form of the block's own, and its "
                                               "attention's output is not its branch (the residual added in it, or "
                                               "the output projection beside it): mfpipe runs such a join by "
                                               "replacing the attention's output with the branch")
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
