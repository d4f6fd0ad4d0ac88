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

Those ``d`` backward passes are the cost, so each runs through one position only: positions before ``t_b`` do not
depend on ``x_{t_b}`` (causal attention), so their keys and values are constants of the Jacobian, and the rows of
one ``t`` run their prefix once without a graph, into the model's key/value cache, and then token ``t`` alone with
the graph (``prefix_cache``; a model without a cache runs each window whole, the same Jacobian up to rounding).

Insertion points (``POINTS``):

* ``"block"``: the residual entering block ``ℓ`` (``ℓ = 0..L-1``) and ``ℓ = L``, the final residual itself, whose
  Jacobian is the identity exactly (the sanity check);
* ``"attn"``: the output of block ``ℓ``'s attention output projection (``c_proj`` / ``dense`` / ``o_proj``), before
  any post-attention norm (Gemma-2, OLMo-2): where a head's write ``O_h z`` lands. There is none at ``ℓ = L``.
"""

from __future__ import annotations

import inspect
import logging
from typing import NamedTuple

import torch
from torch import Tensor

from mfpipe.models.adapters.backward16 import WIDE_ROWS, applies, fast_input_grads

__all__ = ["POINTS", "position_jacobians", "cache_tolerance", "cache_keyword", "returned_cache", "final_residual",
           "NoCache", "final_residual_hook"]

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


class _Groups(NamedTuple):
    """The group sums asked of :func:`position_jacobians`: ``member [n, B]`` float64, 1 where row ``b`` is in group
    ``g`` (else 0), ``n`` the number of groups, ``keep [r]`` the output dimensions whose rows are summed per group."""

    member: Tensor
    n: int
    keep: Tensor


def _rows(g: Tensor, pos: Tensor, keep: Tensor | None = None):
    """``g [..., B, T, d]`` -> ``sum_b g[..., b, t_b, :]`` in float64 ``[..., d]``; with ``keep`` (indices into the
    leading dim of ``g``, or ``[0]`` where ``g`` has none: ``[B, T, d]``), also those rows per batch row, unsummed:
    ``g[keep, b, t_b, :]`` in float64 ``[len(keep), B, d]`` (the group sums are taken from them)."""
    b = torch.arange(pos.numel(), device=g.device)
    v = g[..., b, pos, :].double()
    total = v.sum(-2)
    if keep is None:
        return total
    return total, v.reshape(-1, *v.shape[-2:])[keep]


def position_jacobians(adapter, ids, positions, *, grad_chunk: int = 16, prefix_cache: bool = True,
                       rows: int | None = None, groups=None, group_rows=None, n_groups: int | None = None
                       ) -> Tensor | tuple[Tensor, Tensor]:
    """``sum_b ∂h^L[b, t_b] / ∂x^p_ℓ[b, t_b]`` as float64 ``[2, L+1, d, d]`` (point, layer, out, in), with
    ``point`` as in :data:`POINTS` and NaN at ``("attn", L)``; with ``groups``, ``(total, by_group)``.

    ``ids [B, T]`` token ids (no padding, no mask), ``positions [B]`` one position per row (``0 <= t_b < T``).
    ``grad_chunk``: backward passes batched in one ``torch.autograd.grad(..., is_grads_batched=True)`` (``<= 1``: one
    at a time; a model whose backward cannot be batched falls back to that as well).

    ``prefix_cache`` (default): a causal model's prefix ``< t`` does not depend on ``x_t``, so its keys and values
    are constants of the Jacobian. The rows of each distinct ``t`` run their prefix once without a graph (the model's
    own key/value cache), then token ``t`` alone with the graph: each backward pass runs through one position instead
    of ``t + 1`` (the backward passes are the cost: ``d`` of them; ``benchmarks/jlens.py`` times both). A model
    whose forward takes or honours no key/value cache falls back, with a log line, to ``prefix_cache=False``: every
    window cut after the largest position and run whole, each backward through every position (the same Jacobian,
    up to float rounding; tests tie the two).

    ``rows``: only the first ``rows`` output dimensions (rows of every block; the others NaN), ``rows`` backward
    passes instead of ``d``: ``benchmarks/jlens.py`` times a share of the passes of a shape too slow to run whole.

    ``groups [B]`` (int, ``0..G-1``; ``G = n_groups``, default ``max(groups) + 1``): the group of each row. Then the
    call returns ``(total, by_group)``: ``total`` the sum above, computed exactly as without ``groups`` (the same
    operations in the same order, bit for bit), and ``by_group`` float64 ``[G, 2, L+1, r, d]``, the sums over each
    group's rows of the same per-row Jacobians restricted to the output dimensions ``group_rows`` (``r`` indices in
    ``0..d-1``, default all ``d``), NaN where ``total`` is (``("attn", L)``, output dimensions ``>= rows``). Their sum
    over the groups is ``total[:, :, group_rows]`` up to float64 rounding (the J-lens checks of
    :mod:`mfpipe.jlens.checks` compare disjoint position samples this way without a second backward pass; the
    ``group_rows`` bound their memory to ``G (2L+1) r d`` on a real model).

    The model runs as it is loaded (eval mode is set for the call), with its parameters' ``requires_grad``
    switched off for the call and restored after: only the residual tensors are differentiated."""
    model = adapter.model
    dev = adapter.device
    ids = torch.as_tensor(ids).to(device=dev, dtype=torch.long)
    pos = torch.as_tensor(positions).to(device=dev, dtype=torch.long).reshape(-1)
    if ids.ndim != 2 or pos.numel() != ids.shape[0]:
        raise ValueError(f"ids must be [B, T] and positions [B], got {tuple(ids.shape)} and {tuple(pos.shape)}")
    if pos.numel() == 0:
        raise ValueError("position_jacobians needs at least one window")
    if int(pos.min()) < 0 or int(pos.max()) >= ids.shape[1]:
        raise ValueError(f"positions must lie in 0..{ids.shape[1] - 1}, got {pos.min().item()}..{pos.max().item()}")
    grp = None if groups is None else _group_spec(adapter, groups, n_groups, group_rows, pos.numel())
    flags = [(p, p.requires_grad) for p in model.parameters()]
    training = model.training
    try:
        for p, _ in flags:
            p.requires_grad_(False)
        model.eval()
        with fast_input_grads(model):  # a 16-bit model on a CPU: its linear layers' backward in float32 (backward16)
            # a hybrid's cache holds a state-space or recurrent state its next token updates in place: no backward
            if prefix_cache and not getattr(adapter, "hybrid", False):
                try:
                    total, by = _cached_prefix(adapter, ids, pos, grad_chunk, rows, grp)
                    return total if grp is None else (total, by)
                except NoCache as e:
                    log.warning("%s: no key/value cache (%s); the J-lens runs every window whole", adapter.model_type,
                                e)
            ids = ids[:, : int(pos.max()) + 1]  # h^L[t] depends on positions <= t only
            total, _, by = _blocks(adapter, lambda: adapter.base(input_ids=ids, use_cache=False), pos, grad_chunk,
                                   rows, grp)
            return total if grp is None else (total, by)
    finally:
        for p, f in flags:
            p.requires_grad_(f)
        model.train(training)


def _group_spec(adapter, groups, n_groups, group_rows, B: int) -> _Groups:
    """``groups``, ``n_groups`` and ``group_rows`` of :func:`position_jacobians`, checked, on the adapter's device."""
    d, dev = adapter.d_model, adapter.device
    index = torch.as_tensor(groups).to(device=dev, dtype=torch.long).reshape(-1)
    if index.numel() != B or int(index.min()) < 0:
        raise ValueError(f"groups must be [B] = [{B}] group indices >= 0, got shape {tuple(index.shape)}")
    n = int(index.max()) + 1 if n_groups is None else int(n_groups)
    if int(index.max()) >= n:
        raise ValueError(f"groups holds group {int(index.max())}, but n_groups is {n}")
    keep = torch.arange(d) if group_rows is None else torch.as_tensor(group_rows)
    keep = keep.to(device=dev, dtype=torch.long).reshape(-1)
    if keep.numel() == 0 or int(keep.min()) < 0 or int(keep.max()) >= d:
        raise ValueError(f"group_rows must be output dimensions in 0..{d - 1}, got {keep.numel()} of them")
    member = (index[None, :] == torch.arange(n, device=dev)[:, None]).double()
    return _Groups(member, n, keep)


