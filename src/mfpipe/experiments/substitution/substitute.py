"""Mean-field substitution (paper Sec. 5.1, eq:excess-loss, eq:dmf): the loss the model gives up when every
head's read is replaced by its context-conditional mean field ẑ_sX, and how far the reads are from it.

Per batch of held-out windows (the ``eval`` half, disjoint from the statistics half that gives W and μ):

1. ẑ for every layer from the window's token types alone (:meth:`mfpipe.meanfield.kernel.MeanFieldKernel.zhat`);
2. the clean forward (:meth:`Adapter.run`, reads selected, loss): ``L_model`` per prediction, and per
   substituted position and head ``1 - cos(z, ẑ)`` (D of eq:dmf / eq:deviation, on the model's own reads, in
   residual-stream units: :func:`mfpipe.meanfield.deviation.deviation_cosine`, the one definition pass 2 uses too;
   on a gated attention of the reads and ẑ times the query's own gate, as pass 2's: ``gate_head_major``);
3. the substituted forward: at every layer, the read of every head at every substituted position (tracked
   query type with a valid Â row, :mod:`mfpipe.meanfield.ccmf`) is replaced by ẑ at the output projection's input,
   through the same adapter site that reads the statistics (before the post-attention norm on Gemma-2 and
   OLMo-2); every other position keeps the model's own computation. ``L_MF`` per prediction.

Both losses are next-token cross entropies averaged over every prediction of the evaluation windows
(``B (T-1)`` per batch), so ``ΔL = L_MF - L_model`` is a paired difference on the same predictions.
``D_MF`` averages ``D_sX = mean_{l,h} (1 - cos)`` over the substituted positions; the per-head deviation
averages over the same positions. ``L_model_substituted`` / ``L_MF_substituted`` average the predictions made at
substituted positions (a window's last position predicts nothing), and ``substituted_share`` is their share of all
predictions. Sums are float64 and additive over batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from mfpipe.meanfield.deviation import deviation_cosine
from mfpipe.meanfield.kernel import MeanFieldKernel, Replacement, mean_field_replacement
from mfpipe.models.adapters.gate import has_gate

__all__ = ["SubstitutionSums", "substitution_batch", "substitution_pass", "result_dataset", "substitution_result"]

@dataclass
class SubstitutionSums:
    """Additive sums of the substitution (float64)."""

    n_layers: int
    n_heads: int
    n_windows: int = 0
    n_predictions: int = 0
    n_query_positions: int = 0  # positions >= 1 whose type is tracked
    n_substituted: int = 0  # of which substituted (valid Â row in every layer)
    n_substituted_predictions: int = 0  # predictions made at substituted positions (a window's last makes none)
    loss_model: float = 0.0  # sums over predictions
    loss_mf: float = 0.0
    loss_model_sub: float = 0.0  # sums over the predictions made at substituted positions
    loss_mf_sub: float = 0.0
    deviation: float = 0.0  # sum over substituted positions of D_sX
    head_deviation: np.ndarray | None = None  # [L, H] sums over substituted positions of 1 - cos

    def __post_init__(self):
        if self.head_deviation is None:
            self.head_deviation = np.zeros((self.n_layers, self.n_heads))

    def add(self, other: "SubstitutionSums") -> "SubstitutionSums":
        for k in ("n_windows", "n_predictions", "n_query_positions", "n_substituted", "n_substituted_predictions",
                  "loss_model", "loss_mf", "loss_model_sub", "loss_mf_sub", "deviation"):
            setattr(self, k, getattr(self, k) + getattr(other, k))
        self.head_deviation = self.head_deviation + other.head_deviation
        return self

    def summary(self) -> dict:
        # D_MF is a mean over substituted positions; the losses over the predictions made at them (a window's last
        # position is substituted or not but predicts nothing), and the share is of predictions too
        npred, nsub, nsp = max(self.n_predictions, 1), max(self.n_substituted, 1), self.n_substituted_predictions
        out = {
            "L_model": self.loss_model / npred,
            "L_MF": self.loss_mf / npred,
            "D_MF": self.deviation / nsub if self.n_substituted else float("nan"),
            "n_windows": self.n_windows,
            "n_predictions": self.n_predictions,
            "n_query_positions": self.n_query_positions,
            "n_substituted": self.n_substituted,
            "n_substituted_predictions": nsp,
            "substituted_share": nsp / npred,
            "L_model_substituted": self.loss_model_sub / nsp if nsp else float("nan"),
            "L_MF_substituted": self.loss_mf_sub / nsp if nsp else float("nan"),
        }
        out["delta_L"] = (self.loss_mf - self.loss_model) / npred
        out["delta_L_substituted"] = out["L_MF_substituted"] - out["L_model_substituted"]
        return out


def substitution_batch(adapter, kernel: MeanFieldKernel, tokens, replacement: Replacement = mean_field_replacement
                       ) -> tuple[SubstitutionSums, dict]:
    """One batch of windows ``tokens [B,T]``: both forwards, the sums, and per-position detail
    (``token_loss_model``/``token_loss_mf [B,T-1]``, ``deviation [B,T]`` (NaN where not substituted),
    ``substituted [B,T]``)."""
    ids = torch.as_tensor(np.asarray(tokens), dtype=torch.long)
    B, T = ids.shape
    L, H = adapter.n_layers, adapter.n_heads
    kb, qt = kernel.buckets(ids.numpy())
    zhat, sub = kernel.zhat(kb, qt)
    dev = adapter.device
    zhat = [z.to(dev) for z in zhat]
    sub_d = sub.to(dev)
    head_dev = torch.zeros(L, H, dtype=torch.float64)
    pos_dev = torch.zeros(B, T, dtype=torch.float64)
    grams = kernel.grams(adapter)

    def on_layer(cap):
        if cap.reads is None:  # a hybrid's layer of another mixer: no reads (its head deviation stays NaN)
            head_dev[cap.layer] = float("nan")
            return
        z, zh = cap.reads, zhat[cap.layer]
        if cap.resid_in is not None:  # a gated attention: D of the gated reads (meanfield.deviation.gate_head_major)
            g = adapter.read_gate(cap.layer, cap.resid_in, cap.reads)
            z, zh = z * g, zh * g
        d = deviation_cosine(z, zh, grams[cap.layer]) * sub_d[:, :, None]  # [B,T,H]
        head_dev[cap.layer] = d.sum((0, 1)).cpu()
        pos_dev.add_(d.sum(-1).cpu())

    clean = adapter.run(ids, select=("reads", "resid_in") if has_gate(adapter) else ("reads",), on_layer=on_layer,
                        loss=True)

    def patch(layer, reads):
        return replacement(layer, reads, zhat[layer], sub_d)

    patched = adapter.run(ids, select=(), patch_reads=patch, loss=True)
    tl_model = clean.token_loss.double().cpu()
    tl_mf = patched.token_loss.double().cpu()
    # the prediction made at position i (of token i+1) is substituted when position i is
    sub_pred = sub[:, :-1].cpu()
    pos_dev = pos_dev / (len(getattr(adapter, "attention_layers", range(L))) * H)  # over the heads of attention
    s = SubstitutionSums(L, H)
    s.n_windows = B
    s.n_predictions = B * (T - 1)
    s.n_query_positions = int((qt >= 0).sum())
    s.n_substituted = int(sub.sum())
    s.n_substituted_predictions = int(sub_pred.sum())
    s.loss_model = float(tl_model.sum())
    s.loss_mf = float(tl_mf.sum())
    s.loss_model_sub = float(tl_model[sub_pred].sum())
    s.loss_mf_sub = float(tl_mf[sub_pred].sum())
    s.deviation = float(pos_dev[sub.cpu()].sum())
    s.head_deviation = head_dev.numpy()
    detail = {"token_loss_model": tl_model, "token_loss_mf": tl_mf,
              "deviation": torch.where(sub.cpu(), pos_dev, torch.full_like(pos_dev, float("nan"))),
              "substituted": sub.cpu()}
    return s, detail


def substitution_pass(adapter, kernel: MeanFieldKernel, tokens, batch_size: int = 8,
                      replacement: Replacement = mean_field_replacement, progress: bool = False,
                      desc: str = "substitution", details: list | None = None) -> SubstitutionSums:
    """:func:`substitution_batch` over every window of ``tokens [n,T]`` in batches; additive sums. ``details``: a list
    each batch's per-position detail is appended to (``mfpipe.substitute``)."""
    from tqdm.auto import tqdm

    tokens = np.asarray(tokens)
    k = kernel.to(adapter.device)
    if k.W.shape[:2] != (adapter.n_layers, adapter.n_heads):
        raise ValueError(f"the kernel has (layers, heads) = {tuple(k.W.shape[:2])}, the model "
                         f"({adapter.n_layers}, {adapter.n_heads}): the statistics belong to another model")
    total = SubstitutionSums(adapter.n_layers, adapter.n_heads)
    starts = range(0, tokens.shape[0], int(batch_size))
    for b0 in tqdm(starts, desc=desc, disable=not progress, mininterval=2.0, dynamic_ncols=True):
        s, detail = substitution_batch(adapter, k, tokens[b0 : b0 + int(batch_size)], replacement)
        total.add(s)
        if details is not None:
            details.append(detail)
    return total


