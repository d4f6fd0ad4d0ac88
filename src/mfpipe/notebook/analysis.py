"""Forward-pass analyses of a model in memory against a statistics half, each the pipeline's own code on given windows:
:func:`substitute` (Sec. 5.1: :func:`mfpipe.experiments.substitution.substitute.substitution_pass`, the substitution
job's), :func:`deviation` (Sec. 6: pass 2's per-context terms, :func:`mfpipe.deviation.contexts.context_meters`) and
:func:`decode` (App. P: the raw logit lens or the J-lens of a residual-stream vector)."""

from __future__ import annotations

import numpy as np
import xarray as xr

from mfpipe.notebook.inputs import (NotebookError, as_stats, bos_id_of, by_length, check_fits, check_stats,
                                    prepared, resolve_model, text_windows, token_strings)
from mfpipe.notebook.meanfield import MeanField, pad_windows, result_attrs

__all__ = ["substitute", "deviation", "decode"]


def _setup(model, stats, tokens_or_texts, tokenizer):
    """(hf model, tokenizer, MeanFieldStats, windows grouped by length) of an analysis call."""
    hf, tok = resolve_model(model, tokenizer)
    st = as_stats(stats)
    blocks = text_windows(tokens_or_texts, tok, bos_id_of(hf, tok, st), None)
    check_fits(hf, blocks)
    return hf, tok, st, by_length(blocks)


def _kernel(st, hf, groups, min_count):
    vocab = max(int(getattr(hf.config, "vocab_size", 0) or 0), max(int(g.max()) for g in groups) + 1)
    return MeanField(st, min_count).kernel(vocab)


def _token_coords(groups, tok) -> dict:
    ids = pad_windows(groups, -1)
    coords = {"token_id": (("window", "position"), ids)}
    if tok is not None:
        coords["token"] = (("window", "position"), token_strings(tok, ids))
    return coords


def substitute(model, stats, tokens_or_texts, *, tokenizer=None, min_count: int | None = None, tracked=None,
               batch_size: int = 8, device=None, progress: bool = False) -> xr.Dataset:
    """Mean-field substitution (Sec. 5.1) of ``model`` on the windows: every head's read at every tracked query
    position replaced by ẑ_sX of ``stats`` (two forwards per batch, the substitution job's code). Returns the
    substitution store's variables (``L_model``, ``L_MF``, ``delta_L``, ``D_MF``, ``head_deviation`` (layer, head),
    coverage) and per position ``loss_model`` / ``loss_mf`` (the prediction of the next token made there, NaN at the
    last position), ``deviation`` (D_sX, the mean over heads and layers; NaN where not substituted) and
    ``substituted``. Texts are one window each, BOS-led; token windows must start with the statistics' BOS.

    Example::

        sub = mfpipe.substitute(model, ds, "To be, or not to be, that is the question", tokenizer=tok)
        float(sub["delta_L"]), sub["loss_mf"] - sub["loss_model"]
    """
    from mfpipe.experiments.substitution.substitute import SubstitutionSums, result_dataset, substitution_pass
    from mfpipe.workflow.numerics import numerics_info

    hf, tok, st, groups = _setup(model, stats, tokens_or_texts, tokenizer)
    with prepared(hf, device) as adapter:
        check_stats(adapter, st, tracked)
        kernel = _kernel(st, hf, groups, min_count)
        total, details = SubstitutionSums(adapter.n_layers, adapter.n_heads), []
        for g in groups:
            total.add(substitution_pass(adapter, kernel, g, batch_size=batch_size, progress=progress, details=details))
    ds = result_dataset(total, result_attrs(st, groups, "substitute", kernel=kernel.attrs.get("kernel"),
                                            min_count=kernel.attrs.get("min_count"), numerics=numerics_info()))
    per = {k: [d[k].numpy() for d in details] for k in ("token_loss_model", "token_loss_mf", "deviation", "substituted")}
    for k in ("token_loss_model", "token_loss_mf"):  # [B, T-1] -> [B, T]: the prediction made at each position
        per[k] = [np.concatenate([x, np.full((len(x), 1), np.nan)], axis=1) for x in per[k]]
    pos = ("window", "position")
    ds = ds.assign({"loss_model": (pos, pad_windows(per["token_loss_model"], np.nan)),
                    "loss_mf": (pos, pad_windows(per["token_loss_mf"], np.nan)),
                    "deviation": (pos, pad_windows(per["deviation"], np.nan)),
                    "substituted": (pos, pad_windows(per["substituted"], False))})
    return ds.assign_coords(_token_coords(groups, tok))


