"""Forward-pass analyses of a model in memory against a statistics half, each the pipeline's own code on given windows:
:func:`substitute` (Sec. 5.1: :func:`mfpipe.experiments.substitution.substitute.substitution_pass`, the substitution
job's), :func:`deviation` (Sec. 6: pass 2's per-context terms, :func:`mfpipe.deviation.contexts.context_meters`) and
:func:`decode` (App. P: the raw logit lens or the J-lens of a residual-stream vector)."""

from __future__ import annotations

import numpy as np
import xarray as xr

from mfpipe.notebook.identity import check_identity, identity_attrs
from mfpipe.notebook.inputs import (NotebookError, as_stats, bos_id_of, by_length, check_fits, check_stats,
                                    in_input_order, positive_int, prepared, resolve_model, text_windows, token_strings)
from mfpipe.notebook.meanfield import MeanField, pad_windows, result_attrs

__all__ = ["substitute", "context_deviation", "decode"]


class _Call:
    """One analysis call's checked inputs: the model and tokenizer, the statistics, the windows as given
    (``blocks``), grouped by length for the forwards (``groups``) with ``order`` back to the input's."""

    def __init__(self, model, stats, tokens_or_texts, tokenizer, batch_size, min_count):
        self.batch_size = positive_int("batch_size", batch_size)
        self.min_count = positive_int("min_count", min_count, allow_none=True)
        self.hf, self.tok = resolve_model(model, tokenizer)
        self.st = as_stats(stats)
        self.blocks = text_windows(tokens_or_texts, self.tok, bos_id_of(self.hf, self.tok, self.st), None)
        check_fits(self.hf, self.blocks)
        self.groups, self.order = by_length(self.blocks)
        self.identity = identity_attrs(self.hf, self.tok)

    def check(self, adapter, tracked):
        """Refuse statistics of another shape, tracked set, weights, revision or tokenizer."""
        check_stats(adapter, self.st, tracked)
        check_identity(self.hf, self.tok, self.st.attrs, f"statistics {self.st.path or '(in memory)'}",
                       weights=self.identity["weights_fingerprint"])

    def kernel(self):
        vocab = max(int(getattr(self.hf.config, "vocab_size", 0) or 0), max(int(g.max()) for g in self.groups) + 1)
        return MeanField(self.st, self.min_count).kernel(vocab)

    def windows(self, parts: list[np.ndarray], fill) -> np.ndarray:
        """Per-window arrays of the groups' forwards, padded, in the input's order."""
        return in_input_order(pad_windows(parts, fill), self.order)

    def attrs(self, what: str, **extra) -> dict:
        return result_attrs(self.st, self.blocks, what, **self.identity, **extra)

    def token_coords(self) -> dict:
        ids = self.windows(self.groups, -1)
        coords = {"token_id": (("window", "position"), ids)}
        if self.tok is not None:
            coords["token"] = (("window", "position"), token_strings(self.tok, ids))
        return coords


def substitute(model, stats, tokens_or_texts, *, tokenizer=None, min_count: int | None = None, tracked=None,
               batch_size: int = 8, device=None, progress: bool = False) -> xr.Dataset:
    """Mean-field substitution (Sec. 5.1) of ``model`` on the windows: every head's read at every tracked query
    position replaced by ẑ_sX of ``stats`` (two forwards per batch, the substitution job's code). Returns the
    substitution store's variables (``L_model``, ``L_MF``, ``delta_L``, ``D_MF``, ``head_deviation`` (layer, head),
    coverage) and per position ``loss_model`` / ``loss_mf`` (the prediction of the next token made there, NaN at the
    last position), ``deviation`` (D_sX, the mean over heads and layers; NaN where not substituted) and
    ``substituted``. Texts are one window each, BOS-led; token windows must start with the statistics' BOS. Windows
    keep the input's order (``window`` i is the i-th), whatever their lengths.

    Example::

        sub = mfpipe.substitute(model, ds, "To be, or not to be, that is the question", tokenizer=tok)
        float(sub["delta_L"]), sub["loss_mf"] - sub["loss_model"]
    """
    from mfpipe.experiments.substitution.substitute import SubstitutionSums, result_dataset, substitution_pass
    from mfpipe.workflow.numerics import numerics_info

    c = _Call(model, stats, tokens_or_texts, tokenizer, batch_size, min_count)
    with prepared(c.hf, device) as adapter:
        c.check(adapter, tracked)
        kernel = c.kernel()
        total, details = SubstitutionSums(adapter.n_layers, adapter.n_heads), []
        for g in c.groups:
            total.add(substitution_pass(adapter, kernel, g, batch_size=c.batch_size, progress=progress,
                                        details=details))
    ds = result_dataset(total, c.attrs("substitute", kernel=kernel.attrs.get("kernel"),
                                       min_count=kernel.attrs.get("min_count"), numerics=numerics_info()))
    per = {k: [d[k].numpy() for d in details] for k in ("token_loss_model", "token_loss_mf", "deviation", "substituted")}
    for k in ("token_loss_model", "token_loss_mf"):  # [B, T-1] -> [B, T]: the prediction made at each position
        per[k] = [np.concatenate([x, np.full((len(x), 1), np.nan)], axis=1) for x in per[k]]
    pos = ("window", "position")
    ds = ds.assign({"loss_model": (pos, c.windows(per["token_loss_model"], np.nan)),
                    "loss_mf": (pos, c.windows(per["token_loss_mf"], np.nan)),
                    "deviation": (pos, c.windows(per["deviation"], np.nan)),
                    "substituted": (pos, c.windows(per["substituted"], False))})
    return ds.assign_coords(c.token_coords())


