"""Where the raw logit lens and the J-lens agree, by layer (App. P: "the two readouts agree at late layers: at
layer 9 of GPT-2 the raw lens already broadly reproduces the J-lens decode, and at layer 11 they coincide").

:func:`decode_agreement` decodes real vectors of the model with both lenses at every (point, layer) the J-lens
estimates and counts how often the readouts agree:

* **vectors.** ``n_decode`` positions of the statistics half's windows, sampled as the estimate's are
  (:func:`~mfpipe.jlens.lens.sample_positions`, positions ``1..T-1``) but with another seed (the estimate's + 1), so
  they are not the positions ``J`` was averaged over. At ``attn`` of layer ``ℓ``: each head's write ``O_h z``
  (the head's read at the output projection's input times its slice of the projection, no bias:
  :meth:`~mfpipe.models.adapters.base.Adapter.out_proj_slices`; on a model whose attention gates its reads, z times
  the model's own gate of that position, :func:`~mfpipe.models.adapters.gate.gate_reads`), ``n_decode x H`` vectors,
  where the lenses decode head writes. At ``block`` of layer ``ℓ``: the residual entering block ``ℓ`` (``LayerCapture.resid_in``), and at
  ``ℓ = L`` the final residual (the final norm's input, where ``J = I``), ``n_decode`` vectors. One traced forward
  per batch (:meth:`~mfpipe.models.adapters.site.TracedSite.run`), each window cut after its batch's largest position.
* **agreement.** ``top1_agreement``: the share of vectors whose raw decode (:func:`~mfpipe.jlens.lens.raw_decode`)
  and J-lens decode (:func:`~mfpipe.jlens.lens.jlens_decode`) have the same argmax; ``top10_overlap``: the mean of
  ``|top10_raw ∩ top10_J| / 10``. At (``block``, ``L``) the two decodes are the same logits bit for bit, so both
  are 1 exactly.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from mfpipe.jlens.lens import POINTS, jlens_decode, raw_decode, sample_positions
from mfpipe.models.adapters.gate import gate_reads

__all__ = ["TOP_K", "decode_vectors", "decode_agreement"]

TOP_K = 10
CHUNK = 256  # vectors decoded at once: two [CHUNK, V] float32 logit tensors at a time


def decode_vectors(adapter, windows: np.ndarray, *, n_decode: int, seed: int, batch_size: int) -> dict:
    """``{(point, layer): float32 torch tensor [n, d]}`` (on the CPU) of the vectors :func:`decode_agreement`
    decodes, from ``n_decode`` positions ``sample_positions(n_windows, T, n_decode, seed)`` of ``windows [n, T]``:
    ``("attn", ℓ)`` every head's write ``O_h z`` (``[n_decode * H, d]``, position-major), ``("block", ℓ)`` the
    residual entering block ``ℓ`` and ``("block", L)`` the final residual (``[n_decode, d]``)."""
    import torch

    windows = np.asarray(windows)
    win, pos = sample_positions(windows.shape[0], windows.shape[1], n_decode, seed)
    L, d, bs = adapter.n_layers, adapter.d_model, max(1, int(batch_size))
    W = [adapter.out_proj_slices(l).float() for l in range(L)]  # [H, dh, d]
    A = getattr(adapter, "attention_layers", range(L))  # a hybrid's other layers have no heads' writes
    got: dict = {(p, l): [] for p in POINTS for l in range(L + 1) if not (p == "attn" and (l == L or l not in A))}
    for b0 in range(0, len(win), bs):
        k = np.arange(b0, min(b0 + bs, len(win)))
        ids = torch.from_numpy(windows[win[k], : int(pos[k].max()) + 1].astype(np.int64))
        rows = torch.arange(len(k), device=adapter.device)
        at = torch.from_numpy(pos[k]).to(adapter.device)

        def on_layer(cap, rows=rows, at=at):
            if cap.reads is not None:
                # [B, H, dh] as it enters the output projection: times the gate of its own position, where gated
                z = gate_reads(adapter, cap.layer, cap.reads[rows, at], cap.resid_in[rows, at])
                got["attn", cap.layer].append(torch.einsum("bhe,hed->bhd", z, W[cap.layer]).reshape(-1, d).cpu())
            got["block", cap.layer].append(cap.resid_in[rows, at].cpu())

        def on_final(h, rows=rows, at=at):
            got["block", L].append(h[rows, at].cpu())

        adapter.run(ids, select=("reads", "resid_in"), on_layer=on_layer, on_final=on_final)
    return {key: torch.cat(v).float() for key, v in got.items()}


def _agree(raw, lens, k: int) -> tuple:
    """Per vector: whether the argmaxes of the logits ``raw`` and ``lens [n, V]`` coincide, and the share of their top
    ``k`` tokens in common."""
    import torch

    same = raw.argmax(-1) == lens.argmax(-1)
    a, b = torch.topk(raw, k, dim=-1).indices, torch.topk(lens, k, dim=-1).indices
    overlap = (a[:, :, None] == b[:, None, :]).any(-1).sum(-1).double() / k
    return same.cpu(), overlap.cpu()


def decode_agreement(adapter, J_ds, windows: np.ndarray, *, n_decode: int, batch_size: int,
                     seed: int | None = None) -> pd.DataFrame:
    """The raw / J-lens decode agreement of the model of ``adapter`` under the J-lens ``J_ds`` (from
    :func:`~mfpipe.jlens.lens.estimate_jlens`) on vectors from ``n_decode`` positions of ``windows [n, T]`` (the
    statistics half's), sampled with ``seed`` (default: the estimate's ``seed`` + 1, positions apart from ``J``'s).

    One row per (point, layer) where ``J`` is estimated (``block`` 0..L, ``attn`` 0..L-1): ``point``, ``layer``,
    ``top1_agreement`` (the share of vectors whose two decodes have the same top token), ``top10_overlap`` (the mean
    share of their top-10 tokens in common; top ``V`` for a vocabulary under 10), ``n_decode`` (positions) and
    ``n_vectors`` (vectors decoded: ``n_decode`` at ``block``, ``n_decode x H`` at ``attn``)."""
    import torch

    if seed is None:
        seed = int(J_ds.attrs["seed"]) + 1
    vectors = decode_vectors(adapter, windows, n_decode=n_decode, seed=seed, batch_size=batch_size)
    rows = []
    for (point, layer), u in sorted(vectors.items(), key=lambda kv: (POINTS.index(kv[0][0]), kv[0][1])):
        same, overlap = [], []
        for c0 in range(0, len(u), CHUNK):
            raw = raw_decode(adapter, u[c0 : c0 + CHUNK])
            k = min(TOP_K, raw.shape[-1])
            s, o = _agree(raw, jlens_decode(adapter, J_ds, layer, point, u[c0 : c0 + CHUNK]), k)
            same.append(s)
            overlap.append(o)
        rows.append({"point": point, "layer": layer, "top1_agreement": float(torch.cat(same).double().mean()),
                     "top10_overlap": float(torch.cat(overlap).mean()), "n_decode": int(n_decode),
                     "n_vectors": len(u)})
    return pd.DataFrame(rows)
