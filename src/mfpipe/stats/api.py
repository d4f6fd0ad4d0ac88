"""Read side of the statistics store: :func:`open_stats` (lazy, provenance-checked) and accessors.

Example::

    from mfpipe.stats import open_stats
    st = open_stats("results/stats/gpt2-small/main/stats.zarr",
                    expect={"model": "gpt2-small", "revision": "main", "tracked_fingerprint": ts.fingerprint})
    P1 = st.P(layer=1)                      # (head, query, key), loaded
    W = st.W(min_count=20)                  # P / nbar, 0 where C_st < 20
    c = st.centroids()                      # (depth, query, dim)
    mu_resid = st.mu(layer=3, out_proj_slices=adapter.out_proj_slices)   # (head, key, dim)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
import xarray as xr

from mfpipe.stats.store import DEFAULT_MIN_COUNT, PROVENANCE_KEYS, open_zarr

# accepted spellings of provenance keys in `expect`
ALIASES = {
    "N": "n_tracked",
    "n": "n_tracked",
    "n_types": "n_tracked",
    "tracked_hash": "tracked_fingerprint",
    "tracked": "tracked_fingerprint",
    "corpus_hash": "corpus_fingerprint",
    "T": "context_length",
    "seq_len": "context_length",
}


class ProvenanceError(ValueError):
    """A statistics store was computed for something else than what the caller expects."""


def same_value(a: Any, b: Any) -> bool:
    if isinstance(a, (int, np.integer)) and isinstance(b, (int, np.integer)):
        return int(a) == int(b)
    if isinstance(a, (float, np.floating)) or isinstance(b, (float, np.floating)):
        try:
            return float(a) == float(b)
        except (TypeError, ValueError):
            return False
    return str(a) == str(b) if (a is not None and b is not None) else a is b


def check_provenance(attrs: Mapping[str, Any], expect: Mapping[str, Any] | None, path: str | Path = "") -> None:
    """Raise :class:`ProvenanceError` naming the first key whose stored value differs from ``expect``."""
    for key, want in dict(expect or {}).items():
        name = ALIASES.get(key, key)
        if name not in attrs:
            raise ProvenanceError(
                f"statistics store {path} records no {name!r} (expected {want!r}); it was written by an older or "
                f"different mfpipe — delete it and rerun the stats stage (snakemake recreates it)"
            )
        have = attrs[name]
        if not same_value(have, want):
            raise ProvenanceError(
                f"statistics store {path} does not match: {name} is {have!r}, expected {want!r}. It was computed for "
                f"another {name.replace('_', ' ')}; point to the store for {want!r} or delete {path} and rerun the "
                f"stats stage so it is recomputed from the current inputs"
            )


def _as_numpy(w) -> np.ndarray:
    if hasattr(w, "detach"):
        w = w.detach().float().cpu().numpy()
    return np.asarray(w, dtype=np.float64)


class MeanFieldStats:
    """A lazily opened statistics store. ``ds`` is the raw :class:`xarray.Dataset` (backed by zarr; values
    are read on access). Accessors return :class:`xarray.DataArray`; passing ``layer`` / ``depth`` selects
    one layer (one chunk) and loads it."""

    def __init__(self, ds: xr.Dataset, path: str | Path | None = None):
        self.ds = ds
        self.path = None if path is None else Path(path)
        a = ds.attrs
        self.attrs = dict(a)
        self.n = int(a.get("n_tracked", ds.sizes["query"]))
        self.n_layers = int(ds.sizes["layer"])
        self.n_heads = int(ds.sizes["head"])
        self.d_model = int(ds.sizes["dim"])
        self.d_head = int(ds.sizes["head_dim"])
        self.bos_bucket = self.n
        self.other_bucket = self.n + 1
        # each layer's kind: "attention", or a hybrid's other mixer, whose P, mu, zbar and branch means are NaN (a
        # store without the coordinate predates hybrids: attention throughout)
        kinds = ds.coords.get("layer_kind")
        self.layer_kinds = (tuple(str(k) for k in kinds.values) if kinds is not None
                            else ("attention",) * self.n_layers)
        self.attention_layers = tuple(l for l, k in enumerate(self.layer_kinds) if k == "attention")

    def __repr__(self) -> str:
        a = self.attrs
        return (
            f"MeanFieldStats({a.get('model')!r}@{a.get('revision')!r} {a.get('half')!r}: N={self.n}, "
            f"L={self.n_layers}, H={self.n_heads}, T={a.get('context_length')}, tokens={a.get('n_tokens')})"
        )

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _sel(da: xr.DataArray, dim: str, idx) -> xr.DataArray:
        return da if idx is None else da.isel({dim: idx}).load()

    @property
    def query_labels(self) -> list[str]:
        return [str(s) for s in self.ds["query_str"].values]

    @property
    def key_labels(self) -> list[str]:
        return [str(s) for s in self.ds["key_str"].values]

    # ------------------------------------------------------------------ counts, model-free
    def query_count(self) -> xr.DataArray:
        return self.ds["query_count"].load()

    def key_count(self) -> xr.DataArray:
        return self.ds["key_count"].load()

    def nbar(self) -> xr.DataArray:
        """(query, key): mean number of bucket-t positions in a type-s causal prefix (incl. the query)."""
        return self.ds["nbar"].load()

    def context_count(self) -> xr.DataArray:
        """(query, key): C_st, type-s contexts with at least one bucket-t position in the prefix."""
        return self.ds["context_count"].load()

    def cooc(self) -> xr.DataArray:
        """(query, key): counts of bucket t within ±cooc_window of a type-s query (Sec. 4.2 `cooc`)."""
        return self.ds["cooc"].load()

    def position_coverage(self) -> float:
        """Share of positions >= 1 whose type is tracked (App. F)."""
        kc = self.key_count().values
        return float(kc[: self.n].sum() / max(1, kc[: self.n].sum() + kc[self.other_bucket]))

    # ------------------------------------------------------------------ kernels
    def P(self, layer: int | None = None) -> xr.DataArray:
        """(layer, head, query, key) corpus attention mean field; rows sum to 1 over ``key`` (within 2^-(k+1) for a
        store merged from partials rounded to k mantissa bits: attribute ``partial_mantissa_bits``)."""
        return self._sel(self.ds["P"], "layer", layer)

    def W(self, min_count: int | None = None, layer: int | None = None, P: xr.DataArray | None = None) -> xr.DataArray:
        """Per-key kernel ``W = P / nbar`` (App. A), 0 where ``C_st < min_count`` (App. E; default: the
        store's ``min_count``, 20) or where bucket t never occurs; NaN rows for types with no query. ``P``: this
        store's ``P(layer)`` where the caller holds it already (not read again)."""
        mc = int(self.attrs.get("min_count", DEFAULT_MIN_COUNT) if min_count is None else min_count)
        P = self.P(layer) if P is None else P
        nbar = self.nbar()
        keep = self.context_count() >= max(mc, 1)
        with np.errstate(divide="ignore", invalid="ignore"):
            W = xr.where(keep, P / nbar.where(keep), 0.0)
        has_q = self.query_count() > 0
        W = W.where(has_q).transpose(*P.dims)
        W.attrs["min_count"] = mc
        return W

    # ------------------------------------------------------------------ residual stream
    def centroids(self, depth: int | None = None, buckets: bool = False) -> xr.DataArray:
        """Type centroids c[depth, s] (residual entering block ``depth``; depth L = final residual before
        the last norm) as (depth, query, dim); ``buckets=True`` keeps all K buckets along ``key``."""
        c = self._sel(self.ds["centroid"], "depth", depth)
        return c if buckets else self._tracked_rows(c)

    def bos(self, depth: int | None = None) -> xr.DataArray:
        """BOS representation b[depth] at position 0, (depth, dim)."""
        return self._sel(self.ds["centroid"], "depth", depth).isel(key=self.bos_bucket, drop=True)

    def other_centroid(self, depth: int | None = None) -> xr.DataArray:
        """Measured mean residual of untracked positions (the rollout uses its own running mean instead)."""
        return self._sel(self.ds["centroid"], "depth", depth).isel(key=self.other_bucket, drop=True)

    def resid_var(self, depth: int | None = None, buckets: bool = False) -> xr.DataArray:
        """Within-type per-dimension variance of the residual (App. D), (depth, query, dim)."""
        v = self._sel(self.ds["resid_var"], "depth", depth)
        return v if buckets else self._tracked_rows(v)

    def mlp_gap(self, layer: int | None = None) -> xr.Dataset:
        """App. K: per query type, the mean post-attention residual ``m`` and the occurrence-mean MLP branch
        output ``mlp_out`` (compare with ``adapter.mlp(layer, m)``), plus ``attn_out``."""
        ds = xr.Dataset(
            {
                "m": self._sel(self.ds["resid_mid_mean"], "layer", layer),
                "mlp_out": self._sel(self.ds["mlp_out_mean"], "layer", layer),
                "attn_out": self._sel(self.ds["attn_out_mean"], "layer", layer),
            }
        )
        return self._tracked_rows(ds)

    def ln_in(self, layer: int | None = None, buckets: bool = False) -> xr.DataArray:
        """App. D: occurrence mean of the attention-input norm, E[ln1(x)] per type, (layer, query, dim).
        The value-map Jensen gap is its distance to ``adapter.attn_input_norm(layer, c)`` at the centroid."""
        v = self._sel(self.ds["ln_in_mean"], "layer", layer)
        return v if buckets else self._tracked_rows(v)

    # ------------------------------------------------------------------ head space
    def mu(self, layer: int | None = None, out_proj_slices: Callable[[int], Any] | Any = None) -> xr.DataArray:
        """Mean value vector mu_t of each head per key bucket (incl. ``<bos>``, ``<other>``):
        (layer, head, key, head_dim); with ``out_proj_slices`` (``layer -> [H, dh, d]``, e.g.
        ``adapter.out_proj_slices`` or the adapter itself) mapped to the residual stream through W_O^h:
        (layer, head, key, dim), output-projection bias not included. Refused on a model whose attention gates its
        reads (:mod:`mfpipe.models.adapters.gate`): a value's write depends on the gate of the query that reads it,
        which a key type does not have; map :meth:`zhat` / :meth:`zbar` instead."""
        return self._map(self._sel(self.ds["mu"], "layer", layer), layer, out_proj_slices, per_query=False)

    def zbar(self, layer: int | None = None, out_proj_slices: Callable[[int], Any] | Any = None) -> xr.DataArray:
        """Measured mean read of each head over type-s queries (eq:exact-contribution, teacher-forced):
        (layer, head, query, head_dim), or mapped through W_O^h: (layer, head, query, dim); on a gated attention times
        the gate of the query type's centroid first (:meth:`_map`)."""
        z = self._tracked_rows(self._sel(self.ds["zbar"], "layer", layer))
        return self._map(z, layer, out_proj_slices)

    def zhat(self, layer: int | None = None, out_proj_slices: Callable[[int], Any] | Any = None) -> xr.DataArray:
        """Mean-field contribution with measured values, ``sum_t P_st mu_t`` (Sec. 3.2), same dims as
        :meth:`zbar`; compare with it for the teacher-forced attention check."""
        P = self.P(layer)
        mu = self._sel(self.ds["mu"], "layer", layer)
        z = xr.dot(P, mu, dim="key")
        return self._map(z, layer, out_proj_slices)

    def _map(self, x: xr.DataArray, layer: int | None, out_proj_slices, per_query: bool = True) -> xr.DataArray:
        """``x`` through each head's slice of the output projection. Where the attention gates its reads (the adapter,
        given itself or by its bound ``out_proj_slices``, has an output gate), a read enters the projection times the
        gate of its query's residual, which the statistics do not hold per occurrence: a query type's read is gated
        with the gate of the type's centroid (the residual entering the block), as the rollout gates a centroid's
        mean-field read (:mod:`mfpipe.models.adapters.gate`); so ``zhat`` mapped is the rollout's write of type s, and
        ``zbar`` goes through the same gate to stay comparable with it (E_s[z * g] itself is no statistic). Where the
        attention norms every head's reads together (BitNet's, :mod:`mfpipe.models.adapters.normed`), the reads mapped
        enter times the factor the norm gives those reads, every head's of the query type together, as the rollout's
        mean-field reads do."""
        if out_proj_slices is None:
            return x
        fn = getattr(out_proj_slices, "out_proj_slices", out_proj_slices)
        ad = out_proj_slices if fn is not out_proj_slices else getattr(out_proj_slices, "__self__", None)
        s = getattr(ad, "structure", None)  # an output gate, a norm of the reads (mfpipe.models.adapters.gate)
        gated = getattr(s, "output_gate", None) is not None or getattr(s, "reads_norm", None) is not None
        if gated and not per_query:
            raise ValueError("this model's attention gates each head's read by its query position (an output gate of "
                             "its residual, or a norm of every head's reads there), so a key type's value has no "
                             "write of its own: map zhat or zbar (gated as a query type's), or take mu in head space")
        layers = [layer] if layer is not None else list(range(self.n_layers))
        outs = []
        for l in layers:  # a hybrid's layers of another mixer have no output projection: NaN
            w = (_as_numpy(fn(int(l))) if self.layer_kinds[int(l)] == "attention"
                 else np.full((self.n_heads, self.d_head, self.d_model), np.nan))  # [H, dh, d]
            if w.shape != (self.n_heads, self.d_head, self.d_model):
                raise ValueError(
                    f"out_proj_slices({l}) has shape {w.shape}, expected {(self.n_heads, self.d_head, self.d_model)}"
                )
            xl = x if layer is not None else x.isel(layer=l)
            if gated and self.layer_kinds[int(l)] == "attention":
                xl = xl.astype(np.float64) * self._centroid_gate(ad, int(l), xl)
            wda = xr.DataArray(w, dims=("head", "head_dim", "dim"), coords={"dim": np.arange(self.d_model)})
            outs.append(xr.dot(xl.astype(np.float64), wda, dim="head_dim").astype(x.dtype))
        if layer is not None:
            return outs[0]
        return xr.concat(outs, dim="layer").assign_coords(layer=x["layer"])

    def _centroid_gate(self, adapter, layer: int, reads: xr.DataArray) -> xr.DataArray:
        """The output gate (query, head, head_dim) of each tracked type's centroid entering block ``layer``; where the
        attention norms its reads together, the factor of ``reads`` (``[..., head, head_dim]``) themselves."""
        import torch

        if adapter.structure.reads_norm is not None:
            r = reads.transpose(..., "head", "head_dim")
            z = torch.from_numpy(np.asarray(r.values, np.float32))
            return xr.DataArray(adapter.read_gate(layer, None, z).double().cpu().numpy(), dims=r.dims)

        c = torch.from_numpy(np.asarray(self.centroids(depth=layer).transpose("query", "dim").values, np.float32))
        g = adapter.read_gate(layer, c).double().cpu().numpy()
        return xr.DataArray(g, dims=("query", "head", "head_dim"))

    def _tracked_rows(self, x):
        sub = x.isel(key=slice(0, self.n))
        sub = sub.rename({"key": "query", "key_str": "query_str", "key_token_id": "query_token_id"})
        return sub


def open_stats(path: str | Path, expect: Mapping[str, Any] | None = None) -> MeanFieldStats:
    """Open a statistics store lazily and check its provenance.

    ``expect``: attribute values the caller requires (any of ``model``, ``revision``, ``half``,
    ``corpus_fingerprint``, ``tracked_fingerprint``, ``n_tracked``, ``context_length`` or any other stored
    attribute; aliases ``N``, ``tracked_hash``, ``T`` accepted). A mismatch raises :class:`ProvenanceError`
    naming the key, the expected and the found value, and what to do.
    """
    path = Path(path)
    ds = open_zarr(path, "statistics store", "run the stats stage")
    check_provenance(ds.attrs, expect, path)
    return MeanFieldStats(ds, path)


__all__ = ["open_stats", "MeanFieldStats", "ProvenanceError", "check_provenance", "PROVENANCE_KEYS"]