class NoCache(RuntimeError):
    """The model's forward gave no key/value cache to run a token after its prefix with."""


def _cached_prefix(adapter, ids: Tensor, pos: Tensor, grad_chunk: int, rows_out: int | None = None,
                   groups: _Groups | None = None) -> tuple[Tensor, Tensor | None]:
    """:func:`position_jacobians` with the prefix of each row held as the model's key/value cache: ``(total,
    by_group)``, ``by_group`` None without ``groups``."""
    d, dev = adapter.d_model, adapter.device
    kwarg = cache_keyword(adapter.base)
    total, checked, by_group = 0, False, 0
    for t in torch.unique(pos).tolist():
        rows = torch.nonzero(pos == t).reshape(-1)
        token = ids[rows, t : t + 1]
        if t == 0:  # nothing before it
            def run(token=token):
                return adapter.base(input_ids=token, use_cache=False)
        else:
            try:
                with torch.no_grad():
                    cache = returned_cache(adapter.base(input_ids=ids[rows, :t], use_cache=True))
            except TypeError as e:  # a forward without use_cache
                raise NoCache(str(e).splitlines()[0][:200]) from e
            if cache is None:
                raise NoCache("its forward returned no cache")

            def run(token=token, cache=cache):
                try:
                    return adapter.base(input_ids=token, use_cache=True, **{kwarg: cache})
                except TypeError as e:
                    raise NoCache(str(e).splitlines()[0][:200]) from e
        # a pass through one token holds 1 / (t + 1) of what a pass through the whole window holds: on a GPU the same
        # memory takes (t + 1) times as many passes at once, one call instead of t + 1 launch-bound small ones (a
        # CPU runs the wide batched passes slower than grad_chunk at a time: benchmarks/HISTORY.md, "The J-lens")
        chunk = min(d, max(1, int(grad_chunk)) * ((t + 1) if dev.type == "cuda" else 1))
        if applies(adapter.model):  # each backward widens every weight to float32 once: over WIDE_ROWS rows at least
            chunk = min(d, max(chunk, WIDE_ROWS))
        sub = None if groups is None else groups._replace(member=groups.member[:, rows])
        out, y, by = _blocks(adapter, run, torch.zeros(len(rows), dtype=torch.long, device=dev), chunk, rows_out, sub)
        if t > 0 and not checked:
            # a forward that takes past_key_values but does not attend to them would put the token at position 0
            # of an empty context: its final residual must be the whole window's at t (a token without its context
            # is O(1) apart; the same sums in another order, a 16-bit model's one-token and whole-window kernels,
            # are a few units of its rounding apart: 3.9e-3 for Gemma-2's shape in bfloat16, issue 58)
            ref = final_residual(adapter, ids[rows, : t + 1])[:, t]
            err = float((y.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))
            if not err < cache_tolerance(y.dtype):
                raise NoCache(f"the token after its cached prefix gave another final residual than the whole window "
                               f"(relative difference {err:.2g}, above {cache_tolerance(y.dtype):.2g})")
            checked = True
        total = total + out
        if groups is not None:
            by_group = by_group + by
    return total, (None if groups is None else by_group)