def result_dataset(sums: SubstitutionSums, attrs: dict):
    """The labelled result: scalars (0-d variables) and the per-head mean deviation (layer, head)."""
    import xarray as xr

    summ = sums.summary()
    data = {k: ((), float(v)) for k, v in summ.items()}
    nsub = max(sums.n_substituted, 1)
    data["head_deviation"] = (("layer", "head"), sums.head_deviation / nsub if sums.n_substituted
                              else np.full_like(sums.head_deviation, np.nan))
    ds = xr.Dataset(data, coords={"layer": np.arange(sums.n_layers), "head": np.arange(sums.n_heads)})
    ds.attrs.update({k: v for k, v in attrs.items() if v is not None})
    return ds


def substitution_result(sums: SubstitutionSums, kernel_attrs: dict, *, model: str, revision: str, corpus: dict,
                        tokens: np.ndarray, shards: list[str]):
    """The result store of one (model, revision) (:func:`result_dataset`): the kernel's provenance (its statistics
    store's ``n_tokens`` as ``stats_tokens``), the model, revision, held-out corpus and half fingerprints
    (``corpus``: the corpus info of :func:`mfpipe.workflow.context.open_forward_job`), the evaluation windows'
    tokens and shards, and the mfpipe version; ``n_tokens`` is the statistics store's again."""
    from mfpipe.version import __version__

    attrs = dict(kernel_attrs)
    attrs.update({"model": model, "revision": revision, "eval_corpus_fingerprint": corpus["fingerprint"],
                  "eval_half_fingerprint": corpus.get("halves", {}).get("eval", {}).get("fingerprint"),
                  "eval_tokens": int(tokens.size), "eval_shards": ",".join(shards), "mfpipe_version": __version__,
                  "stats_tokens": attrs.pop("n_tokens", None)})
    ds = result_dataset(sums, attrs)
    ds.attrs["n_tokens"] = attrs.get("stats_tokens")
    return ds


