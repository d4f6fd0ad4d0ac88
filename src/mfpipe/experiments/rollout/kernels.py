"""Attention kernels for the open-loop rollout (paper Sec. 4.2, Table 1, Figs 3-4; App. E).

A kernel is a float64 array ``[L, H, N, N+2]``: for every layer ``l`` and head ``h``, row ``s`` (a tracked
query type, frequency rank) is a distribution over the key buckets ``0..N-1`` (tracked types), ``N``
(``<bos>``, position 0) and ``N+1`` (``<other>``, every untracked type) -- docs/conventions.md. The measured
corpus mean field ``P`` (eq:P, App. E) has exactly this layout with rows summing to 1; every kernel here
keeps rows stochastic (:func:`check_row_stochastic`).

Kernel variants (paper names; :data:`KERNEL_NAMES`, :func:`build_kernel`):

* ``mean_field`` -- ``P`` itself.
* ``context_free_kernel`` -- an ablation, NOT the paper's context-free baseline: the real attention of
  position 1 on BOS and on itself when the model runs on ``[BOS, t]`` alone (:func:`context_free_kernel`;
  needs the model), rolled out by Alg. 1 from the mean-field start. Rolled out from the ``[BOS, t]``
  layer-0 residual it reproduces that forward exactly; from the mean-field start it differs only by the start
  (GPT-2: the mean position offset instead of ``wpe[1]``; rotary models: identical to the baseline). The
  paper's ``context-free`` baseline (the ``[BOS, t]`` residuals themselves) is
  :func:`mfpipe.experiments.rollout.algorithm.context_free_residuals`, a prediction rather than a kernel.
* ``cooc`` -- the Sec. 4.2 footnote: ``C~_st = C_st / sum_t' C_st'`` (symmetric ±5 co-occurrence counts over
  tracked types, row-normalised), scaled by the tracked row mass ``T_s = sum_{t<N} P_st`` of each (l, h):
  ``K_st = T_s C~_st``. The ``<bos>`` and ``<other>`` columns keep ``P``'s masses (the footnote only replaces
  the tracked part; this keeps rows stochastic).
* ``meanq`` -- query-blind: every query row replaced by the average row of ``P`` for that (l, h).
* ``uniform`` -- key-blind: each row's tracked budget ``T_s`` spread evenly over the ``N`` tracked key types;
  ``<bos>`` / ``<other>`` kept.
* ``rowshuffle`` -- negative control: for each (l, h) the query rows are permuted by a seeded random
  derangement, so type ``s`` receives the whole row (all ``N+2`` columns) of some *other* type.
* ``P0only`` -- the layer-0 kernel at every layer (head by head).
* ``Pavg`` -- the kernel averaged over layers (head by head) at every layer.

Plus :func:`substitute_layers` (a substitute kernel on chosen layers only, ``tab:qwen-layers``) and
:func:`self_kernel` (all mass on the query type itself; used by tests).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from mfpipe.experiments.rollout.layered import LayerKernel

__all__ = [
    "KERNEL_NAMES",
    "check_row_stochastic",
    "below_one",
    "probability_rounding",
    "mean_field",
    "context_free_kernel",
    "cooc",
    "meanq",
    "uniform",
    "rowshuffle",
    "p0only",
    "pavg",
    "self_kernel",
    "substitute_layers",
    "build_kernel",
]

KERNEL_NAMES: tuple[str, ...] = ("mean_field", "cooc", "meanq", "uniform", "rowshuffle", "P0only", "Pavg",
                                 "context_free_kernel")


def _as_kernel(P) -> np.ndarray | LayerKernel:
    if isinstance(P, LayerKernel):  # computed one layer at a time (mfpipe.experiments.rollout.layered)
        return P
    if hasattr(P, "detach"):
        P = P.detach().cpu().double().numpy()
    K = np.asarray(P, dtype=np.float64)
    if K.ndim < 2 or K.shape[-1] != K.shape[-2] + 2:
        raise ValueError(f"a kernel is [..., N, N+2]; got shape {K.shape}")
    return K


# unit roundoff of the floating-point format a model's attention probabilities come out in (eager attention: the
# model's dtype)
UNIT_ROUNDOFF = {"float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8}


def probability_rounding(dtype: str | None) -> float:
    """How far from 1 a row of attention probabilities computed in ``dtype`` may sum: each probability is rounded
    with relative error at most u (:data:`UNIT_ROUNDOFF`), so their sum (1 before rounding) by at most u -- 0.4 %
    in bfloat16, where a Gemma-2 or Llama-3 run's rows of P are off by ~4e-4. Unknown dtypes: float32's."""
    return UNIT_ROUNDOFF.get(str(dtype), UNIT_ROUNDOFF["float32"])


def check_row_stochastic(K, atol: float = 1e-6, below: Sequence[int] = (), sub: bool = False,
                         skip: Sequence[int] = ()) -> None:
    """Raise ``ValueError`` unless every row of ``K [..., N, N+2]`` is non-negative and sums to 1 (a
    :class:`~mfpipe.experiments.rollout.layered.LayerKernel` checked one layer at a time). ``below``: the layers of a
    ``[L, H, N, N+2]`` kernel whose rows may sum to less (at most 1): an attention sink takes a share of each row and
    adds no value (gpt_oss, MiMo-V2-Flash's sliding layers, Granite-SWA: the adapter's ``sink_layers``); ``sub``: all
    of ``K``'s rows may. ``skip``: the layers without heads (a hybrid's other mixers: NaN, the rollout reads no kernel
    there); every other entry must be finite."""
    K = _as_kernel(K)
    below, skip = set(int(l) for l in below), set(int(l) for l in skip)
    if isinstance(K, LayerKernel) or below or skip:
        for l in (l for l in range(len(K)) if l not in skip):
            try:
                check_row_stochastic(K[l], atol, sub=l in below)
            except ValueError as e:
                raise ValueError(f"layer {l}: {e}") from None
        return
    if not np.isfinite(K).all():  # (NaN passes every comparison below)
        idx = np.unravel_index(int(np.argmin(np.isfinite(K))), K.shape)
        raise ValueError(f"kernel has non-finite entries (the first at {idx})")
    if (K < -atol).any():
        raise ValueError(f"kernel has negative entries (min {K.min():.3g})")
    dev = np.abs(K.sum(-1) - 1.0) if not sub else np.maximum(K.sum(-1) - 1.0, 0.0)
    if (dev > atol).any():
        idx = np.unravel_index(int(np.argmax(dev)), dev.shape)
        raise ValueError(f"kernel rows do not sum to 1: worst row {idx} off by {dev[idx]:.3g}")


def below_one(name: str, sink_layers: Sequence[int], n_layers: int, first: int = 0) -> tuple[int, ...]:
    """The layers of kernel ``name`` whose rows may sum below 1 (:func:`check_row_stochastic`'s ``below``) where the
    layers ``sink_layers`` of ``P`` do (a sink's share): those layers, or every layer for a kernel built from them
    across layers (``P0only`` from the first layer with heads, ``first``: a hybrid's first attention layer; ``Pavg``
    from all)."""
    sinks = tuple(int(l) for l in sink_layers)
    if name == "P0only":
        return tuple(range(n_layers)) if int(first) in sinks else ()
    if name == "Pavg":
        return tuple(range(n_layers)) if sinks else ()
    return sinks


def mean_field(P) -> np.ndarray:
    """The measured corpus mean field ``P [L, H, N, N+2]`` itself (a float64 copy; a layered ``P`` itself, whose
    layers are copies)."""
    P = _as_kernel(P)
    return P if isinstance(P, LayerKernel) else P.copy()


@torch.no_grad()
def context_free_kernel(model_or_adapter, type_ids, bos_id: int, batch_size: int = 256) -> np.ndarray:
    """``[L, H, N, N+2]``: attention of position 1 on BOS (column ``N``) and on itself (column ``s``) when the
    model runs on ``[BOS, t_s]`` alone; all other columns 0 (NaN at a hybrid's layers without heads). The attention is read through the adapter's site
    (:meth:`mfpipe.models.adapters.Adapter.run`, probabilities only), one forward per batch of types.

    ``model_or_adapter``: an :class:`~mfpipe.models.adapters.Adapter` or the HF causal LM (eager attention, eval
    mode); ``type_ids`` the tracked token ids ``[N]`` in bucket order. Rolling this kernel out from ``embed(t)
    (+ the position-1 embedding for learned positions)`` reproduces the model's residual at position 1 of
    ``[BOS, t]`` exactly (tests/test_rollout); the pipeline rolls it out from the mean-field start (the
    ``context_free_kernel`` ablation, module doc).
    """
    from mfpipe.models.adapters import Adapter, get_adapter

    adapter = model_or_adapter if isinstance(model_or_adapter, Adapter) else get_adapter(model_or_adapter)
    ids = torch.as_tensor(np.asarray(type_ids), dtype=torch.long).reshape(-1)
    n = ids.numel()
    rows: list[np.ndarray] = []
    for start in range(0, n, batch_size):
        t = ids[start : start + batch_size]
        inp = torch.stack([torch.full_like(t, int(bos_id)), t], dim=1)
        per_layer: list[torch.Tensor] = []
        nan = torch.full((t.numel(), adapter.n_heads, 2), float("nan"))  # a hybrid's other mixers: no heads

        def keep(cap, per_layer=per_layer, nan=nan):  # each layer's [B, H, 2, 2] -> position-1 row [B, H, 2]
            per_layer.append(nan if cap.attn_probs is None else cap.attn_probs[:, :, 1, :].detach().cpu().clone())

        adapter.run(inp, select=("attn_probs",), on_layer=keep)  # (key 0 = BOS, key 1 = self)
        rows.append(torch.stack(per_layer, dim=0).double().numpy())
    a = np.concatenate(rows, axis=1)  # [L, N, H, 2]
    L, _, H, _ = a.shape
    K = np.zeros((L, H, n, n + 2))
    s = np.arange(n)
    K[:, :, s, s] = a[..., 1].transpose(0, 2, 1)
    K[:, :, s, n] = a[..., 0].transpose(0, 2, 1)
    K[np.isnan(a).all(axis=(1, 2, 3))] = np.nan  # a hybrid's layers without heads: NaN throughout, as P's
    return K


def cooc(P, C, empty_rows: str = "uniform") -> np.ndarray:
    """Co-occurrence kernel (Sec. 4.2 footnote): ``K[l,h,s,t] = T^{lh}_s * C_st / sum_{t'<N} C_st'`` for tracked
    ``t``, with ``T^{lh}_s = sum_{t<N} P[l,h,s,t]``; the ``<bos>`` / ``<other>`` columns are ``P``'s.

    ``C``: symmetric ±5 co-occurrence counts ``[N, N]`` (or ``[N, N+2]`` -- only the tracked columns are
    used). A type with no tracked co-occurrence (zero row) gets ``T_s`` spread uniformly over the tracked
    types (``empty_rows="uniform"``) or raises (``"raise"``).
    """
    P = _as_kernel(P)
    n = P.shape[-2]
    C = np.asarray(C, dtype=np.float64)
    if C.ndim != 2 or C.shape[0] != n or C.shape[1] < n:
        raise ValueError(f"co-occurrence counts must be [N, >=N] with N={n}; got {C.shape}")
    C = C[:, :n]
    if (C < 0).any():
        raise ValueError("co-occurrence counts must be non-negative")
    rs = C.sum(1, keepdims=True)
    empty = rs[:, 0] <= 0
    if empty.any():
        if empty_rows == "raise":
            raise ValueError(f"{int(empty.sum())} tracked types have no tracked co-occurrence")
        if empty_rows != "uniform":
            raise ValueError(f"empty_rows must be 'uniform' or 'raise', got {empty_rows!r}")
    Ct = np.where(empty[:, None], 1.0 / n, C / np.where(rs > 0, rs, 1.0))

    def scaled(P):
        K = P.copy()
        T = P[..., :n].sum(-1, keepdims=True)  # [..., N, 1]
        K[..., :n] = T * Ct
        return K

    return P.map(scaled) if isinstance(P, LayerKernel) else scaled(P)


def meanq(P, weights=None) -> np.ndarray:
    """Query-blind: every row of each (l, h) replaced by the average row (unweighted mean over the ``N``
    query types, or weighted by ``weights [N]``, e.g. query counts)."""
    P = _as_kernel(P)
    if weights is not None:
        w = np.asarray(weights, dtype=np.float64).reshape(-1)
        if w.shape[0] != P.shape[-2] or (w < 0).any() or w.sum() <= 0:
            raise ValueError("weights must be non-negative [N] with a positive sum")
        w = w / w.sum()

    def blind(P):
        avg = P.mean(-2, keepdims=True) if weights is None else np.einsum("...st,s->...t", P, w)[..., None, :]
        return np.broadcast_to(avg, P.shape).copy()

    return P.map(blind) if isinstance(P, LayerKernel) else blind(P)


def uniform(P) -> np.ndarray:
    """Key-blind: each row's tracked budget ``sum_{t<N} P_st`` spread evenly over the ``N`` tracked key types;
    ``<bos>`` and ``<other>`` masses kept."""
    P = _as_kernel(P)
    n = P.shape[-2]

    def spread(P):
        K = P.copy()
        K[..., :n] = P[..., :n].sum(-1, keepdims=True) / n
        return K

    return P.map(spread) if isinstance(P, LayerKernel) else spread(P)


def _derangement(n: int, rng: np.random.Generator) -> np.ndarray:
    if n < 2:
        return np.arange(n)
    while True:
        perm = rng.permutation(n)
        if not (perm == np.arange(n)).any():
            return perm


def rowshuffle(P, seed: int = 0) -> np.ndarray:
    """Negative control: for each (l, h) independently, ``K[l,h,s,:] = P[l,h,pi(s),:]`` with ``pi`` a seeded
    random derangement of the query types (no type keeps its own row)."""
    P = _as_kernel(P)
    rng = np.random.default_rng(seed)
    lead = P.shape[:-2]
    n = P.shape[-2]
    # the derangements drawn in the (l, h) order of the whole array, so a layered P gets the same ones
    perms = np.stack([_derangement(n, rng) for _ in range(int(np.prod(lead)))]).reshape(*lead, n)
    if isinstance(P, LayerKernel):
        return LayerKernel(P.shape, lambda l: np.take_along_axis(P[l], perms[l][..., None], axis=-2))
    return np.take_along_axis(P, perms[..., None], axis=-2)


def _at_headed(P, layer: np.ndarray, headed: list[int]):
    """``layer`` at every layer of ``P`` with heads, NaN at the others (as ``P`` is: the rollout runs a hybrid's
    other blocks as the model does, reading no kernel there)."""
    if len(headed) == len(P):  # every layer (no NaN layer allocated)
        return LayerKernel(P.shape, lambda l: layer) if isinstance(P, LayerKernel) else np.broadcast_to(
            layer[None], P.shape).copy()
    nan = np.full(P.shape[1:], np.nan)
    if isinstance(P, LayerKernel):
        return LayerKernel(P.shape, lambda l: layer if l in headed else nan)
    return np.stack([layer if l in headed else nan for l in range(len(P))])


def p0only(P, layers=None) -> np.ndarray:
    """The first layer's kernel reused at every layer, head by head: ``K[l,h] = P[0,h]``; of ``layers`` only where
    given (a hybrid's attention layers: its first one's, at those, NaN at the others; all layers by default)."""
    P = _as_kernel(P)
    if P.ndim != 4:
        raise ValueError(f"P0only needs [L, H, N, N+2]; got {P.shape}")
    headed = list(range(len(P))) if layers is None else [int(l) for l in layers]
    return _at_headed(P, np.array(P[headed[0]], copy=True), headed)


def pavg(P, layers=None) -> np.ndarray:
    """The kernel averaged over layers, head by head: ``K[l,h] = mean_l' P[l',h]``; over ``layers`` only where given
    (a hybrid's attention layers, at those, NaN at the others; all layers by default)."""
    P = _as_kernel(P)
    if P.ndim != 4:
        raise ValueError(f"Pavg needs [L, H, N, N+2]; got {P.shape}")
    headed = list(range(len(P))) if layers is None else [int(l) for l in layers]
    if isinstance(P, LayerKernel):  # the layers added in order, as numpy's mean over the outer axis adds them
        total = P[headed[0]]
        for l in headed[1:]:
            total += P[l]
        return _at_headed(P, total / len(headed), headed)
    return _at_headed(P, P[headed].mean(0), headed)


def self_kernel(n_layers: int, n_heads: int, n: int) -> np.ndarray:
    """All mass on the query type itself (``K[l,h,s,s] = 1``): a type alone at position 0 sees only itself."""
    K = np.zeros((n_layers, n_heads, n, n + 2))
    s = np.arange(n)
    K[:, :, s, s] = 1.0
    return K


def substitute_layers(base, substitute, layers: Sequence[int]) -> np.ndarray:
    """``base`` with the layers in ``layers`` taken from ``substitute`` (both ``[L, H, N, N+2]``)."""
    B, S = _as_kernel(base), _as_kernel(substitute)
    if B.shape != S.shape:
        raise ValueError(f"kernel shapes differ: {B.shape} vs {S.shape}")
    idx = np.asarray(list(layers), dtype=np.int64)
    if isinstance(B, LayerKernel) or isinstance(S, LayerKernel):
        chosen = set((idx % B.shape[0]).tolist())
        return LayerKernel(B.shape, lambda l: S[l] if l in chosen else B[l])
    K = B.copy()
    K[idx] = S[idx]
    return K


def build_kernel(
    name: str,
    P,
    *,
    cooc_counts=None,
    model=None,
    type_ids=None,
    bos_id: int | None = None,
    seed: int = 0,
    meanq_weights=None,
    layers=None,
) -> np.ndarray:
    """Build kernel ``name`` (one of :data:`KERNEL_NAMES`) from the mean field ``P [L, H, N, N+2]``.

    ``cooc`` needs ``cooc_counts [N, N(+2)]``; ``context_free_kernel`` needs ``model``, ``type_ids`` and ``bos_id``;
    ``rowshuffle`` uses ``seed``; ``meanq`` optional ``meanq_weights``; ``P0only`` and ``Pavg`` the ``layers`` with
    heads (a hybrid's attention layers; all by default).
    """
    if name == "mean_field":
        return mean_field(P)
    if name == "context_free_kernel":
        if model is None or type_ids is None or bos_id is None:
            raise ValueError("context_free_kernel needs model=, type_ids= and bos_id=")
        return context_free_kernel(model, type_ids, bos_id)
    if name == "cooc":
        if cooc_counts is None:
            raise ValueError("cooc needs cooc_counts=")
        return cooc(P, cooc_counts)
    if name == "meanq":
        return meanq(P, meanq_weights)
    if name == "uniform":
        return uniform(P)
    if name == "rowshuffle":
        return rowshuffle(P, seed)
    if name == "P0only":
        return p0only(P, layers)
    if name == "Pavg":
        return pavg(P, layers)
    raise ValueError(f"unknown kernel {name!r}; known: {KERNEL_NAMES}")