def cache_tolerance(dtype) -> float:
    """The relative difference above which the token after its cached prefix is refused as another final residual
    than the whole window's: 1e-3, or eight units of rounding of a coarser ``dtype`` (bfloat16: 0.0625, float16:
    7.8e-3)."""
    return max(1e-3, 8 * float(torch.finfo(dtype).eps))


def cache_keyword(module) -> str:
    """The keyword a base model's forward takes its key/value cache by: ``cache`` (transformers >= 5.2x, where
    ``past_key_values`` is deprecated) or ``past_key_values`` (earlier, and a forward taking ``**kwargs``)."""
    params = inspect.signature(module.forward).parameters
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return "past_key_values"
    raise NoCache(f"{type(module).__name__}.forward takes no cache (neither cache nor past_key_values)")


def returned_cache(out):
    """The key/value cache of a base model's output (``cache`` or ``past_key_values``), else None."""
    if isinstance(out, dict):  # transformers' ModelOutput: only the fields that were set
        for name in ("cache", "past_key_values"):
            if out.get(name) is not None:
                return out[name]
    return None


def final_residual_hook(adapter, fn):
    """A hook that calls ``fn(x)`` with the final residual ``x [B, T, d]`` (the final norm's input) in each forward of
    the decoder stack; its handle. Where the final norm is also the embedding's (NanoChat's one norm, which reads the
    embedding first), or where there is none, the last block's output."""
    s = adapter.structure
    if s.final_norm is None or s.embed_norm == s.final_norm:
        return adapter.block_module(adapter.n_layers - 1).register_forward_hook(
            lambda module, args, out: fn(out[0] if isinstance(out, tuple) else out))
    return adapter.final_norm_module().register_forward_pre_hook(
        lambda module, args, kwargs: fn(_hidden(args, kwargs)), with_kwargs=True)


def final_residual(adapter, ids: Tensor) -> Tensor:
    """The input of the final norm, ``[B, T, d]``, of one forward without a graph."""
    seen: list[Tensor] = []
    handle = final_residual_hook(adapter, seen.append)
    try:
        with torch.no_grad():
            adapter.base(input_ids=ids, use_cache=False)
    finally:
        handle.remove()
    return seen[0]


