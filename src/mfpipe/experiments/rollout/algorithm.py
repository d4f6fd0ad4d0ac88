"""Open-loop mean-field rollout (paper Alg. 1 ``alg:rollout``, App. E) and the teacher-forced per-layer
estimators of Sec. 4.3 (``fig:tf-attention``, ``fig:error-decomp``), for every architecture the adapters
support (gpt2, gpt_neox, llama, qwen3, gemma2, olmo2).

One rollout step at layer ``l`` for all ``N`` tracked types at once (``K = kernel[l]``, ``[H, N, N+2]``)::

    V[t]   = v_l(ĉ_t)  for t < N,   V[N] = v_l(b^l),   V[N+1] = v_l(mean_t ĉ_t)      # [N+2, H, dh]
    ẑ_s^h  = sum_t K[h, s, t] V[t, h]                                                  # [N, H, dh]
    a_s    = post_attn_norm_l( sum_h ẑ_s^h @ W_O^{l,h} + b_O^l )                       # bias once per layer
    sequential:         m_s = ĉ_s + a_s ;  ĉ'_s = m_s + MLP_l(m_s)
    parallel (GPT-NeoX): ĉ'_s = ĉ_s + a_s + MLP_l(ĉ_s)

``v_l`` is the adapter's ``value_map`` (pre-attention norm, value projection and bias, GQA expanded),
``post_attn_norm`` is the identity except on Gemma-2 / OLMo-2, and ``MLP_l`` is the adapter's ``mlp`` (the
branch with its own pre-/post-norms). The start is the input embedding (GPT-2: plus the mean learned
positional embedding over the positions tracked queries occupy, ``adapter.position_offset``). ``b^l`` is the
residual entering
block ``l`` at position 0 when the model runs on ``[BOS]`` alone (weight-derived, :func:`bos_residuals`);
the ``<other>`` column is valued at the running mean of the predicted tracked centroids. Nothing measured
is consulted after layer 0 (except the optional rogue-dimension pinning of App. I).

The context-free baseline of Sec. 4.2 / App. G (:func:`context_free_residuals`) is no rollout: it is the
model's own residual at position 1 of the two-token input ``[BOS, t]``, scored like a rollout's prediction.

Shapes: ``L`` layers, ``H`` query heads, ``dh`` head width, ``d`` model width, ``N`` tracked types.
Centroids are ``[L+1, N, d]``: index ``l < L`` is the residual entering block ``l``, index ``L`` the final
residual before the last norm. Arrays come back as float32 numpy.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from mfpipe.models.adapters.forms import side_branch
from mfpipe.models.adapters.hybrid import mixer_block
from mfpipe.models.adapters.calls import row_tokens
from mfpipe.models.adapters.joins import run_block

__all__ = [
    "on_types",
    "bos_residuals",
    "context_free_residuals",
    "initial_centroids",
    "head_reads",
    "attention_output",
    "block_update",
    "rollout",
    "teacher_forced_attention",
    "error_decomposition",
    "rogue_dimensions",
    "pin_values",
]


# ------------------------------------------------------------------------------------------- helpers
def _t(adapter, x, dtype=torch.float32) -> Tensor:
    if isinstance(x, Tensor):
        return x.to(device=adapter.device, dtype=dtype)
    return torch.as_tensor(np.asarray(x), dtype=dtype, device=adapter.device)


def _np(x: Tensor) -> np.ndarray:
    return x.detach().float().cpu().numpy()


def _check_kernel(adapter, kernel, n: int | None = None) -> None:
    shp = tuple(kernel.shape)
    L, H = adapter.n_layers, adapter.n_heads
    if len(shp) != 4 or shp[0] != L or shp[1] != H or shp[3] != shp[2] + 2 or (n is not None and shp[2] != n):
        want = f"[{L}, {H}, N, N+2]" if n is None else f"[{L}, {H}, {n}, {n + 2}]"
        raise ValueError(f"kernel must be {want} for this model; got {shp}")


def _bos_for(adapter, bos_resid) -> np.ndarray:
    b = np.asarray(bos_resid)
    if b.ndim != 2 or b.shape[0] < adapter.n_layers or b.shape[1] != adapter.d_model:
        raise ValueError(f"bos_resid must be [L(+1)={adapter.n_layers}(+1), d={adapter.d_model}]; got {b.shape}")
    return b


@torch.no_grad()
def bos_residuals(adapter, bos_id: int) -> np.ndarray:
    """``[L+1, d]``: the residual entering each block (and, last, the final residual before the last norm) at
    position 0 of the one-token input ``[BOS]`` -- the ``b^l`` of App. E (position 0 attends only to itself, so
    this equals position 0 of every window)."""
    out: list[Tensor] = []
    ids = torch.tensor([[int(bos_id)]], dtype=torch.long)
    adapter.capture(ids, lambda cap: out.append(cap.resid_in[0, 0].clone()), lambda f: out.append(f[0, 0].clone()))
    return _np(torch.stack(out))


@torch.no_grad()
def context_free_residuals(adapter, type_ids, bos_id: int, batch_size: int = 256) -> np.ndarray:
    """The context-free baseline (Sec. 4.2 ``context-free``, App. G ``tab:matrix``): ``[L+1, N, d]``, the residual
    at position 1 when the model runs on the two-token input ``[BOS, t]`` alone, for every ``t`` in ``type_ids``,
    in the centroids' convention (index ``l < L``: the residual entering block ``l``; index ``L``: the final
    residual before the last norm).

    A prediction of the centroids, scored exactly like a rollout (depths ``1..L``); index 0 is the layer-0
    residual of ``[BOS, t]`` (embedding, GPT-2: plus ``wpe[1]``). It uses no corpus statistic, so one set serves
    every evaluation corpus. One traced forward per batch of ``batch_size`` types through ``adapter.capture``.
    """
    ids = torch.as_tensor(np.asarray(type_ids), dtype=torch.long).reshape(-1)
    if ids.numel() == 0:
        raise ValueError("context_free_residuals needs at least one type id")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    parts: list[Tensor] = []
    for start in range(0, ids.numel(), batch_size):
        t = ids[start : start + batch_size]
        per_depth: list[Tensor] = []
        adapter.capture(torch.stack([torch.full_like(t, int(bos_id)), t], dim=1),
                        lambda cap: per_depth.append(cap.resid_in[:, 1].clone()),
                        lambda f: per_depth.append(f[:, 1].clone()))
        parts.append(torch.stack(per_depth))  # [L+1, B, d]
    return _np(torch.cat(parts, dim=1))


@torch.no_grad()
def initial_centroids(adapter, type_ids, context_length: int | None = None, position_count=None) -> np.ndarray:
    """``[N, d]`` layer-0 start of Alg. 1: input embeddings of ``type_ids`` plus, for learned absolute
    positions (GPT-2), the mean positional embedding over the positions tracked queries occupy
    (``adapter.position_offset``: weighted by ``position_count [T]`` when given -- the statistics half's
    tracked-query count per position -- else uniform over positions ``1..context_length-1``)."""
    ids = torch.as_tensor(np.asarray(type_ids), dtype=torch.long).reshape(-1)
    off = adapter.position_offset(context_length)  # None: no learned positions (rotary), nothing to weight
    if off is not None and position_count is not None:
        off = adapter.position_offset(context_length, position_count=position_count)
    if off is None or adapter.structure.embed_norm is not None:  # a norm after the positions (TrOCR's): inside embed
        return _np(adapter.embed(ids, offset=off).float())
    return _np(adapter.embed(ids).float() + off.float().to(adapter.device))


@torch.no_grad()
def head_reads(adapter, layer: int, kernel_l, c: Tensor, b: Tensor) -> Tensor:
    """Mean-field per-head reads ``ẑ [N, H, dh]`` (head space, before the output projection) at ``layer``:
    ``ẑ_s^h = sum_t K[h,s,t] V[t,h]`` with ``V = [v(c_0..c_{N-1}), v(b), v(mean_t c_t)]``.

    ``kernel_l [H, N, N+2]``, ``c [N, d]`` (the centroids the keys are valued at), ``b [d]``."""
    K = _t(adapter, kernel_l)
    keys = torch.cat([c, b[None], c.mean(0, keepdim=True)], dim=0)  # [N+2, d]
    V = adapter.value_map(layer, keys).float()  # [N+2, H, dh]
    return torch.einsum("hst,thd->shd", K, V)


def on_types(fn):
    """``fn(adapter, setup, ...)`` run with the residual rows of ``adapter``'s blocks taken as ``setup``'s tracked types
    (:func:`~mfpipe.models.adapters.calls.row_tokens`): a block that reads an input of each token beside the residual
    (Gemma-4's per-layer inputs) runs on a type's centroid with its type's token, as the model runs it on that token."""
    @functools.wraps(fn)
    def wrapped(adapter, setup, *args, **kwargs):
        ids = getattr(setup, "type_ids", None)  # a setup without types: rows of no token (such a block then refuses)
        if ids is None:
            return fn(adapter, setup, *args, **kwargs)
        with row_tokens(adapter, ids):
            return fn(adapter, setup, *args, **kwargs)
    return wrapped


@torch.no_grad()
def attention_output(adapter, layer: int, reads: Tensor, bias: bool = True, post_norm: bool = False,
                     at: Tensor | None = None) -> Tensor:
    """``sum_h reads[:, h] @ W_O^h`` (+ the output-projection bias once; + the post-attention norm where the
    architecture has one if ``post_norm``): ``reads [N, H, dh]`` -> ``[N, d]``. Where the attention has an output gate
    (Qwen3-Next: :mod:`mfpipe.models.adapters.gate`), each row's read enters times the gate of its query's residual
    ``at [N, d]`` (the centroid the read is of), as the model gates a position's read by its own residual."""
    gate = getattr(adapter, "read_gate", None)
    g = None if gate is None or at is None else gate(layer, at, reads)  # a norm of the reads: of these reads
    reads = reads if g is None else reads.float() * g.to(reads.device)
    W = adapter.out_proj_slices(layer).float().to(reads.device)  # [H, dh, d]
    a = torch.einsum("shd,hdD->sD", reads.float(), W)
    if bias:
        bo = adapter.out_proj_bias(layer)
        if bo is not None:
            a = a + bo.float().to(a.device)
    if post_norm:
        a = adapter.post_attn_norm(layer, a).float()
    return a


@torch.no_grad()
def block_update(adapter, layer: int, c: Tensor, reads: Tensor, carry: dict | None = None) -> Tensor:
    """One block at the centroids ``c [N, d]`` given the per-head reads ``[N, H, dh]``: output projection +
    bias, post-attention norm (Gemma-2 / OLMo-2), residual add, then the MLP once at the centroid (on the
    post-attention residual, or on the block input for GPT-NeoX parallel residual). Returns ``[N, d]``. ``carry``: the
    state the blocks hand each other beside the residual, kept along a run's layers (Zaya's: joins.run_block)."""
    if adapter.structure.join == "model":  # a join of the block's own (Doge's, Beam's...): the block runs it
        return run_block(adapter, layer, c, attention_output(adapter, layer, reads, bias=True, at=c), carry=carry)[1]
    a = attention_output(adapter, layer, reads, bias=True, post_norm=True, at=c)  # an output gate: the centroid's
    side = side_branch(adapter, layer, c[:, None])  # a mixer beside the attention (Falcon-H1): on each centroid as a
    a = a if side is None else a + side[:, 0]  # sequence of one position, as hybrid.mixer_block runs a mixer block
    m = c + a  # a block that scales its output (Gemma-4's layer_scalar) or ends in a norm (GPT-1): block_join
    return adapter.block_join(layer, m, adapter.mlp(layer, c if adapter.parallel_residual else m).float())


def _pin(c: Tensor, dims: Tensor | None, values: Tensor | None, layer: int) -> Tensor:
    if dims is None:
        return c
    c = c.clone()
    v = values[layer]
    c[:, dims] = v[..., dims] if v.ndim == 2 else v[dims].expand(c.shape[0], -1)
    return c


# ------------------------------------------------------------------------------------------- rollout
@torch.no_grad()
def rollout(
    adapter,
    kernel,
    bos_resid,
    *,
    type_ids=None,
    init=None,
    context_length: int | None = None,
    position_count=None,
    pin_dims: Sequence[int] | np.ndarray | None = None,
    pin_values=None,
) -> np.ndarray:
    """Alg. 1: predicted centroids ``[L+1, N, d]`` (index 0 = the start, index ``L`` = final residual before
    the last norm).

    ``kernel [L, H, N, N+2]`` (any of :mod:`mfpipe.experiments.rollout.kernels`; indexed one layer at a time, so a lazily loaded
    array works); ``bos_resid [L(+1), d]`` the ``b^l`` (:func:`bos_residuals`, or the stats store's ``b``).
    Start: ``init [N, d]`` if given, else :func:`initial_centroids` of ``type_ids`` (needs ``type_ids``;
    ``context_length`` = the window length T, ``position_count`` optional, for GPT-2's mean positional offset).
    Rogue-dimension pinning (App. I): ``pin_dims`` (e.g. :func:`rogue_dimensions`) are held at
    ``pin_values`` -- ``[L+1, d]`` (one corpus value per layer) or ``[L+1, N, d]`` (per type) -- at every layer,
    including the start (:func:`pin_values`).
    """
    L = adapter.n_layers
    if init is None:
        if type_ids is None:
            raise ValueError("rollout needs type_ids= (or init=)")
        init = initial_centroids(adapter, type_ids, context_length, position_count)
    c = _t(adapter, init)
    if c.ndim != 2 or c.shape[1] != adapter.d_model:
        raise ValueError(f"init must be [N, d={adapter.d_model}]; got {tuple(c.shape)}")
    n = c.shape[0]
    _check_kernel(adapter, kernel, n)
    b_all = _t(adapter, _bos_for(adapter, bos_resid))
    dims = vals = None
    if pin_dims is not None and len(pin_dims) > 0:
        if pin_values is None:
            raise ValueError("pin_dims needs pin_values")
        dims = torch.as_tensor(np.asarray(pin_dims), dtype=torch.long, device=adapter.device)
        vals = _t(adapter, pin_values)
        if vals.shape[0] < L + 1 or vals.shape[-1] != adapter.d_model or vals.ndim not in (2, 3):
            raise ValueError(f"pin_values must be [L+1, d] or [L+1, N, d]; got {tuple(vals.shape)}")
    c = _pin(c, dims, vals, 0)
    out, carry = [c], {}  # carry: a state the blocks hand each other beside the residual (Zaya's), along the run
    for layer in range(L):
        if layer in adapter.attention_layers:
            reads = head_reads(adapter, layer, np.asarray(kernel[layer]), c, b_all[layer])
            c = block_update(adapter, layer, c, reads, carry)
        else:  # a hybrid's block of another mixer: the model's own block on each centroid (mixer_block says why)
            c = mixer_block(adapter, layer, c)
        c = _pin(c, dims, vals, layer + 1)
        out.append(c)
    return _np(torch.stack(out))


# ------------------------------------------------------------------------------- teacher-forced (Sec. 4.3)
@torch.no_grad()
def teacher_forced_attention(adapter, kernel, centroids, bos_resid, zbar) -> tuple[np.ndarray, np.ndarray]:
    """Fig. ``tf-attention``: per layer, the predicted attention-block output ``sum_h ẑ_s^{lh} @ W_O^{lh}``
    computed from the TRUE centroids ``c^l`` (not rolled out) vs the measured ``sum_h zbar_s^{lh} @ W_O^{lh}``.

    ``kernel [L, H, N, N+2]``; ``centroids [L(+1), N, d]`` (true ``c^l``; the ``<other>`` column is valued at
    their mean over types); ``bos_resid [L(+1), d]``; ``zbar [L, H, N, dh]`` the measured mean per-head read
    of type-``s`` queries (``read_sum / query_count``). Both returned ``[L, N, d]`` in residual space, without
    the output-projection bias and post-attention norm (a shared offset, removed by the centred metrics).
    Score them with :func:`mfpipe.experiments.rollout.metrics.score_layers`.
    """
    L = adapter.n_layers
    n = np.asarray(centroids[0]).shape[0]
    _check_kernel(adapter, kernel, n)
    b_all = _t(adapter, _bos_for(adapter, bos_resid))
    pred, meas = [], []
    for layer in range(L):
        if layer not in adapter.attention_layers:  # a hybrid's other mixer: no attention output (NaN rows)
            pred.append(torch.full((n, adapter.d_model), float("nan"), device=adapter.device))
            meas.append(pred[-1])
            continue
        c = _t(adapter, centroids[layer])
        zhat = head_reads(adapter, layer, np.asarray(kernel[layer]), c, b_all[layer])
        zb = _t(adapter, zbar[layer]).transpose(0, 1)  # [N, H, dh]
        pred.append(attention_output(adapter, layer, zhat, bias=False, at=c))  # an output gate: the true centroid's
        meas.append(attention_output(adapter, layer, zb, bias=False, at=c))
    return _np(torch.stack(pred)), _np(torch.stack(meas))


@torch.no_grad()
def error_decomposition(adapter, P, centroids, bos_resid, zbar, mu, vbar=None, support=None) -> dict[str, np.ndarray]:
    """Fig. ``error-decomp``: three nested teacher-forced predictions of ``c^{l+1}`` from the true ``c^l``,
    each ending with the block's own output projection, post-attention norm and the MLP applied once at the
    resulting centroid (:func:`block_update`). Returns ``{"a", "b", "c"}`` -> ``[L, N, d]`` (entry ``l``
    predicts ``centroids[l+1]``; score against the held-out true ``c^{1..L}``). Per head, the read of a
    type-``s`` query is

    * (a) exact attention: the measured mean read ``zbar_s`` (eq:exact-contribution-by-type); only the MLP
      (and, Gemma-2 / OLMo-2, the post-attention norm) is taken at the centroid.
    * (b), the paper's, when pass 2's ``vbar [L, H, N, dh]`` = ``sum_{t<N, supp} P_st E_s[vbar_t]`` is given
      (:mod:`mfpipe.deviation.pass2`, ``vbar_tracked``: E_s[vbar_t] the count-weighted mean over type-``s`` contexts of
      the attention-weighted in-context value of the type-``t`` keys, on the kernel's support ``support [N, N]``,
      C_st >= min_count): ``zbar_s + sum_{t<N, supp} P_st v(c_t) - vbar_s``, i.e. E_s[vbar_t] swapped for
      v(c_t) with the covariance kept; off the support the measured contribution stays inside ``zbar_s`` like
      ``<bos>`` and ``<other>``.
    * (b) without pass 2 (a statistics store alone), with unconditional value means:
      ``zbar_s + sum_{t<N} P_st (v(c_t) - mu_t)``: ``mu_t`` (mean value over all type-``t`` positions) stands in
      for ``E_s[vbar_t]``, so this (b) also assumes value-query independence; the covariance and any query
      dependence of the values stay in ``zbar_s - sum_t P_st mu_t``.
      In both forms only the tracked columns change: ``<bos>`` is one deterministic position
      (``E_s[vbar_bos] = v(b^l)`` exactly) and ``<other>`` is no type with a centroid, so both stay as
      measured inside ``zbar_s``.
    * (c) the full mean field (eq:mean-field with App. E's two extra columns, as Alg. 1 values them):
      ``sum_{t<N} P_st v(c_t) + P_s<bos> v(b^l) + P_s<other> v(cbar^l)``, ``cbar^l`` the mean of the ``N``
      true tracked centroids. This is the only estimator in which ``<other>`` is valued at a centroid.

    ``P [L, H, N, N+2]``; ``centroids [L(+1), N, d]``; ``bos_resid [L(+1), d]``; ``zbar [L, H, N, dh]``;
    ``mu [L, H, N(+2), dh]`` (``value_sum / key_count``; only the tracked columns are read); ``vbar`` /
    ``support`` from pass 2 over the same half (:func:`mfpipe.experiments.rollout.accounting.pass2_value_terms`). All from one
    half (the caller's choice: the statistics half, :func:`mfpipe.experiments.rollout.accounting.error_decomposition_predictions`).
    """
    L = adapter.n_layers
    n = np.asarray(centroids[0]).shape[0]
    _check_kernel(adapter, P, n)
    b_all = _t(adapter, _bos_for(adapter, bos_resid))
    out: dict[str, list[Tensor]] = {"a": [], "b": [], "c": []}
    carry = {k: {} for k in out}  # each estimator's own state between blocks, where the blocks hand one on (Zaya's)
    for layer in range(L):
        if layer not in adapter.attention_layers:  # a hybrid's other mixer: no attention estimator (NaN rows)
            for v in out.values():
                v.append(torch.full((n, adapter.d_model), float("nan"), device=adapter.device))
            continue
        c = _t(adapter, centroids[layer])
        K = _t(adapter, np.asarray(P[layer]))
        keys = torch.cat([c, b_all[layer][None], c.mean(0, keepdim=True)], dim=0)
        V = adapter.value_map(layer, keys).float()  # [N+2, H, dh]
        M = _t(adapter, np.asarray(mu[layer])[:, :n]).transpose(0, 1)  # [N, H, dh]
        zb = _t(adapter, zbar[layer]).transpose(0, 1)  # [N, H, dh]
        if vbar is None:
            b_read = zb + torch.einsum("hst,thd->shd", K[..., :n], V[:n] - M)
        else:
            Ks = K[..., :n] * _t(adapter, np.asarray(support, dtype=np.float64)[:, :n])
            b_read = zb + torch.einsum("hst,thd->shd", Ks, V[:n]) - _t(adapter, vbar[layer]).transpose(0, 1)
        reads = {
            "a": zb,
            "b": b_read,
            "c": torch.einsum("hst,thd->shd", K, V),
        }
        for k, r in reads.items():
            out[k].append(block_update(adapter, layer, c, r, carry[k]))
    return {k: _np(torch.stack(v)) for k, v in out.items()}


# --------------------------------------------------------------------------------- rogue pinning (App. I)
def rogue_dimensions(centroids, factor: float = 15.0, layers=None) -> np.ndarray:
    """App. I: sorted dims whose per-dimension RMS over the type centroids, ``sqrt(mean_t c^l_{t,d}^2)``,
    exceeds ``factor`` x that layer's median RMS over dims at SOME layer (``layers``: indices into
    ``centroids [L+1, N, d]``; default all)."""
    c = np.asarray(centroids, dtype=np.float64)
    if c.ndim != 3:
        raise ValueError(f"centroids must be [layers, N, d]; got {c.shape}")
    if layers is not None:
        c = c[layers]
    rms = np.sqrt((c**2).mean(axis=1))  # [layers, d]
    med = np.median(rms, axis=1, keepdims=True)
    return np.flatnonzero((rms > factor * med).any(axis=0))


def pin_values(centroids, mode: str = "mean") -> np.ndarray:
    """The corpus values the pinned dims are held at, from the stats-half centroids ``[L+1, N, d]``:
    ``mode="mean"`` -> ``[L+1, d]``, the all-type centroid (one value per layer and dim, the default: rogue
    dims are near context- and type-invariant); ``mode="type"`` -> ``[L+1, N, d]``, each type's own centroid."""
    c = np.asarray(centroids, dtype=np.float32)
    if mode == "mean":
        return c.mean(axis=1)
    if mode == "type":
        return c.copy()
    raise ValueError(f"mode must be 'mean' or 'type', got {mode!r}")
