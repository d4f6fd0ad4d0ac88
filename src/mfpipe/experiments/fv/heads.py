"""Per-head quantities of the function-vector experiment (Sec. 6.4, eq:taskresid; App. fv), all through the
adapter's one read/patch site (:meth:`mfpipe.models.adapters.Adapter.run`).

* :func:`cue_reads`: ONE forward per prompt (batched): every head's read ``z^{ℓh}`` at the final (cue) token,
  and the model's own top-1 / answer probability there.
* :func:`task_deviation`: ``r^{ℓh} = E_X[z^{ℓh}_{:,X}] − ẑ^{ℓh}_{:}`` (eq:taskresid) against the corpus null.
* :func:`corpus_null`: the null at the cue type from the statistics half: the mean field ``Σ_t P_st μ_t``
  (``"mean_field"``, the paper's ẑ_s) or the measured mean read at type-s positions (``"type_mean"``, the
  estimate the paper uses for GPT-J).
* :func:`head_norms`: ``‖O_h v‖`` per head (residual-stream units, output-projection bias excluded).
* :func:`written_slices`: the output projection's slices as a read's path to the residual at the cue: where the
  attention gates its reads (:mod:`mfpipe.models.adapters.gate`), times the gate of the cue (:class:`CueReads` ``g``).
* :func:`aie`: Todd et al.'s average indirect effect: each head's mean clean read patched into label-shuffled
  prompts at the final token, scored by the recovered probability of the answer.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from mfpipe.experiments.fv.prompts import FVPrompt, by_length
from mfpipe.models.adapters.gate import has_gate

__all__ = ["CueReads", "cue_reads", "corpus_null", "task_deviation", "head_norms", "top_heads", "random_heads",
           "aie", "last_logits", "parse_heads", "out_slices", "written_slices"]


class CueReads:
    """Reads ``z [n, L, H, dh]`` at the cue of each prompt (float32, CPU), the model's ``top1 [n]`` and the
    probability of the prompt's answer ``p_answer [n]`` there, in the prompts' order; where the attention gates its
    reads, ``g [n, L, H, dh]`` the model's own gate at each cue (1 at a hybrid's layers of another mixer), else None."""

    def __init__(self, z: Tensor, top1: np.ndarray, p_answer: np.ndarray, answers: np.ndarray,
                 g: Tensor | None = None):
        self.z, self.top1, self.p_answer, self.answers, self.g = z, top1, p_answer, answers, g

    @property
    def mean(self) -> Tensor:
        return self.z.mean(0)

    @property
    def accuracy(self) -> float:
        return float(np.mean(self.top1 == self.answers)) if len(self.answers) else float("nan")


def last_logits(adapter, final: Tensor) -> Tensor:
    """Logits ``[B, V]`` at the last position from the final residual ``[B, T, d]`` (the LM head on one position:
    a batch of prompts never materialises ``B·T·V`` logits)."""
    return adapter.unembed(final[:, -1])


def _chunks(idx: Sequence[int], size: int):
    for i in range(0, len(idx), max(1, int(size))):
        yield idx[i : i + max(1, int(size))]


def cue_reads(adapter, prompts: list[FVPrompt], *, batch_size: int = 16, progress=None) -> CueReads:
    """Every head's read at each prompt's last token, and the model's next-token prediction there (one forward per
    prompt, unpadded batches of equal length). Where the attention gates its reads, also the gate at each cue (of the
    residual entering each block there: :meth:`~mfpipe.models.adapters.gate.OutputGate.read_gate`)."""
    n, L, H, dh = len(prompts), adapter.n_layers, adapter.n_heads, adapter.d_head
    z = torch.zeros(n, L, H, dh, dtype=torch.float32)
    gated = has_gate(adapter)
    g = torch.ones(n, L, H, dh, dtype=torch.float32) if gated else None
    top1, pa = np.zeros(n, np.int64), np.zeros(n)
    answers = np.asarray([p.answer for p in prompts], dtype=np.int64)
    for _, idx in sorted(by_length(prompts).items()):
        for ch in _chunks(idx, batch_size):
            ids = torch.from_numpy(np.stack([prompts[i].tokens for i in ch]))
            got: dict = {}

            def on_layer(cap, got=got):  # a hybrid's layer of another mixer has no reads: NaN
                got[cap.layer] = (torch.full((len(ch), H, dh), float("nan")) if cap.reads is None
                                  else cap.reads[:, -1].detach().cpu())
                if gated and cap.reads is not None:
                    got["g", cap.layer] = adapter.read_gate(cap.layer, cap.resid_in[:, -1],
                                                              cap.reads[:, -1]).float().cpu()

            def on_final(x, got=got):
                got["final"] = x

            adapter.run(ids, select=("reads", "resid_in") if gated else ("reads",), on_layer=on_layer,
                        on_final=on_final)
            lg = last_logits(adapter, got["final"]).float()
            ch_t = torch.as_tensor(ch)
            z[ch_t] = torch.stack([got[l] for l in range(L)], dim=1)
            for l in (l for l in range(L) if ("g", l) in got):
                g[ch_t, l] = got["g", l]
            top1[ch] = lg.argmax(-1).cpu().numpy()
            pr = torch.softmax(lg, -1)
            pa[ch] = pr[torch.arange(len(ch)), torch.as_tensor(answers[ch], device=pr.device)].double().cpu().numpy()
            if progress is not None:
                progress.update(len(ch))
    return CueReads(z, top1, pa, answers, g)


def corpus_null(stats, tracked, cue_id: int, kind: str = "mean_field") -> Tensor:
    """The corpus null ``ẑ^{ℓh}_s`` at the cue type ``s`` ``[L, H, dh]`` from the statistics half (float32)."""
    lut = tracked.query_bucket_lut()
    q = int(lut[int(cue_id)]) if 0 <= int(cue_id) < len(lut) else -1
    if not 0 <= q < tracked.n:
        raise ValueError(
            f"the answer-cuing token id {cue_id} is not a tracked query type of this model's statistics, so it has "
            "no corpus mean field; raise tracked.n (or use a separator the corpus contains often)")
    if kind == "mean_field":
        z = stats.zhat()
    elif kind == "type_mean":
        z = stats.zbar()
    else:
        raise ValueError(f"fv.null = {kind!r}: use mean_field or type_mean")
    z = z.isel(query=q).transpose("layer", "head", "head_dim")
    return torch.from_numpy(np.asarray(z.values, dtype=np.float32))


def task_deviation(mean_reads: Tensor, null: Tensor) -> Tensor:
    """eq:taskresid: ``r^{ℓh} = E_X[z^{ℓh}_{:,X}] − ẑ^{ℓh}_{:}``, ``[L, H, dh]``."""
    return mean_reads.float() - null.float()


def out_slices(adapter) -> Tensor:
    """``O [L, H, dh, d]``: each head's slice of its layer's output projection (float32, CPU)."""
    return torch.stack([adapter.out_proj_slices(l).detach().float().cpu() for l in range(adapter.n_layers)])


def written_slices(O: Tensor, g: Tensor | None) -> Tensor:
    """``O [L, H, dh, d]`` as the path of a read-space vector to the residual at the cue: where the attention gates its
    reads (``g [n, L, H, dh]``, :class:`CueReads`), a read enters O_h times the gate of its query, here the mean of
    the cues' own gates over the prompts at hand. The vectors (r, the mean read) stay reads, as AIE and the per-head
    injection patch them and the model gates them with the prompt's own gate; their writes (the MFA and raw scores,
    the summed function vector and its decode) go through ``diag(mean gate) O_h``, what a per-head injection of them
    writes at a cue gated as the mean. ``O`` itself where ``g`` is None."""
    return O if g is None else g.float().mean(0)[..., None] * O


def head_norms(v: Tensor, O: Tensor) -> Tensor:
    """``‖O_h v^{ℓh}‖`` ``[L, H]`` (residual-stream units)."""
    return torch.einsum("lhe,lhed->lhd", v.float(), O).norm(dim=-1)


def top_heads(scores: Tensor, k: int, layers=None) -> list[tuple[int, int]]:
    """The ``k`` heads with the largest score, best first (ties: lower layer, then head), of ``layers`` only where
    given (a hybrid's attention layers: its other layers have no heads, their scores NaN or 0) and of finite scores
    only: fewer than ``k`` where fewer heads have one."""
    L, H = scores.shape
    flat = scores.reshape(-1).double().cpu().numpy().copy()
    if layers is not None:
        flat.reshape(L, H)[np.setdiff1d(np.arange(L), np.asarray(list(layers), dtype=int))] = np.nan
    keep = np.isfinite(flat)
    order = np.lexsort((np.arange(L * H), -np.where(keep, flat, -np.inf)))
    return [(int(i // H), int(i % H)) for i in order if keep[i]][: int(k)]


def parse_heads(names, n_layers: int, n_heads: int, what: str = "head list") -> list[tuple[int, int]]:
    """Heads written ``"L15H5"`` (layer 15, head 5; 0-based, Todd et al.'s and the paper's convention) ->
    ``[(15, 5), ...]`` in the given order; refused, naming ``what``, where a name is malformed, repeated or not a
    head of this model (``n_layers`` x ``n_heads``)."""
    import re

    out = []
    for name in names:
        m = re.fullmatch(r"L(\d+)H(\d+)", str(name).strip())
        if m is None:
            raise ValueError(f"{what}: {name!r} is not a head; write heads as L<layer>H<head>, e.g. L15H5 (0-based)")
        lh = (int(m.group(1)), int(m.group(2)))
        if not (lh[0] < n_layers and lh[1] < n_heads):
            raise ValueError(f"{what}: {name} is not a head of this model ({n_layers} layers x {n_heads} heads, "
                             f"L0H0..L{n_layers - 1}H{n_heads - 1}); the list belongs to another model")
        if lh in out:
            raise ValueError(f"{what}: {name} is listed twice")
        out.append(lh)
    if not out:
        raise ValueError(f"{what}: no heads")
    return out


def random_heads(n_layers: int, n_heads: int, k: int, seed, layers=None) -> list[tuple[int, int]]:
    """``k`` heads drawn without replacement (the random control) from ``layers`` (a hybrid's attention layers; all
    ``n_layers`` by default: the same draw as before they were given)."""
    layers = list(range(n_layers)) if layers is None else [int(l) for l in layers]
    n = len(layers) * n_heads
    pick = np.random.default_rng(seed).choice(n, size=min(int(k), n), replace=False)
    return [(layers[int(i // n_heads)], int(i % n_heads)) for i in pick]


def aie(adapter, corrupted: list[FVPrompt], clean_mean: Tensor, *, batch_size: int = 64, progress=None
        ) -> tuple[Tensor, float, Tensor]:
    """Average indirect effect of every head (Todd et al. 2024, their Eq. 4): for each corrupted prompt and head,
    the head's read at the final token replaced by its mean over clean prompts (``clean_mean [L,H,dh]``), the rest
    of the forward as is; AIE = mean over prompts of ``P(answer | patched) − P(answer | corrupted)``.

    Returns ``(aie [L, H], mean corrupted-prompt answer probability, per-prompt effects [n, L, H])``, NaN at a
    hybrid's layers without attention. One forward
    per (head, corrupted prompt), batched: row 0 of each prompt unpatched, rows 1.. one head each."""
    L, H, att = adapter.n_layers, adapter.n_heads, list(adapter.attention_layers)
    heads = [(l, h) for l in att for h in range(H)]  # a hybrid's other layers have no heads: NaN
    n = len(corrupted)
    eff = torch.full((n, L, H), float("nan"), dtype=torch.float64)
    base = np.zeros(n)
    cm = clean_mean.float()
    for k, p in enumerate(corrupted):
        rows = [None] + heads
        probs = []
        for ch in _chunks(list(range(len(rows))), batch_size):
            lay = torch.as_tensor([rows[i][0] if rows[i] else -1 for i in ch])
            hd = torch.as_tensor([rows[i][1] if rows[i] else -1 for i in ch])
            ids = torch.from_numpy(np.tile(p.tokens, (len(ch), 1)))
            got: dict = {}

            def patch(layer, reads, lay=lay, hd=hd):
                m = torch.nonzero(lay == layer).flatten()
                if not len(m):
                    return None
                out = reads.clone()
                out[m.to(out.device), -1, hd[m].to(out.device)] = cm[layer, hd[m]].to(out.device, out.dtype)
                return out

            adapter.run(ids, select=(), patch_reads=patch, on_final=lambda x, got=got: got.setdefault("f", x))
            probs.append(torch.softmax(last_logits(adapter, got["f"]).float(), -1)[:, p.answer].double().cpu())
        pr = torch.cat(probs)
        base[k] = float(pr[0])
        eff[k, att] = (pr[1:] - pr[0]).view(len(att), H)
        if progress is not None:
            progress.update(1)
    return eff.mean(0), float(base.mean()) if n else float("nan"), eff
