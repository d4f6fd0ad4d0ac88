"""The J-lens (paper App. P, Lens "vocabulary-space decode"; the refinement of Gurnee et al. 2026): a vector
``u`` inserted into the residual stream at layer ``ℓ`` is read out as ``unembed(J_ℓ u)`` instead of the raw logit
lens's ``unembed(u)``, where

    J_ℓ = E[ ∂h^(L)_t / ∂h^(ℓ)_t ]

is the model's average linear account of how content inserted at layer ``ℓ`` reaches the final residual ``h^(L)``
(the input of the final norm), averaged over positions of the statistics half of the corpus. ``unembed`` is
:meth:`~mfpipe.models.adapters.base.Adapter.unembed` (final norm, ``W_U``, any logit soft-cap), exactly as the raw
lens applies it, so at the final point, where ``J = I``, the two lenses coincide.

Decisions (see also the module docstring of :mod:`mfpipe.models.adapters.jacobian`, which computes the blocks):

* **Same position only** (``t' = t``). The lens reads a vector out at the position where it is written (a head's
  write, an injected function vector); how later positions depend on it is not what the readout at ``t`` sees.
* **Positions.** ``n_positions`` positions in all, spread over the windows of the statistics half in a seeded random
  order of the windows (cycling when there are fewer windows than positions), each ``t`` uniform on ``[1, T-1]``
  (never the BOS position 0): :func:`sample_positions`, a ``numpy`` Generator seeded with ``seed``. The paper
  estimates ``J`` over OpenWebText; how many positions is this pipeline's choice (config ``jlens.n_positions``).
* **Two insertion points per layer**, both from one backward: ``"block"``, the residual entering block ``ℓ``
  (``ℓ = 0..L-1``) plus ``ℓ = L``, the final residual itself, where ``J_L = I`` exactly (the sanity check); and
  ``"attn"``, the output of block ``ℓ``'s attention output projection before any post-attention norm, where a head's
  write ``O_h z`` lands (head vectors decode there; NaN at ``ℓ = L``).
* Float32 Jacobians are accumulated in float64 and stored in float32 (``J``, dims ``point, layer, out, in``:
  ``J[p, ℓ] @ u`` maps an inserted vector to the final residual).
* **Checks** (:mod:`mfpipe.jlens.checks`): the same backward passes also sum the Jacobians of four nested-prefix
  blocks of the sampled order beside the total (``J`` is unchanged, bit for bit), from which the store keeps the
  split-half difference and the convergence with the number of positions (``check_split_half``,
  ``check_convergence``); the job adds the raw / J-lens decode agreement (:mod:`mfpipe.jlens.agreement`) and writes
  both to its checks table.

The store (``results/jlens/<model>/<revision>/jlens.zarr``) records its provenance (model, revision, corpus
fingerprint, ...); :func:`open_jlens` refuses one computed for anything else than what the caller expects.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import xarray as xr

from mfpipe.stats.api import ProvenanceError

__all__ = ["POINTS", "KIND", "sample_positions", "estimate_jlens", "write_jlens", "open_jlens", "jlens_matrix",
           "jlens_decode", "raw_decode", "JLensProvenanceError"]

POINTS = ("block", "attn")
KIND = "jlens"
DESCRIPTION = ("J[point, layer] = E[d h^L_t / d x_t] over sampled positions t of the statistics half, x the "
               "residual entering block `layer` (point block; layer L: the final residual, J = I) or the attention "
               "output projection's output of block `layer` (point attn, before any post-attention norm); "
               "J @ u maps a vector inserted at x to the final residual (the input of the final norm)")


class JLensProvenanceError(ProvenanceError):
    """A J-lens store computed for another model, revision or corpus than the caller expects (a
    :class:`~mfpipe.stats.api.ProvenanceError`, so callers catching that catch this too)."""


def sample_positions(n_windows: int, context_length: int, n_positions: int, seed: int
                     ) -> tuple[np.ndarray, np.ndarray]:
    """``(window [n_positions], position [n_positions])`` int64: the windows in a random order of the ``n_windows``
    (cycled when ``n_positions > n_windows``) and a position uniform on ``[1, context_length - 1]`` for each, from
    ``numpy.random.default_rng(seed)``."""
    n_windows, T, n = int(n_windows), int(context_length), int(n_positions)
    if n_windows < 1 or T < 2 or n < 1:
        raise ValueError(f"the J-lens needs at least one window of >= 2 tokens and one position, got {n_windows} "
                         f"windows of {T} tokens and n_positions={n}")
    rng = np.random.default_rng(int(seed))
    order = rng.permutation(n_windows)
    window = order[np.arange(n) % n_windows].astype(np.int64)
    position = rng.integers(1, T, size=n, dtype=np.int64)
    return window, position


def estimate_jlens(adapter, windows: np.ndarray, *, n_positions: int, seed: int, batch_size: int,
                   progress: bool = True, grad_chunk: int = 16, desc: str = "jlens",
                   dtype=np.float32, prefix_cache: bool = True, check_rows: int | None = 256,
                   sum_dtype: str = "float64") -> xr.Dataset:
    """The J-lens estimate of the model of ``adapter`` over ``windows [n, T]`` (token ids of the statistics half).

    :func:`sample_positions` picks ``n_positions`` (window, position) pairs; batches of ``batch_size`` of them, in
    order of position (one position per batch row; a window may appear twice in a batch, rows are independent) go
    through
    :func:`~mfpipe.models.adapters.jacobian.position_jacobians` (``grad_chunk`` backward passes batched at a time,
    each through the sampled token alone, its prefix held as the model's key/value cache), summed in float64 and
    divided by ``n_positions``. ``prefix_cache=False`` runs every window whole instead (the same estimate up to
    rounding; ``benchmarks/jlens.py`` times both). ``sum_dtype``: the sums' dtype (``"float32"`` halves the largest
    array of the job, ``2 (L+1) d^2``: 8.6 GB instead of 17.2 at Qwen3-14B's shape, for a relative rounding of about
    ``n_positions`` x 2^-24 at worst, below the float32 ``J`` it is stored as for n_positions up to a few thousand).
    A model whose blocks are streamed (:mod:`mfpipe.models.adapters.streaming`) reads each block's weights again in
    every backward call instead of keeping them in the graph.

    Returns an :class:`xarray.Dataset`: ``J`` (point, layer, out, in) in ``dtype`` (NaN at ``attn``, layer ``L``),
    ``n_positions`` (scalar), ``sample_window`` / ``sample_position`` (sample) and attrs ``kind``, ``model_type``,
    ``n_layers``, ``d_model``, ``context_length``, ``n_windows``, ``n_positions``, ``seed``, ``batch_size``,
    ``model_dtype``, ``mfpipe_version``. Add the provenance (model, revision, corpus) with :func:`write_jlens`.

    ``check_rows`` (default 256; None: no checks): the estimate's checks on its own sample (:mod:`mfpipe.jlens.checks`)
    from the same backward passes, the Jacobians of four nested-prefix blocks of the sampled order summed beside the
    total on ``check_rows`` output dimensions (all of them when ``d <= check_rows``, else a random subset seeded with
    ``seed + 2``), which leaves ``J`` as it is bit for bit. They add ``check_split_half`` (point, layer): the relative
    Frobenius difference of the estimates over the two halves of the sample, ``check_convergence`` (point, layer,
    ``n_check``): that of the estimate over the first ``n_check`` samples from ``J`` (``n_check`` the distinct
    positive ``n//8, n//4, n//2, n``), NaN at (``attn``, ``L``), and attrs ``check_rows`` (the output dimensions
    compared) and ``check_bounds`` (the blocks' boundaries)."""
    from mfpipe.jlens import checks as C
    from mfpipe.stats.store import code_version

    windows = np.asarray(windows)
    if windows.ndim != 2:
        raise ValueError(f"windows must be [n, T] token ids, got shape {windows.shape}")
    n_win, T = windows.shape
    win, pos = sample_positions(n_win, T, n_positions, seed)
    L, d, bs = adapter.n_layers, adapter.d_model, max(1, int(batch_size))
    keep = None if check_rows is None else C.check_row_indices(d, check_rows, int(seed) + 2)
    total, by_group = _jacobian_sums(adapter, windows, win, pos, bs, keep, progress=progress, desc=desc,
                                     grad_chunk=grad_chunk, prefix_cache=prefix_cache, sum_dtype=sum_dtype)
    # divided in place and converted once: no second copy of the sums beside them (the job's largest array)
    J = total.div_(len(win)).cpu().numpy().astype(dtype, copy=False)
    del total
    attrs = {"kind": KIND, "model_type": adapter.model_type, "n_layers": int(L), "d_model": int(d),
             "context_length": int(T), "n_windows": int(n_win), "n_positions": len(win), "seed": int(seed),
             "batch_size": bs, "model_dtype": str(adapter.dtype).replace("torch.", ""), "positions": "same",
             "mfpipe_version": code_version()}
    ds = xr.Dataset(
        {"J": (("point", "layer", "out", "in"), J, {"description": DESCRIPTION}),
         "n_positions": ((), np.int64(len(win)), {"description": "positions averaged over"}),
         "sample_window": (("sample",), win, {"description": "window (row of the statistics half's windows)"}),
         "sample_position": (("sample",), pos, {"description": "position t in the window (1..T-1)"})},
        coords={"point": np.asarray(POINTS, dtype=object), "layer": np.arange(L + 1)},  # object: zarr v3 vlen strings
        attrs=attrs,
    )
    if keep is not None:
        split, conv = C.sample_checks(by_group, len(win))
        ds["check_split_half"] = (("point", "layer"), split, {
            "description": "||J_A - J_B||_F / ||J||_F on the rows check_rows, J_A / J_B the estimates over the first "
                           "/ second half of the samples (disjoint position samples)"})
        ds["check_convergence"] = (("point", "layer", "n_check"), conv, {
            "description": "||J_k - J||_F / ||J||_F on the rows check_rows, J_k the estimate over the first k = "
                           "n_check samples (a nested prefix of the sampled order)"})
        ds = ds.assign_coords(n_check=np.asarray(C.check_sizes(len(win)), dtype=np.int64))
        ds.attrs.update(check_rows=[int(i) for i in keep], check_bounds=C.sample_bounds(len(win)))
    return ds


def _jacobian_sums(adapter, windows, win, pos, bs: int, keep, *, progress: bool, desc: str, grad_chunk: int,
                   prefix_cache: bool, sum_dtype: str = "float64"):
    """``(total [2, L+1, d, d], by_group [4, 2, L+1, r, d] or None)`` float64 over the samples ``(win, pos)`` of
    :func:`estimate_jlens`; ``by_group`` (the block sums of :mod:`mfpipe.jlens.checks`) where ``keep`` names the
    ``r`` output dimensions kept."""
    import torch

    from mfpipe.jlens import checks as C
    from mfpipe.models.adapters.jacobian import jacobian_sums, position_jacobians
    from mfpipe.models.adapters.streaming import saved_from_checkpoint

    if sum_dtype not in ("float64", "float32"):
        raise ValueError(f"jlens.sum_dtype must be float64 or float32, got {sum_dtype!r}")
    dt = getattr(torch, sum_dtype)
    # the sums are added to in place, batch after batch: one buffer of each, none of a batch's own beside them
    total = jacobian_sums(adapter, dtype=dt)
    by_group, groups = None, None
    if keep is not None:
        groups, keep = C.sample_groups(len(win)), torch.from_numpy(np.asarray(keep)).to(adapter.device)
        by_group = jacobian_sums(adapter, n_groups=C.N_GROUPS, keep=keep, dtype=dt)
    # batched in order of position: the rows of one position share a prefix forward (and, for a model without a
    # key/value cache, each batch is cut after its largest position); the sum does not depend on the order
    order = np.argsort(pos, kind="stable")
    starts = range(0, len(win), bs)
    if progress:
        from tqdm.auto import tqdm

        starts = tqdm(starts, desc=desc, unit="batch", dynamic_ncols=True, mininterval=2.0)
    for b0 in starts:
        k = order[b0 : b0 + bs]
        ids = torch.from_numpy(windows[win[k]].astype(np.int64))
        with saved_from_checkpoint():  # a streamed model's blocks read again in each backward, not kept in the graph
            if groups is None:
                position_jacobians(adapter, ids, torch.from_numpy(pos[k]), grad_chunk=grad_chunk,
                                   prefix_cache=prefix_cache, into=total)
            else:
                position_jacobians(adapter, ids, torch.from_numpy(pos[k]), grad_chunk=grad_chunk,
                                   prefix_cache=prefix_cache, groups=torch.from_numpy(groups[k]), group_rows=keep,
                                   n_groups=C.N_GROUPS, into=total, into_groups=by_group)
    return total, by_group


def _plain(v: Any) -> Any:
    if isinstance(v, np.generic):
        return v.item()
    return v


def write_jlens(path, ds: xr.Dataset, provenance: Mapping[str, Any] | None = None) -> Path:
    """Write ``ds`` (from :func:`estimate_jlens`) with ``provenance`` (e.g. ``model``, ``revision``,
    ``corpus_fingerprint``, ``half``) added to its attrs, as a zarr store at ``path``, atomically (a temporary sibling
    folder renamed into place once complete: an interrupted write leaves no store)."""
    from mfpipe.stats.store import write_store

    out = ds.copy()
    out.attrs = {k: _plain(v) for k, v in {**ds.attrs, **dict(provenance or {})}.items() if v is not None}
    return write_store(out, path)


def open_jlens(path, expect: Mapping[str, Any] | None = None) -> xr.Dataset:
    """The J-lens store at ``path``, loaded, refused (:class:`JLensProvenanceError`, one line naming the store, the
    key, what it holds and what was expected) unless every key of ``expect`` matches its attrs."""
    from mfpipe.stats.api import same_value
    from mfpipe.stats.store import open_zarr

    ds = open_zarr(path, "J-lens store", "run its jlens job").load()
    if ds.attrs.get("kind") != KIND or "J" not in ds:
        raise JLensProvenanceError(f"{path} is not a J-lens store (kind {ds.attrs.get('kind')!r}, no J): delete it "
                                   "and rerun the jlens job")
    for key, want in dict(expect or {}).items():
        if key not in ds.attrs:
            raise JLensProvenanceError(f"J-lens store {path} records no {key!r} (expected {want!r}): it was written "
                                       "by an older or different mfpipe; delete it and rerun the jlens job")
        have = ds.attrs[key]
        if not same_value(have, want):
            raise JLensProvenanceError(f"J-lens store {path} was computed for {key} {have!r}, expected {want!r}: "
                                       f"point to the store for {want!r} or delete {path} and rerun the jlens job")
    return ds


def jlens_matrix(J_ds: xr.Dataset, layer: int, point: str = "attn"):
    """``J[point, layer]`` as a float64 ``numpy`` array ``[d, d]`` (out, in); refused where it is not estimated
    (``attn`` at the final layer)."""
    if point not in POINTS:
        raise ValueError(f"J-lens point {point!r}: one of {POINTS}")
    L = int(J_ds.sizes["layer"]) - 1
    if not 0 <= int(layer) <= L:
        raise ValueError(f"J-lens layer {layer} outside 0..{L}")
    J = np.asarray(J_ds["J"].sel(point=point, layer=int(layer)).values, dtype=np.float64)
    if not np.isfinite(J).all():
        raise ValueError(f"the J-lens store has no J at point {point!r}, layer {layer} (the attn point has none at "
                         f"the final layer {L})")
    return J


def jlens_decode(adapter, J_ds: xr.Dataset, layer: int, point: str, vectors):
    """Logits ``[n, V]`` (float32 torch tensor) of the J-lens readout of ``vectors [n, d]`` inserted at ``point``
    (``"block"`` / ``"attn"``) of ``layer``: ``adapter.unembed(J u)`` with ``J u`` computed in float64. At
    (``"block"``, ``L``), ``J = I`` and this is :func:`raw_decode` bit for bit."""
    import torch

    J = jlens_matrix(J_ds, layer, point)
    if J.shape != (adapter.d_model, adapter.d_model):
        raise ValueError(f"the J-lens store has d_model {J.shape[0]}, the model {adapter.d_model}: it belongs to "
                         "another model")
    u = torch.as_tensor(vectors).to(device=adapter.device, dtype=torch.float64)
    Ju = u @ torch.as_tensor(J, device=adapter.device).T
    return adapter.unembed(Ju.to(adapter.dtype))


def raw_decode(adapter, vectors):
    """Logits ``[n, V]`` of the raw logit lens: ``adapter.unembed(u)`` (final norm, ``W_U``, soft-cap)."""
    import torch

    return adapter.unembed(torch.as_tensor(vectors).to(device=adapter.device, dtype=adapter.dtype))
