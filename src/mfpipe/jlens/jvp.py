"""The J-lens decode through forward-mode products (issue 58): ``unembed(J_ℓ v)`` without ``J``.

``J_ℓ v = (1/n) Σ_t J_{ℓ,t} v`` over the J-lens sample, each ``J_{ℓ,t} v`` one Jacobian-vector product of the final
residual at ``t`` with respect to the insertion point at ``t``
(:func:`~mfpipe.models.adapters.jvp.position_jvps`: the prefix held as the model's key/value cache, the vectors
batched as tangent rows of one forward of the token). The sample is the store's:
:func:`~mfpipe.jlens.lens.sample_positions` of the statistics half's windows with the same ``n_positions`` and
``seed``, so ``J v`` here equals ``J @ v`` of :func:`~mfpipe.jlens.lens.estimate_jlens`'s ``J`` up to float rounding
(``tests/test_jlens_jvp.py``: 1e-5) and the decode equals :func:`~mfpipe.jlens.lens.jlens_decode`'s. At
(``block``, ``L``) ``J = I``: ``J v = v`` exactly and the decode is the raw lens bit for bit.

What it costs: the full ``J`` runs ``d`` backward passes per position (every row), this one forward pass per vector
per position (each from its own layer up). A consumer that decodes fewer vectors than ``d`` per (model, revision)
saves the difference; one that decodes many (the function vectors: every head of every clean prompt) reads the
store. Config ``jlens.decode`` chooses (:func:`mfpipe.jlens.rules.decode_path`).

* :class:`JLensSample` — the windows and the seeded positions (no model), from the corpus stage's shards
  (:meth:`JLensSample.from_shards`) or given windows;
* :func:`jvp_products` — ``J v`` per vector, float64;
* :func:`lens_logits` — ``unembed(J v)`` through either a store or a sample (what the consumers call).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mfpipe.jlens.lens import POINTS, jlens_decode, sample_positions

__all__ = ["JLensSample", "statistics_windows", "jvp_products", "lens_logits", "DEFAULT_CHUNK"]

DEFAULT_CHUNK = 64  # vectors whose tangents run in one forward (jlens.jvp_chunk)


def statistics_windows(shards) -> np.ndarray:
    """The statistics half's windows ``[n, T]`` (token ids) of the corpus stage's folder ``shards``, in the sorted
    order of its shards, as the J-lens job reads them."""
    from mfpipe.corpus.windows import list_shards, read_shard

    paths = list_shards(Path(shards) / "stats")
    if not paths:
        raise FileNotFoundError(f"{Path(shards) / 'stats'} holds no shard: rerun the corpus stage (corpus_shards)")
    return np.concatenate([read_shard(x).tokens for x in paths])


@dataclass
class JLensSample:
    """The J-lens's sample without its ``J``: ``windows [n, T]`` of the statistics half, ``n_positions`` positions
    drawn with ``seed`` (:func:`~mfpipe.jlens.lens.sample_positions`, as the store's), ``batch_size`` positions per
    call of the products, ``chunk`` vectors per forward; ``attrs`` provenance for the consumer's records."""

    windows: np.ndarray
    n_positions: int = 256
    seed: int = 0
    batch_size: int = 8
    chunk: int = DEFAULT_CHUNK
    progress: bool = False
    attrs: dict = field(default_factory=dict)

    @classmethod
    def from_shards(cls, shards, **kw) -> JLensSample:
        """The sample of the corpus stage's folder ``shards`` (its ``fingerprint.json`` in ``attrs``)."""
        from mfpipe.stats.halves import corpus_info

        info = corpus_info(Path(shards))
        attrs = {"corpus": info.get("corpus"), "corpus_fingerprint": info.get("fingerprint"), "half": "stats"}
        return cls(statistics_windows(shards), attrs={**attrs, **kw.pop("attrs", {})}, **kw)

    def positions(self) -> tuple[np.ndarray, np.ndarray]:
        """``(window, position)`` of every sampled position: the store's sample."""
        w = np.asarray(self.windows)
        return sample_positions(w.shape[0], w.shape[1], int(self.n_positions), int(self.seed))


def jvp_products(adapter, sample: JLensSample, vectors, layers, points, *, desc: str = "jlens jvp"):
    """``J v`` float64 ``[n, d]`` (torch, on the adapter's device) for ``vectors [n, d]`` inserted at (``points``,
    ``layers``): ``points`` one of :data:`~mfpipe.jlens.lens.POINTS` or one per vector, ``layers`` an int or one per
    vector. The mean over the sample's positions, batched in order of position as the estimate batches them (rows of
    one position share a prefix forward)."""
    import torch

    from mfpipe.models.adapters.jvp import position_jvps

    V = torch.as_tensor(vectors).to(device=adapter.device)
    if V.ndim != 2 or V.shape[1] != adapter.d_model:
        raise ValueError(f"vectors must be [n, d = {adapter.d_model}], got {tuple(V.shape)}")
    n = V.shape[0]
    layers = np.broadcast_to(np.asarray(layers, dtype=np.int64), (n,))
    points = [points] * n if isinstance(points, str) else list(points)
    if any(p not in POINTS for p in points) or len(points) != n:
        raise ValueError(f"J-lens points: one of {POINTS} per vector, got {sorted(set(map(str, points)))}")
    final = torch.as_tensor(np.asarray([p == "block" and int(l) == adapter.n_layers
                                        for p, l in zip(points, layers)]), device=V.device)
    out = torch.zeros(n, adapter.d_model, dtype=torch.float64, device=V.device)
    rest = torch.nonzero(~final).reshape(-1)
    if len(rest):
        windows = np.asarray(sample.windows)
        win, pos = sample.positions()
        order = np.argsort(pos, kind="stable")  # rows of one position share a prefix forward
        starts = range(0, len(order), max(1, int(sample.batch_size)))
        if sample.progress:
            from tqdm.auto import tqdm

            starts = tqdm(starts, desc=desc, unit="batch", dynamic_ncols=True, mininterval=2.0)
        idx = rest.cpu().numpy()
        for b0 in starts:
            k = order[b0 : b0 + max(1, int(sample.batch_size))]
            out[rest] += position_jvps(adapter, windows[win[k]].astype(np.int64), pos[k], V[rest],
                                       layers[idx], [points[i] for i in idx], chunk=int(sample.chunk))
        out[rest] /= len(pos)
    out[final] = V[final].double()  # J_L = I: the vector itself, exactly
    return out


def lens_logits(adapter, lens, layer: int, point: str, vectors):
    """Logits ``[n, V]`` of the J-lens readout of ``vectors [n, d]`` inserted at (``point``, ``layer``): through a
    J-lens store (:func:`~mfpipe.jlens.lens.jlens_decode`) or a :class:`JLensSample` (``adapter.unembed(J v)``,
    ``J v`` by :func:`jvp_products` cast to the model's dtype as the store's decode casts ``J u``)."""
    if isinstance(lens, JLensSample):
        Jv = jvp_products(adapter, lens, vectors, int(layer), point)
        return adapter.unembed(Jv.to(adapter.dtype))
    return jlens_decode(adapter, lens, layer, point, vectors)