def context_deviation(model, stats, tokens_or_texts, *, tokenizer=None, min_count: int | None = None, tracked=None,
              reads: str | None = None, batch_size: int = 8, device=None, progress: bool = False) -> xr.Dataset:
    """Every head's mean-field deviation at every query position of the windows (Sec. 6, pass 2's terms): ``D`` =
    1 − cos(z, ẑ), ``M_cov``, ``M_ctx`` (M_cov + M_ctx = D) as (window, position, layer, head), NaN where the position
    is no valid query in that layer (``valid``). ``reads="head"`` adds the read ``z`` and the mean field ``zhat`` in
    head space (head_dim), ``reads="resid"`` the same through each head's slice of the output projection (dim: the
    head's write, what :func:`decode` reads; where the attention gates its reads, times the query's own gate first;
    they carry the model's ``weights_fingerprint``, which decode checks).
    Windows keep the input's order (``window`` i is the i-th), whatever their lengths.

    Example::

        dev = mfpipe.context_deviation(model, ds, prompt, tokenizer=tok, reads="resid")
        dev["D"].sel(layer=1, head=0).squeeze("window")          # along the prompt
    """
    from mfpipe.deviation.contexts import METERS, context_meters

    if reads not in (None, "head", "resid"):
        raise NotebookError(f"reads={reads!r}: give None, 'head' or 'resid'")
    c = _Call(model, stats, tokens_or_texts, tokenizer, batch_size, min_count)
    with prepared(c.hf, device) as adapter:
        c.check(adapter, tracked)
        kernel = c.kernel()
        outs = [context_meters(adapter, kernel, g, batch_size=c.batch_size, reads=reads is not None,
                               progress=progress) for g in c.groups]
        O = [adapter.out_proj_slices(l).float().cpu().numpy() for l in range(adapter.n_layers)] if reads == "resid" \
            else None
    dims = ("window", "position", "layer", "head")
    data = {m: (dims, c.windows([o[m] for o in outs], np.nan)) for m in METERS}
    data["valid"] = (dims[:3], c.windows([o["valid"] for o in outs], False))
    attrs = c.attrs("context_deviation", min_count=kernel.attrs.get("min_count"), reads=reads)
    # the reads go on to decode alone (a head's z - zhat at one position): they carry what decode checks
    read_attrs = {k: attrs[k] for k in ("model", "weights_fingerprint", "source", "tokens_fingerprint", "reads")
                  if k in attrs}
    for key in ("z", "zhat") if reads else ():
        x = c.windows([o[key] for o in outs], np.nan)
        if O is not None and "gate" in outs[0]:  # a gated attention: z and ẑ enter O_h times the query's own gate
            x = x * c.windows([o["gate"] for o in outs], np.nan)
        if O is not None:  # [.., L, H, dh] through O_h [dh, d] of each layer -> [.., L, H, d]
            x = np.stack([np.einsum("...hd,hde->...he", x[:, :, l], O[l]) for l in range(len(O))], axis=2)
        data[key] = (dims + ("dim" if O is not None else "head_dim",), x, read_attrs)
    ds = xr.Dataset(data, coords={"layer": np.arange(kernel.n_layers), "head": np.arange(kernel.W.shape[1]),
                                  **c.token_coords()})
    ds.attrs.update(attrs)
    return ds


