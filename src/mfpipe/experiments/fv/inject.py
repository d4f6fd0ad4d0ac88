"""Injecting function vectors into zero-shot prompts (Sec. 6.4, App. fv), through the adapter's read/patch site.

Two protocols (Todd et al.'s Eqs. 5 and 14, and the paper's per-head variant):

* ``"sum"``: the selected heads' vectors mapped to the residual stream and summed, ``v = Σ_h O_h v^{ℓh}``, then
  ``scale · v`` added to the residual stream entering block ``layer`` at the final token (``patch_resid``);
* ``"per_head"``: each selected head's vector ``scale · v^{ℓh}`` added to that head's read at the final token of
  its own layer (``patch_reads``; on post-attention-norm blocks it passes through that norm, as the head does).

:func:`evaluate` runs many injections at once: every (injection, prompt) pair is one row of an unpadded batch, and
the callbacks add each row's own vector, so a whole sweep is a few forwards.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from mfpipe.experiments.fv.heads import last_logits
from mfpipe.experiments.fv.prompts import FVPrompt, by_length

__all__ = ["Injection", "sum_injection", "per_head_injection", "evaluate", "summed_vector"]


@dataclass
class Injection:
    """One intervention: ``resid`` = (layer, vector [d]) added to the residual entering that block, and/or
    ``heads`` = {layer: (head indices [k], vectors [k, dh])} added to those heads' reads; ``None``: no injection
    (the zero-shot floor)."""

    resid: tuple[int, Tensor] | None = None
    heads: dict[int, tuple[Tensor, Tensor]] | None = None


def summed_vector(vectors: Tensor, heads, O: Tensor) -> Tensor:
    """``Σ_h O_h v^{ℓh}`` over ``heads`` [(layer, head)] of per-head vectors ``[L, H, dh]`` (residual units)."""
    out = torch.zeros(O.shape[-1], dtype=torch.float32)
    for l, h in heads:
        out += vectors[l, h].float() @ O[l, h]
    if not torch.isfinite(out).all():  # (a head of a hybrid's other layers has NaN reads: no head to inject)
        bad = [f"L{l}H{h}" for l, h in heads if not torch.isfinite(vectors[l, h].float() @ O[l, h]).all()]
        raise ValueError(f"function vector: the heads {' '.join(bad)} have no finite vector; select heads of the "
                         "attention layers")
    return out


def sum_injection(vectors: Tensor, heads, O: Tensor, layer: int, scale: float) -> Injection:
    return Injection(resid=(int(layer), float(scale) * summed_vector(vectors, heads, O)))


def per_head_injection(vectors: Tensor, heads, scale: float) -> Injection:
    by: dict[int, list[int]] = {}
    for l, h in heads:
        by.setdefault(int(l), []).append(int(h))
    return Injection(heads={l: (torch.as_tensor(hs), float(scale) * vectors[l, hs].float()) for l, hs in by.items()})


def evaluate(adapter, prompts: list[FVPrompt], injections: list[Injection], *, batch_size: int = 64,
             progress=None) -> tuple[np.ndarray, np.ndarray]:
    """The model's top-1 token ``[n_inj, n_prompts]`` and the answer's probability (same shape) at each prompt's
    final token under each injection."""
    n_i, n_p = len(injections), len(prompts)
    top1, pa = np.zeros((n_i, n_p), np.int64), np.zeros((n_i, n_p))
    H, dh = adapter.n_heads, adapter.d_head
    for _, pidx in sorted(by_length(prompts).items()):
        rows = [(i, j) for i in range(n_i) for j in pidx]
        for r0 in range(0, len(rows), max(1, int(batch_size))):
            ch = rows[r0 : r0 + max(1, int(batch_size))]
            B = len(ch)
            ids = torch.from_numpy(np.stack([prompts[j].tokens for _, j in ch]))
            resid_layer = torch.full((B,), -1, dtype=torch.long)
            resid_vec = None
            head_add: dict[int, Tensor] = {}
            for b, (i, _) in enumerate(ch):
                inj = injections[i]
                if inj.resid is not None:
                    if resid_vec is None:
                        resid_vec = torch.zeros(B, adapter.d_model)
                    resid_layer[b] = inj.resid[0]
                    resid_vec[b] = inj.resid[1]
                for l, (hs, vs) in (inj.heads or {}).items():
                    add = head_add.setdefault(l, torch.zeros(B, H, dh))
                    add[b, hs] += vs

            def patch_resid(layer, resid, resid_layer=resid_layer, resid_vec=resid_vec):
                m = torch.nonzero(resid_layer == layer).flatten()
                if resid_vec is None or not len(m):
                    return None
                out = resid.clone()
                dev = out.device
                out[m.to(dev), -1] += resid_vec[m].to(dev, out.dtype)
                return out

            def patch_reads(layer, reads, head_add=head_add):
                if layer not in head_add:
                    return None
                out = reads.clone()
                out[:, -1] += head_add[layer].to(out.device, out.dtype)
                return out

            got: dict = {}
            adapter.run(ids, select=(), patch_resid=patch_resid if resid_vec is not None else None,
                        patch_reads=patch_reads if head_add else None,
                        on_final=lambda x, got=got: got.setdefault("f", x))
            lg = last_logits(adapter, got["f"]).float()
            ans = torch.as_tensor([prompts[j].answer for _, j in ch], device=lg.device)
            t1 = lg.argmax(-1).cpu().numpy()
            p = torch.softmax(lg, -1)[torch.arange(B, device=lg.device), ans].double().cpu().numpy()
            for b, (i, j) in enumerate(ch):
                top1[i, j], pa[i, j] = t1[b], p[b]
            if progress is not None:
                progress.update(B)
    return top1, pa