def _blocks(adapter, run, pos: Tensor, grad_chunk: int, rows_out: int | None = None,
            groups: _Groups | None = None) -> tuple[Tensor, Tensor, Tensor | None]:
    """The Jacobian blocks of one forward ``run()`` (hooked here), row ``b`` read at position ``pos[b]``: float64
    ``[2, L+1, d, d]`` summed over rows (``rows_out`` output dimensions, the rest NaN); the final residual ``[B, d]``;
    with ``groups``, the per-group sums of the kept rows ``[G, 2, L+1, r, d]`` (else None)."""
    L, d, dev = adapter.n_layers, adapter.d_model, adapter.device
    d_out = d if rows_out is None else max(1, min(int(rows_out), d))
    B = pos.numel()
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

    handles = []
    A = list(getattr(adapter, "attention_layers", range(L)))  # a hybrid's other layers: no attention output (NaN)
    try:
        for l in range(L):
            handles.append(adapter.block_module(l).register_forward_pre_hook(block_hook(l), with_kwargs=True))
        for l in A:
            handles.append(adapter.out_proj_module(l).register_forward_hook(attn_hook(l)))
        handles.append(final_residual_hook(adapter, final.append))
        with torch.enable_grad():
            run()
            for h in handles:
                h.remove()
            handles = []
            if len(final) != 1 or any(x is None for x in block_in + [attn_out[l] for l in A]):
                raise RuntimeError(f"{adapter.model_type}: the J-lens hooks saw {len(final)} final-norm calls and "
                                   f"{sum(x is None for x in block_in)} / {sum(x is None for x in attn_out)} blocks / "
                                   "output projections were not called")
            hL = final[0]
            y = hL[torch.arange(B, device=dev), pos]  # [B, d]
            rows, by = _backward_rows(adapter, y, [*block_in, hL, *(attn_out[l] for l in A)], pos, grad_chunk, d_out,
                                      groups)
    finally:
        for h in handles:
            h.remove()
    rows[:, d_out:] = float("nan")
    out = torch.full((2, L + 1, d, d), float("nan"), dtype=torch.float64, device=dev)
    out[0] = rows[: L + 1]
    out[1, A] = rows[L + 1 :]
    by_out = None
    if groups is not None:
        by_out = torch.full((groups.n, 2, L + 1, len(groups.keep), d), float("nan"), dtype=torch.float64, device=dev)
        by_out[:, 0] = by[:, : L + 1]
        by_out[:, 1, A] = by[:, L + 1 :]
    return out, y.detach(), by_out


def _backward_rows(adapter, y: Tensor, inputs: list[Tensor], pos: Tensor, grad_chunk: int, d_out: int,
                   groups: _Groups | None) -> tuple[Tensor, Tensor | None]:
    """Rows ``0..d_out-1`` of the Jacobians of ``y [B, d]`` (row ``b`` read at ``pos[b]``) with respect to each of
    ``inputs``, summed over the rows ``b``: float64 ``[len(inputs), d, d]`` (rows from ``d_out`` on zero); with
    ``groups``, the kept rows ``groups.keep`` summed per group, ``[G, len(inputs), r, d]`` (NaN where a kept row is
    ``>= d_out``), else None. One backward per output dimension, ``grad_chunk`` of them batched at a time."""
    d, dev = adapter.d_model, adapter.device
    B = pos.numel()
    rows = torch.zeros(len(inputs), d, d, dtype=torch.float64, device=dev)
    by = None
    if groups is not None:
        by = torch.zeros(groups.n, len(inputs), len(groups.keep), d, dtype=torch.float64, device=dev)
        by[:, :, groups.keep >= d_out] = float("nan")
    chunk = max(1, int(grad_chunk))
    i0 = 0
    while i0 < d_out:
        k = min(chunk, d_out - i0)
        if k > 1:
            go = torch.zeros(k, B, d, dtype=y.dtype, device=dev)
            go[torch.arange(k, device=dev), :, torch.arange(i0, i0 + k, device=dev)] = 1
            try:
                gs = torch.autograd.grad([y], inputs, grad_outputs=[go], retain_graph=True, is_grads_batched=True)
            except (RuntimeError, NotImplementedError) as e:
                log.warning("%s: batched backward failed (%s); one backward per output dimension",
                            adapter.model_type, str(e).splitlines()[0][:200])
                chunk = 1
                continue
        else:
            gs = torch.autograd.grad([y[:, i0].sum()], inputs, retain_graph=True)
        j, kept = None, []
        if groups is not None:  # the kept rows among this chunk's: their places in `keep`, their index in the chunk
            j = torch.nonzero((groups.keep >= i0) & (groups.keep < i0 + k)).reshape(-1)
            local = groups.keep[j] - i0
        for n, g in enumerate(gs):
            if j is None or j.numel() == 0:
                rows[n, i0 : i0 + k] = _rows(g, pos).reshape(k, d)
            else:
                total, v = _rows(g, pos, local)
                rows[n, i0 : i0 + k] = total.reshape(k, d)
                kept.append(v)
        if kept:  # a product, not index_add_: no atomics on a GPU
            by[:, :, j] = torch.einsum("gb,nrbd->gnrd", groups.member, torch.stack(kept))
        i0 += k
    return rows, by