def decode(model, vector, layer: int | None = None, lens: str = "raw", jlens=None, *, point: str = "attn",
           k: int = 10, tokenizer=None) -> xr.Dataset:
    """The top ``k`` tokens of residual-stream vectors ``vector`` ([d] or [n, d], e.g. a head's deviation z − ẑ
    through its output projection: :func:`context_deviation` with ``reads="resid"``) under the raw logit lens
    (``lens="raw"``: the final norm and the unembedding) or the J-lens of App. P (``lens="jlens"``: W_U J_ℓ, the
    average Jacobian of the final residual with respect to ``point`` ("attn": the attention output, "block": the block
    input) of ``layer``; ``jlens`` a J-lens store: its path or ``mfpipe.open_results("jlens", model, revision)``;
    or, without a store, a :class:`mfpipe.jlens.jvp.JLensSample` of the statistics half's windows, e.g.
    ``JLensSample.from_shards("results/corpus/<corpus>/<model>/shards")``: the same decode through Jacobian-vector
    products on the store's positions, one forward pass per vector and position instead of the store's d backward
    passes per position).

    ``layer`` (0..n_layers): where the vector was written. The J-lens needs it; the raw lens reads the vector as the
    final residual whatever the layer (App. P: it ignores the mediation from ℓ to the output), so there it is
    optional, checked against the model and recorded. A vector of :func:`context_deviation` carries the weights
    fingerprint of the model it was read from, and another model is refused. Returns (vector, rank): ``token_id``,
    ``token``, ``logit``, ``prob``, with provenance (the model, its weights, the lens, the layer, the J-lens store's
    model and revision, the vector's origin)."""
    import torch

    hf, tok = resolve_model(model, tokenizer)
    k = positive_int("k", k)
    if lens not in ("raw", "jlens"):
        raise NotebookError(f"lens={lens!r}: give 'raw' or 'jlens'")
    if lens == "jlens" and point not in ("attn", "block"):
        raise NotebookError(f"point={point!r}: give 'attn' (the attention output) or 'block' (the block input)")
    v, origin = _decode_vectors(vector)
    ident = identity_attrs(hf, tok)
    if origin.get("weights_fingerprint"):
        check_identity(hf, None, origin, "the vector", weights=ident["weights_fingerprint"])
    J = _jlens_store(jlens) if lens == "jlens" else None
    if isinstance(J, xr.Dataset):  # of this model's weights and commit, as the statistics are (same shape is not enough)
        check_identity(hf, None, J.attrs, "the J-lens store", weights=ident["weights_fingerprint"])
    with prepared(hf) as adapter, torch.no_grad():
        if v.shape[1] != adapter.d_model:
            hint = (" (context_deviation's reads='head' are head space: use reads='resid')"
                    if v.shape[1] < adapter.d_model else "")
            raise NotebookError(f"vector has shape {tuple(v.shape)}: give [d] or [n, d] with d = "
                                f"{adapter.d_model}{hint}")
        if layer is not None and (isinstance(layer, bool) or not isinstance(layer, (int, np.integer))
                                  or not 0 <= layer <= adapter.n_layers):
            raise NotebookError(f"layer={layer!r} is outside 0..{adapter.n_layers} of the model")
        if lens == "raw":
            logits = adapter.unembed(v.to(adapter.device, adapter.dtype))
        else:
            if layer is None:
                raise NotebookError(f"lens='jlens' needs layer= (0..{adapter.n_layers}): J_ℓ depends on where the "
                                    "vector was written")
            if isinstance(J, xr.Dataset) and J.sizes.get("layer", 0) - 1 != adapter.n_layers:
                raise NotebookError(f"the J-lens store has layers 0..{J.sizes.get('layer', 0) - 1}, the model "
                                    f"0..{adapter.n_layers}: it belongs to another model; pass this model's")
            try:
                logits = _jlens_logits(adapter, J, int(layer), point, v)
            except NotebookError:
                raise
            except ValueError as e:  # jlens_matrix / jlens_decode: a point not estimated, another d_model
                raise NotebookError(f"J-lens decode: {e}") from None
        logit, idx = logits.float().topk(min(k, logits.shape[-1]), dim=-1)
        prob = torch.softmax(logits.float(), dim=-1).gather(-1, idx)
    ids = idx.cpu().numpy()
    dims = ("vector", "rank")
    return xr.Dataset({"token_id": (dims, ids), "token": (dims, token_strings(tok, ids)),
                       "logit": (dims, logit.cpu().numpy()), "prob": (dims, prob.cpu().numpy())},
                      attrs=_decode_attrs(hf, ident, lens, layer, point, k, len(v), J, origin))


