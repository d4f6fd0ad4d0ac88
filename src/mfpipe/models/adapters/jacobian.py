"""Same-position Jacobians of the final residual with respect to the residual stream (the J-lens, paper App. P,
:mod:`mfpipe.jlens`), by plain torch hooks and autograd.

:meth:`~mfpipe.models.adapters.site.TracedSite.run` is mfpipe's read/patch site, but it runs under ``no_grad``; a
Jacobian needs the autograd graph of an ordinary forward, so this module hooks the modules the adapter names
(:meth:`Adapter.block_module`, :meth:`Adapter.out_proj_module`, :meth:`Adapter.final_norm_module`) and knows no
module path itself.

For a batch of windows ``ids [B, T]`` and ONE position ``t_b`` per window, the output is
``y = h^L[b, t_b, :]`` (the final residual, the input of the final norm). Batch rows are independent, so the
gradient of ``sum_b y[b, i]`` with respect to a residual tensor ``x [B, T, d]``, read at ``[b, t_b]``, is exactly
``∂h^L_{b,t_b,i} / ∂x_{b,t_b}``: row ``i`` of the same-position Jacobian of every window at once, for every
insertion point at once. ``d`` backward passes (batched with ``is_grads_batched`` in chunks of ``grad_chunk``)
give the full ``[d, d]`` blocks.

Insertion points (``POINTS``):

* ``"block"``: the residual entering block ``ℓ`` (``ℓ = 0..L-1``) and ``ℓ = L``, the final residual itself, whose
  Jacobian is the identity exactly (the sanity check);
* ``"attn"``: the output of block ``ℓ``'s attention output projection (``c_proj`` / ``dense`` / ``o_proj``), before
  any post-attention norm (Gemma-2, OLMo-2): where a head's write ``O_h z`` lands. There is none at ``ℓ = L``.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

__all__ = ["POINTS", "position_jacobians"]

POINTS = ("block", "attn")

log = logging.getLogger(__name__)


def _hidden(args: tuple, kwargs: dict) -> Tensor:
    if args:
        return args[0]
    if "hidden_states" in kwargs:
        return kwargs["hidden_states"]
    raise RuntimeError("a hooked module was called without its hidden-states input (no positional argument and no "
                       "hidden_states keyword)")


def _replace_hidden(args: tuple, kwargs: dict, x: Tensor) -> tuple[tuple, dict]:
    if args:
        return (x, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": x}


def _rows(g: Tensor, pos: Tensor) -> Tensor:
    """``g [..., B, T, d]`` -> ``sum_b g[..., b, t_b, :]`` in float64 ``[..., d]``."""
    b = torch.arange(pos.numel(), device=g.device)
    return g[..., b, pos, :].double().sum(-2)


def position_jacobians(adapter, ids, positions, *, grad_chunk: int = 16) -> Tensor:
    """``sum_b ∂h^L[b, t_b] / ∂x^p_ℓ[b, t_b]`` as float64 ``[2, L+1, d, d]`` (point, layer, out, in), with
    ``point`` as in :data:`POINTS` and NaN at ``("attn", L)``.

    ``ids [B, T]`` token ids (no padding, no mask), ``positions [B]`` one position per row (``0 <= t_b < T``).
    The windows are cut after the largest position: a causal model's ``h^L[t]`` depends on positions ``<= t``
    only. ``grad_chunk``: backward passes batched in one ``torch.autograd.grad(..., is_grads_batched=True)``
    (``<= 1``: one at a time; a model whose backward cannot be batched falls back to that as well).

    The model runs as it is loaded (eval mode is set for the call), with its parameters' ``requires_grad``
    switched off for the call and restored after: only the residual tensors are differentiated."""
    model, L, d = adapter.model, adapter.n_layers, adapter.d_model
    dev = adapter.device
    ids = torch.as_tensor(ids).to(device=dev, dtype=torch.long)
    pos = torch.as_tensor(positions).to(device=dev, dtype=torch.long).reshape(-1)
    if ids.ndim != 2 or pos.numel() != ids.shape[0]:
        raise ValueError(f"ids must be [B, T] and positions [B], got {tuple(ids.shape)} and {tuple(pos.shape)}")
    if pos.numel() == 0:
        raise ValueError("position_jacobians needs at least one window")
    if int(pos.min()) < 0 or int(pos.max()) >= ids.shape[1]:
        raise ValueError(f"positions must lie in 0..{ids.shape[1] - 1}, got {pos.min().item()}..{pos.max().item()}")
    ids = ids[:, : int(pos.max()) + 1]
    B = ids.shape[0]

    block_in: list[Tensor | None] = [None] * L
    attn_out: list[Tensor | None] = [None] * L
    final: list[Tensor] = []

    def block_hook(layer):
        def hook(module, args, kwargs):
            x = _hidden(args, kwargs)
            if layer == 0:  # the leaf every later residual is a function of
                x = x.detach().requires_grad_(True)
                block_in[0] = x
                return _replace_hidden(args, kwargs, x)
            block_in[layer] = x
            return None

        return hook

    def attn_hook(layer):
        def hook(module, args, out):
            attn_out[layer] = out[0] if isinstance(out, tuple) else out

        return hook

    def final_hook(module, args, kwargs):
        final.append(_hidden(args, kwargs))

    handles = []
    flags = [(p, p.requires_grad) for p in model.parameters()]
    training = model.training
    try:
        for p, _ in flags:
            p.requires_grad_(False)
        model.eval()
        for l in range(L):
            handles.append(adapter.block_module(l).register_forward_pre_hook(block_hook(l), with_kwargs=True))
            handles.append(adapter.out_proj_module(l).register_forward_hook(attn_hook(l)))
        handles.append(adapter.final_norm_module().register_forward_pre_hook(final_hook, with_kwargs=True))
        with torch.enable_grad():
            adapter.base(input_ids=ids, use_cache=False)
            for h in handles:
                h.remove()
            handles = []
            if len(final) != 1 or any(x is None for x in block_in + attn_out):
                raise RuntimeError(f"{adapter.model_type}: the J-lens hooks saw {len(final)} final-norm calls and "
                                   f"{sum(x is None for x in block_in)} / {sum(x is None for x in attn_out)} blocks / "
                                   "output projections were not called")
            hL = final[0]
            inputs = [*block_in, hL, *attn_out]
            y = hL[torch.arange(B, device=dev), pos]  # [B, d]
            rows = torch.zeros(len(inputs), d, d, dtype=torch.float64, device=dev)
            chunk = max(1, int(grad_chunk))
            i0 = 0
            while i0 < d:
                k = min(chunk, d - i0)
                if k > 1:
                    go = torch.zeros(k, B, d, dtype=y.dtype, device=dev)
                    go[torch.arange(k, device=dev), :, torch.arange(i0, i0 + k, device=dev)] = 1
                    try:
                        gs = torch.autograd.grad([y], inputs, grad_outputs=[go], retain_graph=True,
                                                 is_grads_batched=True)
                    except (RuntimeError, NotImplementedError) as e:
                        log.warning("%s: batched backward failed (%s); one backward per output dimension",
                                    adapter.model_type, str(e).splitlines()[0][:200])
                        chunk = 1
                        continue
                    for n, g in enumerate(gs):
                        rows[n, i0 : i0 + k] = _rows(g, pos)
                else:
                    gs = torch.autograd.grad([y[:, i0].sum()], inputs, retain_graph=True)
                    for n, g in enumerate(gs):
                        rows[n, i0] = _rows(g, pos)
                i0 += k
    finally:
        for h in handles:
            h.remove()
        for p, f in flags:
            p.requires_grad_(f)
        model.train(training)
    out = torch.full((2, L + 1, d, d), float("nan"), dtype=torch.float64, device=dev)
    out[0] = rows[: L + 1]
    out[1, :L] = rows[L + 1 :]
    return out
