"""The arguments a model's forward hands its blocks, for running a block on residual rows as sequences of one position
(:func:`~mfpipe.models.adapters.joins.run_block`, a hybrid's other blocks:
:func:`~mfpipe.models.adapters.hybrid.mixer_block`, an output gate of a latent of the attention's input:
:meth:`~mfpipe.models.adapters.gate.OutputGate.read_gate`):
those of a one-token input (:func:`one_token_call`, captured once per adapter), or where the model hands its blocks an
input of each token beside the residual (Gemma-4's per-layer inputs, PLE: :func:`reads_tokens`), those of each row's
own token (:func:`token_call`: the ids given, or those of the enclosing :func:`row_tokens`); where each block hands
the next a state of each position beside the residual (Zaya's router state: :func:`find_carried`), that of the same
rows from the block before, which the caller carries along the blocks it runs in order (:func:`with_carried`). Such
calls made from inside a traced forward (a callback of :meth:`~mfpipe.models.adapters.site.TracedSite.run`) run
under :func:`untraced`."""

from __future__ import annotations

import weakref
from contextlib import contextmanager

import torch
from torch import Tensor, nn

__all__ = ["carried_state", "find_carried", "one_token_call", "one_token_calls", "reads_tokens", "row_tokens",
           "token_call", "untraced", "with_carried"]


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


def reads_tokens(base: nn.Module, blocks, device, carried: tuple[int, int] | None = None) -> bool:
    """Whether the model hands its blocks an input of each token beside the residual (Gemma-4's per-layer inputs,
    PLE): the arguments of a one-token call differ between two tokens (but for a state the previous block returns,
    ``carried``: :func:`carried_state`)."""
    def drop(call):
        args = list(call[0])
        if carried is not None and carried[0] < len(args):
            args[carried[0]] = None
        return tuple(args), call[1]

    a, b = (one_token_calls(base, blocks, device, torch.tensor([t])) for t in (0, 1))
    return any(_differ(drop(a[l]), drop(b[l])) for l in a)


@torch.no_grad()
def find_carried(base: nn.Module, blocks, device) -> tuple[int, int] | None:
    """``(k, j)`` where each block after the first is handed, as its positional argument ``k`` after the hidden states,
    the very tensor the block before it returned as its output ``j`` beside the residual (Zaya's router state: the
    next block's router adds it to its own), by one forward of one token; None where no block is (every other model).
    Such a state is each position's own, carried along the blocks: :func:`with_carried`."""
    outs: dict[int, tuple] = {}
    calls = {}
    handles = [b.register_forward_hook(lambda m, a, o, l=l: outs.__setitem__(l, o if isinstance(o, tuple) else ()))
               for l, b in enumerate(blocks)]
    handles += [b.register_forward_pre_hook(lambda m, a, l=l: calls.__setitem__(l, a[1:]))
                for l, b in enumerate(blocks)]
    try:
        base(torch.zeros(1, 1, dtype=torch.long, device=device), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    found = {(k, j) for l in range(1, len(blocks)) for k, a in enumerate(calls.get(l, ()))
             for j, o in enumerate(outs.get(l - 1, ())) if j >= 1 and isinstance(a, Tensor) and a is o}
    return next(iter(found)) if len(found) == 1 else None


def carried_state(adapter) -> tuple[int, int] | None:
    """:func:`find_carried` of ``adapter``'s model, found once per adapter."""
    if adapter not in _CARRIED:
        _CARRIED[adapter] = find_carried(adapter.base, [adapter.block_module(l) for l in range(adapter.n_layers)],
                                         adapter.device)
    return _CARRIED[adapter]


def with_carried(adapter, layer: int, call: tuple[tuple, dict], carry: dict | None) -> tuple[tuple, dict]:
    """``call`` with the state the block before ``layer`` returned for the same rows (``carry["state"]``, kept by the
    caller along the blocks it runs in order: :func:`~mfpipe.models.adapters.joins.run_block` writes it) in place of
    the one-token forward's, where the model carries such a state (:func:`carried_state`) and hands block ``layer``
    one (the first block: none)."""
    carried = carried_state(adapter)
    if carried is None or carried[0] >= len(call[0]) or call[0][carried[0]] is None:
        return call
    if carry is None or carry.get("state") is None:
        raise ValueError(f"block {layer} of {getattr(adapter, 'name', 'the model')} reads a state the block before "
                         "it returns beside the residual (Zaya's router state): run the blocks in order on the same "
                         "rows with one carry={} dict (it holds the state between them)")
    args = list(call[0])
    args[carried[0]] = carry["state"]
    return tuple(args), call[1]


@contextmanager
def untraced(adapter):
    """Within the block, calls of ``adapter``'s modules run as plain torch calls, where they are made from inside one
    of its nnsight traces (a callback of ``run``: the gate of a residual row, AXK-2's through its block's own code).
    nnsight hands every module call of a running trace to the trace's workers: a call made by a worker would be served
    to the workers parked at that module (the values of another input) or fail (``cyclic parent chain``), and it
    would count as an occurrence of the module. The trace's model forward is paused while its worker runs this."""
    paused = []
    for envoy in (getattr(adapter, "_envoy", None), getattr(adapter, "_lm_envoy", None)):
        interleaver = None if envoy is None else envoy.interleaver
        if interleaver is not None and interleaver.interleaving:  # nnsight: "hooks pass values straight through"
            interleaver.interleaving = False
            paused.append(interleaver)
    try:
        yield
    finally:
        for interleaver in paused:
            interleaver.interleaving = True


_CALLS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # adapter -> {layer: (args, kwargs)}
_TOKENS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # adapter -> (reads tokens, (ids, calls) or None)
_ROWS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # adapter -> the token ids of the rows run now
_CARRIED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # adapter -> find_carried's answer


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
        _TOKENS[adapter] = (reads_tokens(adapter.base, blocks, adapter.device, carried_state(adapter)), None)
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