# ------------------------------------------------------------------ results across training
SWEEP_COLUMNS = ["model", "revision", "step", "L_model", "L_MF", "delta_L", "D_MF", "substituted_share",
                 "L_model_substituted", "L_MF_substituted", "delta_L_substituted", "n_predictions", "n_substituted",
                 "kernel", "min_count", "n_stats_tokens"]


def open_result(path, expect: dict | None = None):
    """A substitution result (``substitution.zarr``) as an xarray Dataset, provenance-checked like a store."""
    from mfpipe.stats.api import check_provenance
    from mfpipe.stats.store import open_zarr

    ds = open_zarr(path, "substitution result", "run its substitution job").load()
    check_provenance(ds.attrs, expect, path)
    return ds


def sweep_table(paths, revisions, steps, model: str):
    """One row per revision (training order): the losses, ΔL, D_MF and coverage of each substitution result."""
    import pandas as pd

    rows = []
    for path, rev, step in zip(paths, revisions, steps):
        ds = open_result(path, {"model": model, "revision": rev})
        row = {"model": model, "revision": rev, "step": step}
        for k in SWEEP_COLUMNS[3:13]:
            row[k] = float(ds[k].values)
        row["kernel"] = ds.attrs.get("kernel")
        row["min_count"] = ds.attrs.get("min_count")
        row["n_stats_tokens"] = ds.attrs.get("n_tokens")
        rows.append(row)
    df = pd.DataFrame(rows, columns=SWEEP_COLUMNS)
    for k in ("n_predictions", "n_substituted"):
        df[k] = df[k].astype("int64")
    return df


def head_deviation_table(paths, revisions, steps, model: str):
    """Long table (revision, step, layer, head, deviation): each head's mean 1 - cos(z, ẑ) per checkpoint."""
    import pandas as pd

    frames = []
    for path, rev, step in zip(paths, revisions, steps):
        ds = open_result(path, {"model": model, "revision": rev})
        df = ds["head_deviation"].to_dataframe(name="deviation").reset_index()
        df.insert(0, "step", step)
        df.insert(0, "revision", rev)
        frames.append(df)
    return pd.concat(frames, ignore_index=True)


def topn_table(paths, arms, model: str):
    """App. M: the sweep of every tracked-set size, ``arms`` = (N, revision, step) per path; a column
    ``n_tracked`` and ``delta_L_normalised`` (ΔL over the arm's value at its last revision)."""
    import pandas as pd

    frames = []
    for n in dict.fromkeys(a[0] for a in arms):
        sel = [(p, a) for p, a in zip(paths, arms) if a[0] == n]
        df = sweep_table([p for p, _ in sel], [a[1] for _, a in sel], [a[2] for _, a in sel], model)
        for p, _ in sel:
            got = open_result(p).attrs.get("n_tracked")
            if got is not None and int(got) != int(n):
                from mfpipe.stats.api import ProvenanceError

                raise ProvenanceError(f"substitution result {p} was computed with N={got}, its arm is N={n}")
        df.insert(1, "n_tracked", int(n))
        last = df["delta_L"].iloc[-1]
        df["delta_L_normalised"] = df["delta_L"] / last if last else float("nan")
        frames.append(df)
    return pd.concat(frames, ignore_index=True)