def deviation(model, stats, tokens_or_texts, *, tokenizer=None, min_count: int | None = None, tracked=None,
              reads: str | None = None, batch_size: int = 8, device=None, progress: bool = False) -> xr.Dataset:
    """Every head's mean-field deviation at every query position of the windows (Sec. 6, pass 2's terms): ``D`` =
    1 − cos(z, ẑ), ``M_cov``, ``M_ctx`` (M_cov + M_ctx = D) as (window, position, layer, head), NaN where the position
    is no valid query in that layer (``valid``). ``reads="head"`` adds the read ``z`` and the mean field ``zhat`` in
    head space (head_dim), ``reads="resid"`` the same through each head's slice of the output projection (dim: the
    head's write, what :func:`decode` reads).

    Example::

        dev = mfpipe.deviation(model, ds, prompt, tokenizer=tok, reads="resid")
        dev["D"].sel(layer=1, head=0).squeeze("window")          # along the prompt
    """
    from mfpipe.deviation.contexts import METERS, context_meters

    if reads not in (None, "head", "resid"):
        raise NotebookError(f"reads={reads!r}: give None, 'head' or 'resid'")
    hf, tok, st, groups = _setup(model, stats, tokens_or_texts, tokenizer)
    with prepared(hf, device) as adapter:
        check_stats(adapter, st, tracked)
        kernel = _kernel(st, hf, groups, min_count)
        outs = [context_meters(adapter, kernel, g, batch_size=batch_size, reads=reads is not None, progress=progress)
                for g in groups]
        O = [adapter.out_proj_slices(l).float().cpu().numpy() for l in range(adapter.n_layers)] if reads == "resid" \
            else None
    dims = ("window", "position", "layer", "head")
    data = {m: (dims, pad_windows([o[m] for o in outs], np.nan)) for m in METERS}
    data["valid"] = (dims[:3], pad_windows([o["valid"] for o in outs], False))
    for key in ("z", "zhat") if reads else ():
        x = pad_windows([o[key] for o in outs], np.nan)
        if O is not None:  # [.., L, H, dh] through O_h [dh, d] of each layer -> [.., L, H, d]
            x = np.stack([np.einsum("...hd,hde->...he", x[:, :, l], O[l]) for l in range(len(O))], axis=2)
        data[key] = (dims + ("dim" if O is not None else "head_dim",), x)
    ds = xr.Dataset(data, coords={"layer": np.arange(kernel.n_layers), "head": np.arange(kernel.W.shape[1]),
                                  **_token_coords(groups, tok)})
    ds.attrs.update(result_attrs(st, groups, "deviation", min_count=kernel.attrs.get("min_count"), reads=reads))
    return ds


def decode(model, vector, layer: int, lens: str = "raw", jlens=None, *, point: str = "attn", k: int = 10,
           tokenizer=None) -> xr.Dataset:
    """The top ``k`` tokens of residual-stream vectors ``vector`` ([d] or [n, d], e.g. a head's deviation z − ẑ
    through its output projection: :func:`deviation` with ``reads="resid"``) under the raw logit lens (``lens="raw"``:
    the final norm and the unembedding) or the J-lens of App. P (``lens="jlens"``: W_U J_ℓ, the average Jacobian of
    the final residual with respect to ``point`` ("attn": the attention output, "block": the block input) of
    ``layer``; ``jlens`` a J-lens store: its path or ``mfpipe.open_results("jlens", model, revision)``). Returns
    (vector, rank): ``token_id``, ``token``, ``logit``, ``prob``."""
    import torch

    hf, tok = resolve_model(model, tokenizer)
    v = torch.as_tensor(np.asarray(vector.values if isinstance(vector, xr.DataArray) else vector, dtype=np.float32))
    v = v[None] if v.ndim == 1 else v
    if lens not in ("raw", "jlens"):
        raise NotebookError(f"lens={lens!r}: give 'raw' or 'jlens'")
    with prepared(hf) as adapter, torch.no_grad():
        if v.ndim != 2 or v.shape[1] != adapter.d_model:
            raise NotebookError(f"vector has shape {tuple(v.shape)}: give [d] or [n, d] with d = {adapter.d_model}")
        if lens == "raw":
            logits = adapter.unembed(v.to(adapter.device, adapter.dtype))
        else:
            logits = _jlens_logits(adapter, jlens, int(layer), point, v)
        logit, idx = logits.float().topk(min(int(k), logits.shape[-1]), dim=-1)
        prob = torch.softmax(logits.float(), dim=-1).gather(-1, idx)
    ids = idx.cpu().numpy()
    strings = token_strings(tok, ids)
    dims = ("vector", "rank")
    return xr.Dataset({"token_id": (dims, ids), "token": (dims, strings), "logit": (dims, logit.cpu().numpy()),
                       "prob": (dims, prob.cpu().numpy())},
                      attrs={"lens": lens, "layer": int(layer), "point": point if lens == "jlens" else "none"})


def _jlens_logits(adapter, jlens, layer: int, point: str, v):
    from pathlib import Path

    from mfpipe.jlens.lens import jlens_decode, open_jlens

    if jlens is None:
        raise NotebookError("lens='jlens' needs jlens=: a J-lens store (its path, or mfpipe.open_results('jlens', "
                            "model, revision)); `snakemake results/jlens/<model>/<revision>/jlens.zarr` builds one")
    J = open_jlens(jlens) if isinstance(jlens, (str, Path)) else jlens
    if not 0 <= layer <= adapter.n_layers:
        raise NotebookError(f"layer {layer} is outside 0..{adapter.n_layers} of the model")
    return jlens_decode(adapter, J, layer, point, v)
