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

* ``"block"``: the residual entering block ``ℓ`` (``ℓ < L``) and ``ℓ = L``, the final residual (``J = I``: a check);
* ``"attn"``: block ``ℓ``'s attention output projection's output, before any post-attention norm (Gemma-2, OLMo-2),
  where a head's write ``O_h z`` lands (none at ``ℓ = L``).
"""

from __future__ import annotations

import inspect
import logging
import weakref
from typing import NamedTuple

import torch
from torch import Tensor

from mfpipe.models.adapters.backward16 import WIDE_ROWS, applies, fast_input_grads
from mfpipe.models.adapters.capture import first_output, hidden_input

__all__ = ["POINTS", "position_jacobians", "jacobian_sums", "cache_tolerance", "cache_keyword", "returned_cache",
           "final_residual", "NoCache", "final_residual_hook"]

POINTS = ("block", "attn")

log = logging.getLogger(__name__)
_BATCHED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # models whose batched backward has worked


def _replace_hidden(args: tuple, kwargs: dict, x: Tensor) -> tuple[tuple, dict]:
    return ((x, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": x})


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
                       rows: int | None = None, groups=None, group_rows=None, n_groups: int | None = None,
                       into: Tensor | None = None, into_groups: Tensor | None = None
                       ) -> Tensor | tuple[Tensor, Tensor]:
    """``sum_b ∂h^L[b, t_b] / ∂x^p_ℓ[b, t_b]`` as float64 ``[2, L+1, d, d]`` (point, layer, out, in), with
    ``point`` as in :data:`POINTS` and NaN at ``("attn", L)``; with ``groups``, ``(total, by_group)``.

    ``ids [B, T]`` token ids (no padding, no mask), ``positions [B]`` one position per row (``0 <= t_b < T``).
    ``grad_chunk``: backward passes batched in one ``torch.autograd.grad(..., is_grads_batched=True)`` (``<= 1``: one
    at a time; a model whose backward cannot be batched falls back to that as well).

    ``prefix_cache`` (default): the rows of each distinct ``t`` run their prefix once without a graph (the model's
    key/value cache: constants of the Jacobian), then token ``t`` alone with the graph, so each of the ``d`` backward
    passes runs through one position (``benchmarks/jlens.py`` times both). A model whose forward takes or honours no
    cache falls back, with a log line, to ``prefix_cache=False``: each window cut after the largest position and run
    whole (the same Jacobian up to float rounding; tests tie the two). ``rows``: the first ``rows`` output
    dimensions only (the others NaN), ``rows`` backward passes: ``benchmarks/jlens.py`` times a share of them.

    ``groups [B]`` (int, ``0..G-1``; ``G = n_groups``, default ``max(groups) + 1``): the group of each row. Then the
    call returns ``(total, by_group)``: ``total`` the sum above, computed exactly as without ``groups`` (the same
    operations in the same order, bit for bit), and ``by_group`` float64 ``[G, 2, L+1, r, d]``, the sums over each
    group's rows of the same per-row Jacobians restricted to the output dimensions ``group_rows`` (``r`` indices in
    ``0..d-1``, default all ``d``), NaN where ``total`` is (``("attn", L)``, output dimensions ``>= rows``). Their sum
    over the groups is ``total[:, :, group_rows]`` up to float64 rounding (the J-lens checks of
    :mod:`mfpipe.jlens.checks` compare disjoint position samples this way without a second backward pass; the
    ``group_rows`` bound their memory to ``G (2L+1) r d`` on a real model).

    ``into`` (with ``groups``, ``into_groups``; :func:`jacobian_sums` makes them): the sums are added to these, in
    place, and returned: one buffer across many calls (Qwen3-14B's shape: 17 GB in float64), none of a call's own.

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
    total = jacobian_sums(adapter, rows) if into is None else into
    by = None if grp is None else (jacobian_sums(adapter, rows, grp.n, grp.keep) if into_groups is None
                                   else into_groups)
    flags = [(p, p.requires_grad) for p in model.parameters()]
    training = model.training
    try:
        for p, _ in flags:
            p.requires_grad_(False)
        model.eval()
        with fast_input_grads(model):  # a 16-bit model on a CPU: its linear layers' backward in float32 (backward16)
            # a cache holding a state the next token updates in place (a hybrid's, Inkling's): no backward through it
            if prefix_cache and not getattr(adapter, "state_in_cache", False):
                try:
                    _cached_prefix(adapter, ids, pos, grad_chunk, rows, grp, total, by)
                    return total if grp is None else (total, by)
                except NoCache as e:  # raised before anything was added
                    log.warning("%s: no key/value cache (%s); the J-lens runs every window whole", adapter.model_type,
                                e)
            ids = ids[:, : int(pos.max()) + 1]  # h^L[t] depends on positions <= t only
            _blocks(adapter, lambda: adapter.base(input_ids=ids, use_cache=False), pos, grad_chunk, rows, grp, total,
                    by)
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


def _cached_prefix(adapter, ids: Tensor, pos: Tensor, grad_chunk: int, rows_out: int | None, groups: _Groups | None,
                   total: Tensor, by_group: Tensor | None) -> None:
    """:func:`position_jacobians` with the prefix of each row held as the model's key/value cache, added to ``total``
    (and ``by_group``). The cache is checked on the first position after a prefix before anything is added, and
    position 0 (no prefix) comes last: a :class:`NoCache` leaves the sums as they were."""
    d, dev = adapter.d_model, adapter.device
    kwarg = cache_keyword(adapter.base)
    checked = False
    ts = torch.unique(pos).tolist()
    for t in ts[1:] + ts[:1] if ts[0] == 0 else ts:
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
        # a pass through one token holds 1 / (t + 1) of a whole window's: on a GPU (t + 1) times as many passes at
        # once (a CPU runs wide batches slower than grad_chunk at a time: benchmarks/HISTORY.md, "The J-lens")
        chunk = min(d, max(1, int(grad_chunk)) * ((t + 1) if dev.type == "cuda" else 1))
        if applies(adapter.model):  # each backward widens every weight to float32 once: over WIDE_ROWS rows at least
            chunk = min(d, max(chunk, WIDE_ROWS))
        sub = None if groups is None else groups._replace(member=groups.member[:, rows])

        def check(y, t=t, rows=rows):
            # a forward that takes past_key_values but does not attend to them would put the token at position 0
            # of an empty context: its final residual must be the whole window's at t (a token without its context
            # is O(1) apart; the same sums in another order, a 16-bit model's one-token and whole-window kernels,
            # are a few units of its rounding apart: 3.9e-3 for Gemma-2's shape in bfloat16, issue 58)
            ref = final_residual(adapter, ids[rows, : t + 1])[:, t]
            err = float((y.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))
            if not err < cache_tolerance(y.dtype):
                raise NoCache(f"the token after its cached prefix gave another final residual than the whole window "
                               f"(relative difference {err:.2g}, above {cache_tolerance(y.dtype):.2g})")

        _blocks(adapter, run, torch.zeros(len(rows), dtype=torch.long, device=dev), chunk, rows_out, sub, total,
                by_group, check=check if t > 0 and not checked else None)
        checked = checked or t > 0


def cache_tolerance(dtype) -> float:
    """The relative difference above which the token after its cached prefix is refused as another final residual
    than the whole window's: 1e-3, or eight units of rounding of a coarser ``dtype`` (bf16: 0.0625, fp16: 7.8e-3)."""
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
            lambda module, args, out: fn(first_output(out)))
    return adapter.final_norm_module().register_forward_pre_hook(
        lambda module, args, kwargs: fn(hidden_input(args, kwargs)), with_kwargs=True)


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


