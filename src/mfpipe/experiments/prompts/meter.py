"""Experiment 1 of Sec. 6.1, the instance meter: on ``[BOS; c; c]`` (``c`` a chunk of eval-half text of length ``k``,
:func:`~mfpipe.experiments.prompts.sets.meter_sequences`) every position is a query with the whole prefix as its
context. Over the sequences, per query position: the mean next-token loss and the mean ``D_MF`` (mean over layers
and heads of D = 1 − cos(z, ẑ), eq:deviation, residual-stream units, the pass-2 math of
:func:`~mfpipe.experiments.prompts.classes.deviation_forward`), both over the sequences where the position is a valid query
(tracked type with a valid Â row in every layer); each head's mean D per position, and the head whose mean D rises
most from copy 1 to copy 2; per matched token pair (copy-1 position ``i`` in ``1..k-1`` and its copy-2 match
``i + k``, both valid) the in-context loss reduction ``loss(copy 1) − loss(copy 2)`` against the deviation rise
``D_MF(copy 2) − D_MF(copy 1)``, binned into equal-count bins (mean ± s.e.m.) with its Spearman correlation.
Vectorized over positions; one traced forward per batch of sequences.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch

from mfpipe.experiments.prompts.classes import deviation_forward, kernel_for
from mfpipe.meanfield.kernel import MeanFieldKernel

__all__ = ["MeterResult", "instance_meter", "meter_tables"]


@dataclass
class MeterResult:
    """Sums over ``[BOS; c; c]`` sequences of length ``T = 1 + 2k`` (float64 numpy; per position ``p``: the
    prediction made at ``p``, of token ``p + 1``)."""

    k: int
    n_sequences: int = 0
    loss_sum: np.ndarray | None = None  # [T-1] next-token loss at valid positions
    loss_all_sum: np.ndarray | None = None  # [T-1] at every position
    n_valid: np.ndarray | None = None  # [T] sequences where p is a valid query
    D_sum: np.ndarray | None = None  # [T] D_MF at valid positions
    head_sum: np.ndarray | None = None  # [T, L, H] D at valid positions
    pairs: list = field(default_factory=list)  # (loss reduction, deviation rise) arrays per batch

    @property
    def T(self) -> int:
        return 1 + 2 * self.k


def instance_meter(adapter, kernel: MeanFieldKernel, sequences: np.ndarray, *, batch_size: int = 8,
                   progress: bool = False, desc: str = "icl meter") -> MeterResult:
    """Experiment 1 over ``sequences [n, 1 + 2k]`` (:func:`~mfpipe.experiments.prompts.sets.meter_sequences`): one
    traced forward per batch with the pass-2 reads and the next-token loss."""
    from tqdm.auto import tqdm

    seqs = np.asarray(sequences, dtype=np.int64)
    n, T = seqs.shape
    if T % 2 != 1 or T < 3:
        raise ValueError(f"meter sequences must be [BOS; c; c] (odd length >= 3), got length {T}")
    kk = (T - 1) // 2
    if not np.array_equal(seqs[:, 1 : 1 + kk], seqs[:, 1 + kk :]):
        raise ValueError("meter sequences must repeat their chunk: [BOS; c; c]")
    k = kernel_for(kernel, adapter)
    L, H = adapter.n_layers, adapter.n_heads
    attention = list(k.attention_layers or range(L))
    r = MeterResult(kk, 0, np.zeros(T - 1), np.zeros(T - 1), np.zeros(T), np.zeros(T), np.zeros((T, L, H)))
    i1 = torch.arange(1, kk)  # copy-1 positions whose next token is in copy 1; copy-2 match: + k
    for b0 in tqdm(range(0, n, int(batch_size)), desc=desc, disable=not progress, mininterval=2.0,
                   dynamic_ncols=True):
        ids = torch.from_numpy(seqs[b0 : b0 + int(batch_size)])
        kb, qt = k.buckets(ids.numpy())
        m, valid, res = deviation_forward(adapter, k, ids, kb, qt, loss=True)
        tl = res.token_loss.double().cpu()  # [B, T-1]
        valid, D = valid.cpu(), m["D"].cpu()  # [B, T], [B, T, L, H]
        vf = valid.double()
        dmf = D[:, :, attention].mean((2, 3))  # over the attention layers' heads (a hybrid's others: NaN, no heads)
        r.n_sequences += ids.shape[0]
        r.loss_sum += (tl * vf[:, :-1]).sum(0).numpy()
        r.loss_all_sum += tl.sum(0).numpy()
        r.n_valid += vf.sum(0).numpy()
        r.D_sum += torch.where(valid, dmf, 0.0).sum(0).numpy()
        r.head_sum += torch.where(valid[:, :, None, None], D, 0.0).sum(0).numpy()  # other layers' heads stay NaN
        both = valid[:, i1] & valid[:, i1 + kk]
        r.pairs.append(((tl[:, i1] - tl[:, i1 + kk])[both].numpy(), (dmf[:, i1 + kk] - dmf[:, i1])[both].numpy()))
    return r


def _binned(x: np.ndarray, y: np.ndarray, n_bins: int) -> pd.DataFrame:
    """Equal-count bins of ``x`` (sorted): per bin n, x range and mean, mean of y and its s.e.m."""
    order = np.argsort(x, kind="stable")
    rows = []
    for j, idx in enumerate(np.array_split(order, min(int(n_bins), max(len(x), 1)))):
        if not len(idx):
            continue
        yy = y[idx]
        rows.append({"bin": j, "n": len(idx), "rise_lo": x[idx].min(), "rise_hi": x[idx].max(),
                     "rise_mean": x[idx].mean(), "loss_reduction_mean": yy.mean(),
                     "loss_reduction_sem": yy.std(ddof=1) / np.sqrt(len(idx)) if len(idx) > 1 else float("nan")})
    return pd.DataFrame(rows, columns=["bin", "n", "rise_lo", "rise_hi", "rise_mean", "loss_reduction_mean",
                                       "loss_reduction_sem"])


def meter_tables(r: MeterResult, n_bins: int = 10) -> dict[str, pd.DataFrame]:
    """``curves`` (per position: copy, mean loss at valid positions and at all, mean D_MF, n_valid, the top head's
    mean D), ``heads`` (per head: mean D over the valid positions of copy 1 and of copy 2, rise), ``bins``
    (loss reduction binned by deviation rise, equal-count) and a one-row ``summary``."""
    from scipy.stats import spearmanr

    T, kk = r.T, r.k
    with np.errstate(invalid="ignore", divide="ignore"):
        nv = r.n_valid
        loss = np.append(r.loss_sum / nv[:-1], np.nan)
        loss_all = np.append(r.loss_all_sum / max(r.n_sequences, 1), np.nan)
        dmf = r.D_sum / nv
        head_pos = r.head_sum / nv[:, None, None]
        c1, c2 = slice(1, 1 + kk), slice(1 + kk, T)
        d1 = r.head_sum[c1].sum(0) / nv[c1].sum()
        d2 = r.head_sum[c2].sum(0) / nv[c2].sum()
    rise = d2 - d1
    L, H = rise.shape
    top = np.unravel_index(np.nanargmax(rise), rise.shape) if np.isfinite(rise).any() else (0, 0)
    pos = np.arange(T)
    curves = pd.DataFrame({"position": pos, "copy": np.where(pos == 0, 0, np.where(pos <= kk, 1, 2)),
                           "loss": loss, "loss_all": loss_all, "D_MF": dmf, "n_valid": nv.astype(np.int64),
                           "top_head_D": head_pos[:, top[0], top[1]]})
    ll, hh = np.meshgrid(np.arange(L), np.arange(H), indexing="ij")
    heads = pd.DataFrame({"layer": ll.ravel(), "head": hh.ravel(), "D_copy1": d1.ravel(), "D_copy2": d2.ravel(),
                          "rise": rise.ravel()})
    red = np.concatenate([p[0] for p in r.pairs]) if r.pairs else np.zeros(0)
    dr = np.concatenate([p[1] for p in r.pairs]) if r.pairs else np.zeros(0)
    bins = _binned(dr, red, n_bins)
    rho, p = spearmanr(dr, red) if len(dr) > 2 else (float("nan"), float("nan"))
    w = lambda s: float(r.D_sum[s].sum() / nv[s].sum()) if nv[s].sum() else float("nan")  # noqa: E731
    wl = lambda s: float(r.loss_sum[s].sum() / nv[s].sum()) if nv[s].sum() else float("nan")  # noqa: E731
    summary = pd.DataFrame([{"n_sequences": r.n_sequences, "k": kk, "top_layer": int(top[0]), "top_head": int(top[1]),
                             "top_head_rise": float(rise[top]), "top_head_D_copy1": float(d1[top]),
                             "top_head_D_copy2": float(d2[top]), "D_MF_copy1": w(slice(1, 1 + kk)),
                             "D_MF_copy2": w(slice(1 + kk, T)), "loss_copy1": wl(slice(1, kk)),
                             "loss_copy2": wl(slice(1 + kk, T - 1)), "n_pairs": int(len(dr)),
                             "spearman_rho": float(rho), "spearman_p": float(p)}])
    return {"curves": curves, "heads": heads, "bins": bins, "summary": summary}
