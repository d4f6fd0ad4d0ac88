"""Same-position Jacobian-vector products of the final residual (the J-lens decode through forward-mode products,
:mod:`mfpipe.jlens.jvp`): ``J_t v``, the derivative of ``h^L_t`` along a vector ``v`` inserted at an insertion point
of position ``t`` (the points of :mod:`mfpipe.models.adapters.jacobian`: ``"block"``, the residual entering block
``ℓ``; ``"attn"``, block ``ℓ``'s attention output projection's output), without the Jacobian itself.

Where :func:`~mfpipe.models.adapters.jacobian.position_jacobians` runs ``d`` backward passes a position (every row of
``J``), a decode needs only ``J v``: one forward-mode pass per vector. ``torch.func.jvp`` of the token's forward,
batched over the vectors with ``torch.func.vmap`` (the tangents are the batch: the primal forward runs once, the
vectors' tangents as rows of it), each vector inserted at its own (point, layer), the layers below it run without a
tangent. As for the Jacobians, the prefix ``< t`` does not depend on ``x_t``: it runs once into the model's key/value
cache without a graph, then the token alone with the tangents. The cache is kept as the prefix left it through every
chunk of vectors (each cache layer's ``update``, and the cache's own, returns the prefix with the token's keys and
values and stores nothing), so the chunks of one position share it and a layer's batched keys are dropped once the
layer has run. A
model whose forward takes or honours no cache (or whose cache holds no ``layers`` to keep) runs each window whole,
cut after ``t``, with the vector inserted at ``t`` alone: the same products, up to rounding, at ``t + 1`` times the
cost; a log line says so.

Rows of ``(block, L)``, the final residual itself, are ``v`` per row exactly (``J_L = I``), with no pass.
"""

from __future__ import annotations

import contextlib
import logging

import torch
from torch import Tensor

from mfpipe.models.adapters.capture import hidden_input
from mfpipe.models.adapters.jacobian import (NoCache, cache_keyword, cache_tolerance, final_residual,
                                             final_residual_hook, returned_cache)

__all__ = ["position_jvps"]

log = logging.getLogger(__name__)


def _keys(adapter, layers, points, n: int) -> list[tuple[str, int]]:
    """``[(point, layer)]`` per vector of ``n``, checked against the model: ``point`` ``block`` (layers ``0..L``) or
    ``attn`` (``0..L-1``); one layer or point stands for every vector."""
    L = adapter.n_layers
    layers = [int(x) for x in torch.as_tensor(layers).reshape(-1).tolist()]
    layers = layers * n if len(layers) == 1 else layers
    points = [points] * n if isinstance(points, str) else list(points)
    if len(points) != n or len(layers) != n:
        raise ValueError(f"one point and one layer per vector: got {len(points)} points and {len(layers)} layers for "
                         f"{n} vectors")
    for p, l in zip(points, layers):
        if p not in ("block", "attn") or not 0 <= l <= (L if p == "block" else L - 1):
            raise ValueError(f"J-lens insertion point ({p!r}, layer {l}) outside the model's: block 0..{L}, attn "
                             f"0..{L - 1}")
    return list(zip(points, layers))