def jacobian_sums(adapter, rows_out: int | None = None, n_groups: int | None = None, keep: Tensor | None = None,
                  dtype: torch.dtype = torch.float64) -> Tensor:
    """The sums (``dtype``) :func:`position_jacobians` adds to, zero where it adds and NaN where it adds nothing (the
    ``attn`` point at layer ``L`` and at a hybrid's layers without attention, output dimensions from ``rows_out`` on):
    ``[2, L+1, d, d]``, or with ``n_groups`` the per-group sums of the kept rows ``keep``, ``[G, 2, L+1, r, d]``."""
    L, d, dev = adapter.n_layers, adapter.d_model, adapter.device
    d_out = d if rows_out is None else max(1, min(int(rows_out), d))
    A = set(getattr(adapter, "attention_layers", range(L)))
    none = [l for l in range(L + 1) if l == L or l not in A]
    if n_groups is None:
        out = torch.zeros(2, L + 1, d, d, dtype=dtype, device=dev)
        out[:, :, d_out:] = float("nan")
        out[1, none] = float("nan")
        return out
    out = torch.zeros(n_groups, 2, L + 1, len(keep), d, dtype=dtype, device=dev)
    out[:, :, :, keep >= d_out] = float("nan")
    out[:, 1, none] = float("nan")
    return out