def _decode_vectors(vector):
    """(``[n, d]`` float32 tensor, the provenance the vector carries) of what :func:`decode` is given."""
    import torch

    origin = dict(getattr(vector, "attrs", {}) or {})
    raw = vector.values if isinstance(vector, xr.DataArray) else vector
    if hasattr(raw, "detach"):
        raw = raw.detach().float().cpu().numpy()
    try:
        arr = np.asarray(raw, dtype=np.float32)
    except (TypeError, ValueError):
        raise NotebookError(f"vector is a {type(vector).__name__} that is no array of numbers: give [d] or [n, d] "
                            "floats") from None
    arr = arr[None] if arr.ndim == 1 else arr
    if arr.ndim != 2 or arr.size == 0:
        raise NotebookError(f"vector has shape {np.shape(raw)}: give [d] or [n, d] (one row per vector)")
    if not np.isfinite(arr).all():
        raise NotebookError("vector holds NaN or inf: context_deviation's z and zhat are NaN where a position is no "
                            "valid query; pick a valid one (its 'valid')")
    return torch.as_tensor(arr), origin


def _jlens_store(jlens):
    """The J-lens store ``jlens`` (a path, opened; a Dataset as given), or one NotebookError line."""
    from pathlib import Path

    from mfpipe.jlens.jvp import JLensSample

    if jlens is None:
        raise NotebookError("lens='jlens' needs jlens=: a J-lens store (its path, or mfpipe.open_results('jlens', "
                            "model, revision)); `snakemake results/jlens/<model>/<revision>/jlens.zarr` builds one "
                            "(or mfpipe.jlens.jvp.JLensSample.from_shards(<the corpus stage's shards>) decodes "
                            "without one)")
    if isinstance(jlens, JLensSample):
        return jlens
    if isinstance(jlens, (str, Path)):
        from mfpipe.jlens.lens import open_jlens

        try:
            return open_jlens(jlens)
        except (OSError, ValueError) as e:
            raise NotebookError(str(e)) from None
    if not isinstance(jlens, xr.Dataset) or "J" not in jlens:
        raise NotebookError(f"jlens= is a {type(jlens).__name__} without J: give a J-lens store's path, "
                            "mfpipe.open_results('jlens', model, revision) or a mfpipe.jlens.jvp.JLensSample")
    return jlens


def _decode_attrs(hf, ident, lens, layer, point, k, n, J, origin) -> dict:
    """The provenance of a decode: the model (name, revision, weights), the lens and where it reads, the J-lens
    store's model and revision, and the vector's origin (what computed it, on which windows)."""
    from mfpipe.version import __version__

    cfg = hf.config
    attrs = {"source": "in-memory (mfpipe.decode)", "model": getattr(cfg, "_name_or_path", "") or type(hf).__name__,
             "revision": getattr(cfg, "_commit_hash", None) or "in-memory", **ident, "lens": lens,
             "point": point if lens == "jlens" else "none", "k": k, "n_vectors": int(n), "mfpipe_version": __version__}
    if layer is not None:
        attrs["layer"] = int(layer)
    if isinstance(J, xr.Dataset):
        attrs.update({f"jlens_{key}": J.attrs[key] for key in ("model", "revision", "revision_commit",
                                                                 "corpus_fingerprint")
                      if J.attrs.get(key) is not None})
    elif J is not None:  # a JLensSample: Jacobian-vector products on its positions
        attrs.update({"jlens_decode": "jvp", "jlens_n_positions": int(J.n_positions), "jlens_seed": int(J.seed),
                      **{f"jlens_{key}": v for key, v in J.attrs.items() if v is not None}})
    attrs.update({f"vector_{key}": origin[key] for key in ("source", "tokens_fingerprint", "reads")
                  if origin.get(key) is not None})
    return attrs


def _jlens_logits(adapter, jlens, layer: int, point: str, v):
    from pathlib import Path

    from mfpipe.jlens.jvp import lens_logits
    from mfpipe.jlens.lens import open_jlens

    if jlens is None:
        raise NotebookError("lens='jlens' needs jlens=: a J-lens store (its path, or mfpipe.open_results('jlens', "
                            "model, revision)); `snakemake results/jlens/<model>/<revision>/jlens.zarr` builds one")
    J = open_jlens(jlens) if isinstance(jlens, (str, Path)) else jlens
    if not 0 <= layer <= adapter.n_layers:
        raise NotebookError(f"layer {layer} is outside 0..{adapter.n_layers} of the model")
    return lens_logits(adapter, J, layer, point, v)