def position_jvps(adapter, ids, positions, vectors, layers, points, *, chunk: int = 64,
                  prefix_cache: bool = True) -> Tensor:
    """``sum_b J_{b, t_b}[point_i, layer_i] v_i`` as float64 ``[n, d]``: for each vector ``v_i`` (``vectors [n, d]``)
    the derivative of the final residual (the final norm's input) of row ``b`` at its position ``t_b`` along
    ``v_i`` inserted at (``points[i]``, ``layers[i]``) of that position, summed over the rows.

    ``ids [B, T]`` token ids (no padding), ``positions [B]`` one position per row; ``points`` one of ``"block"`` /
    ``"attn"`` or one per vector. ``chunk``: vectors whose tangents run at once (memory: a layer's keys and values
    ``chunk`` times over). ``prefix_cache``: see the module docstring (False: every window whole). The tangents are in
    the model's dtype, as the Jacobians' backward passes are; the sums in float64. Parameters and mode are restored."""
    model, dev, d = adapter.model, adapter.device, adapter.d_model
    ids = torch.as_tensor(ids).to(device=dev, dtype=torch.long)
    pos = torch.as_tensor(positions).to(device=dev, dtype=torch.long).reshape(-1)
    V = torch.as_tensor(vectors).to(device=dev)
    if ids.ndim != 2 or pos.numel() != ids.shape[0] or pos.numel() == 0:
        raise ValueError(f"ids must be [B, T] and positions [B], B >= 1, got {tuple(ids.shape)} and {tuple(pos.shape)}")
    if int(pos.min()) < 0 or int(pos.max()) >= ids.shape[1]:
        raise ValueError(f"positions must lie in 0..{ids.shape[1] - 1}, got {pos.min().item()}..{pos.max().item()}")
    if V.ndim != 2 or V.shape[1] != d:
        raise ValueError(f"vectors must be [n, d = {d}], got {tuple(V.shape)}")
    keys = _keys(adapter, layers, points, V.shape[0])
    groups: dict[tuple[str, int], list[int]] = {}
    for i, k in enumerate(keys):
        groups.setdefault(k, []).append(i)
    out = torch.zeros(V.shape[0], d, dtype=torch.float64, device=dev)
    flags, training = [(p, p.requires_grad) for p in model.parameters()], model.training
    try:
        for p, _ in flags:
            p.requires_grad_(False)
        model.eval()
        with torch.no_grad(), _forward_mode_experts(model):  # forward mode needs no graph
            # a cache holding a state the token updates in place (a hybrid's, Inkling's convolution states): whole
            if prefix_cache and not getattr(adapter, "state_in_cache", False):
                try:
                    return _sum(adapter, ids, pos, V, groups, chunk, out, cached=True)
                except NoCache as e:
                    log.warning("%s: no key/value cache to keep (%s); the J-lens decode runs every window whole",
                                adapter.model_type, e)
                    out.zero_()
            return _sum(adapter, ids, pos, V, groups, chunk, out, cached=False)
    finally:
        for p, f in flags:
            p.requires_grad_(f)
        model.train(training)


@contextlib.contextmanager
def _forward_mode_experts(model):
    """A mixture of experts runs its experts' eager implementation (transformers' loop over the experts) while the
    tangents run: the fused kernel it runs by default (``grouped_mm``) has no forward-mode derivative. The products
    are the same to rounding; the setting is restored after. A model whose modelling code has no switchable experts
    (every dense model) is untouched."""
    impl = getattr(model.config, "_experts_implementation", None)
    switchable = getattr(type(model), "_can_set_experts_implementation", None)
    if impl in (None, "eager") or not callable(switchable) or not switchable():
        yield
        return
    model.set_experts_implementation("eager")
    try:
        yield
    finally:
        model.set_experts_implementation(impl)


def _sum(adapter, ids, pos, V, groups, chunk: int, out: Tensor, *, cached: bool) -> Tensor:
    L, checked = adapter.n_layers, False
    V = V.to(adapter.dtype)
    for t in torch.unique(pos).tolist():
        rows = torch.nonzero(pos == t).reshape(-1)
        with contextlib.ExitStack() as stack:
            if cached and t > 0:
                kwarg, cache = _prefix(adapter, ids[rows, :t])
                stack.enter_context(_kept(cache))
                token = ids[rows, t : t + 1]

                def run(token=token, cache=cache, kwarg=kwarg):
                    try:
                        return adapter.base(input_ids=token, use_cache=True, **{kwarg: cache})
                    except TypeError as e:
                        raise NoCache(str(e).splitlines()[0][:200]) from e

                if not checked:
                    _check(adapter, run, ids[rows, : t + 1])
                    checked = True
            else:
                window = ids[rows, : t + 1]

                def run(window=window):
                    return adapter.base(input_ids=window, use_cache=False)

            for key, idx in groups.items():
                idx = torch.as_tensor(idx, device=V.device)
                if key == ("block", L):  # the final residual itself: J = I
                    out[idx] += len(rows) * V[idx].double()
                    continue
                for c0 in range(0, len(idx), max(1, int(chunk))):
                    k = idx[c0 : c0 + max(1, int(chunk))]
                    out[k] += _products(adapter, run, key, V[k])
    return out