def _blocks(adapter, run, pos: Tensor, grad_chunk: int, rows_out: int | None, groups: _Groups | None, total: Tensor,
            by_total: Tensor | None, check=None) -> None:
    """The Jacobian blocks of one forward ``run()`` (hooked here), row ``b`` read at position ``pos[b]``, summed over
    rows into ``total`` (``[2, L+1, d, d]``, its first ``rows_out`` output dimensions) and, with ``groups``, the kept
    rows per group into ``by_total`` (``[G, 2, L+1, r, d]``); ``check(y)``, given, sees the final residual
    ``[B, d]`` before anything is added."""
    L, d, dev = adapter.n_layers, adapter.d_model, adapter.device
    d_out = d if rows_out is None else max(1, min(int(rows_out), d))
    B = pos.numel()
    block_in: list[Tensor | None] = [None] * L
    attn_out: list[Tensor | None] = [None] * L
    final: list[Tensor] = []

    def block_hook(layer):
        def hook(module, args, kwargs):
            x = hidden_input(args, kwargs)
            if layer == 0:  # the leaf every later residual is a function of
                x = x.detach().requires_grad_(True)
                block_in[0] = x
                return _replace_hidden(args, kwargs, x)
            block_in[layer] = x
            return None

        return hook

    def attn_hook(layer):
        def hook(module, args, out):
            attn_out[layer] = first_output(out)

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
            if check is not None:
                check(y.detach())
            slots = [(0, l) for l in range(L + 1)] + [(1, l) for l in A]  # each input's (point, layer)
            _backward_rows(adapter, y, [*block_in, hL, *(attn_out[l] for l in A)], slots, pos, grad_chunk, d_out,
                           groups, total, by_total)
    finally:
        for h in handles:
            h.remove()


def _backward_rows(adapter, y: Tensor, inputs: list[Tensor], slots: list[tuple[int, int]], pos: Tensor,
                   grad_chunk: int, d_out: int, groups: _Groups | None, total: Tensor, by: Tensor | None) -> None:
    """Rows ``0..d_out-1`` of the Jacobians of ``y [B, d]`` (row ``b`` read at ``pos[b]``) with respect to each of
    ``inputs`` (its place ``slots[n]``, (point, layer), in the sums), summed over the rows ``b`` and added to
    ``total [2, L+1, d, d]``; with ``groups``, the kept rows ``groups.keep`` summed per group, added to
    ``by [G, 2, L+1, r, d]``. One backward per output dimension, ``grad_chunk`` of them batched at a time.

    The last backward frees the graph: one retained outlived the call under saved-tensor hooks (a cycle through saved
    tensors the collector cannot see). A failed batched call falls back to single rows on the same graph, so a batched
    call frees it only once one has worked on the model (:data:`_BATCHED`; before that, one more row's backward)."""
    d, dev = adapter.d_model, adapter.device
    B = pos.numel()
    chunk = max(1, int(grad_chunk))
    i0, batched, held = 0, _BATCHED.get(adapter.model, False), True
    while i0 < d_out:
        k = min(chunk, d_out - i0)
        last = i0 + k >= d_out
        if k > 1:
            go = torch.zeros(k, B, d, dtype=y.dtype, device=dev)
            go[torch.arange(k, device=dev), :, torch.arange(i0, i0 + k, device=dev)] = 1
            try:
                held = not (last and batched)
                gs = torch.autograd.grad([y], inputs, grad_outputs=[go], retain_graph=held, is_grads_batched=True)
                batched = _BATCHED[adapter.model] = True
            except (RuntimeError, NotImplementedError) as e:
                log.warning("%s: batched backward failed (%s); one backward per output dimension",
                            adapter.model_type, str(e).splitlines()[0][:200])
                chunk = 1
                continue
        else:
            held = not last
            gs = torch.autograd.grad([y[:, i0].sum()], inputs, retain_graph=held)
        j, kept = None, []
        if groups is not None:  # the kept rows among this chunk's: their places in `keep`, their index in the chunk
            j = torch.nonzero((groups.keep >= i0) & (groups.keep < i0 + k)).reshape(-1)
            local = groups.keep[j] - i0
        for n, g in enumerate(gs):
            p, l = slots[n]
            if j is None or j.numel() == 0:
                total[p, l, i0 : i0 + k] += _rows(g, pos).reshape(k, d)
            else:
                s, v = _rows(g, pos, local)
                total[p, l, i0 : i0 + k] += s.reshape(k, d)
                kept.append(v)
        if kept:  # a product, not index_add_: no atomics on a GPU
            sums = torch.einsum("gb,nrbd->gnrd", groups.member, torch.stack(kept))
            for n, (p, l) in enumerate(slots):
                by[:, p, l, j] += sums[:, n]
        i0 += k
    if held:
        torch.autograd.grad([y[:, 0].sum()], inputs, retain_graph=False)