def _prefix(adapter, prefix: Tensor):
    """(the forward's cache keyword, the cache of ``prefix``), run without a graph."""
    kwarg = cache_keyword(adapter.base)
    try:
        cache = returned_cache(adapter.base(input_ids=prefix, use_cache=True))
    except TypeError as e:  # a forward without use_cache
        raise NoCache(str(e).splitlines()[0][:200]) from e
    if cache is None:
        raise NoCache("its forward returned no cache")
    return kwarg, cache


@contextlib.contextmanager
def _kept(cache):
    """Within: every layer of ``cache`` returns from ``update`` what it would (the prefix and the token) and keeps
    the prefix's state (its attributes as they were), so each forward of the token sees the prefix alone."""
    layers = getattr(cache, "layers", None)
    if not isinstance(layers, (list, tuple)) or not layers:
        raise NoCache(f"its {type(cache).__name__} holds no cache layers to keep")
    owners = [cache, *layers]  # the cache's own counters too, where a version keeps any
    before = [dict(vars(x)) for x in owners]

    def kept(owner, update):
        def wrapped(*args, **kwargs):
            state = dict(vars(owner))
            try:
                return update(*args, **kwargs)
            finally:
                vars(owner).clear()
                vars(owner).update(state)

        return wrapped

    for x in owners:
        x.update = kept(x, x.update)
    try:
        yield
    finally:
        for x, state in zip(owners, before):
            vars(x).clear()
            vars(x).update(state)


def _check(adapter, run, window: Tensor) -> None:
    """A forward that takes a cache but does not attend to it would put the token at position 0 of an empty
    context: its final residual must be the whole window's at the token (as the Jacobians check)."""
    seen: list[Tensor] = []
    handle = final_residual_hook(adapter, seen.append)
    try:
        run()
    finally:
        handle.remove()
    y = seen[0][:, -1].double()
    ref = final_residual(adapter, window)[:, -1].double()
    err = float((y - ref).norm() / ref.norm().clamp_min(1e-30))
    if not err < cache_tolerance(seen[0].dtype):
        raise NoCache(f"the token after its kept prefix gave another final residual than the whole window "
                       f"(relative difference {err:.2g})")


def _products(adapter, run, key: tuple[str, int], V: Tensor) -> Tensor:
    """``sum_b J_b v`` float64 ``[k, d]`` for the vectors ``V [k, d]``, all inserted at ``key`` = (point, layer) of
    the last position of ``run()``'s rows: ``torch.func.jvp`` batched over the vectors by ``torch.func.vmap``."""
    from torch.func import jvp, vmap

    point, layer = key
    zero = torch.zeros(V.shape[1], dtype=V.dtype, device=V.device)

    def insert(x: Tensor, u: Tensor) -> Tensor:
        last = torch.zeros(x.shape[-2], 1, dtype=x.dtype, device=x.device)
        last[-1] = 1  # the token: the last position of what runs
        return x + last * u

    def final_residual(u: Tensor) -> Tensor:
        seen: list[Tensor] = []

        def pre(module, args, kwargs):
            x = insert(hidden_input(args, kwargs), u)
            return ((x, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": x})

        def post(module, args, output):
            if isinstance(output, (tuple, list)):
                return (insert(output[0], u), *output[1:])
            return insert(output, u)

        hooks = [final_residual_hook(adapter, seen.append)]
        if point == "block":
            hooks.append(adapter.block_module(layer).register_forward_pre_hook(pre, with_kwargs=True))
        else:
            hooks.append(adapter.out_proj_module(layer).register_forward_hook(post))
        try:
            run()
        finally:
            for h in hooks:
                h.remove()
        if len(seen) != 1:
            raise RuntimeError(f"{adapter.model_type}: the J-lens decode saw {len(seen)} final-norm calls")
        return seen[0][:, -1].sum(0)

    try:
        _, products = vmap(lambda v: jvp(final_residual, (zero,), (v,)))(V)
    except NotImplementedError as e:  # an op without a forward-mode derivative in this torch
        raise NotImplementedError(f"{adapter.model_type}: the J-lens decode's forward-mode products need an op torch "
                                  f"has no forward-mode derivative for ({str(e).splitlines()[0][:200]}); set "
                                  "jlens.decode: matrix (the stored J)") from e
    return products.double()
