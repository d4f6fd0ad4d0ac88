"""The per-position loop reference of the statistics on a model whose layers are not all attention (a hybrid's other
mixers, a layer-pattern model's MLP-only blocks): shared by tests/test_hybrid.py, tests/test_forms.py and
tests/test_gated_hybrid.py, each of which captures its model's per-layer tensors with hooks of its own."""

from __future__ import annotations

import numpy as np
from stats_reference import finite_scale


def loop_means(per, hidden, tokens, tracked, L: int, H: int, dh: int, d: int) -> dict:
    """Per-position loops over a forward's captures: ``per[l]`` a dict of ``probs [B,H,T,T]``, ``values`` / ``reads``
    ``[B,T,H,dh]``, ``attn_out`` / ``mlp_out`` ``[B,T,d]`` (None at a layer without attention), ``hidden[l]`` the
    residual entering layer l ``[B,T,d]``. Returns P [L,H,N,K], centroids [L,K,d], mu / zbar [L,H,K,dh] and attn_out /
    mlp_out [L,K,d] means by key bucket; NaN at the layers without attention."""
    N, K = tracked.n, tracked.n + 2
    rank = {int(t): i for i, t in enumerate(tracked.type_ids)}
    B, T = tokens.shape
    P = np.full((L, H, N, K), np.nan)
    sums = {k: np.full((L, K) + s, np.nan) for k, s in (("mu", (H, dh)), ("zbar", (H, dh)), ("attn_out", (d,)),
                                                        ("mlp_out", (d,)))}
    centroid, kn, qn = np.zeros((L, K, d)), np.zeros(K), np.zeros(N)
    for l in range(L):
        if per[l] is not None:
            P[l] = 0.0
            for k in sums:
                sums[k][l] = 0.0
    for w in range(B):
        buckets = [N if j == 0 else rank.get(int(tokens[w, j]), N + 1) for j in range(T)]
        for j in range(T):
            t = buckets[j]
            kn[t] += 1
            if 0 < j and t < N:
                qn[t] += 1
            for l in range(L):
                centroid[l, t] += hidden[l][w, j].numpy()
                if per[l] is None:
                    continue
                p = per[l]
                for k, src in (("mu", "values"), ("zbar", "reads"), ("attn_out", "attn_out"), ("mlp_out", "mlp_out")):
                    sums[k][l, t] += p[src][w, j].numpy()
                if 0 < j and t < N:
                    for k in range(j + 1):
                        P[l, :, t, buckets[k]] += p["probs"][w, :, j, k].numpy()
    with np.errstate(invalid="ignore", divide="ignore"):
        out = {k: v / kn[None, :, *([None] * (v.ndim - 2))] for k, v in sums.items()}
        out["P"] = P / qn[None, None, :, None]
        out["centroid"] = centroid / kn[None, :, None]
    out["mu"], out["zbar"] = out["mu"].transpose(0, 2, 1, 3), out["zbar"].transpose(0, 2, 1, 3)  # [L,H,K,dh]
    return out


# the store's variables against the loop reference's keys
STORE_VS_LOOPS = (("P", "P"), ("mu", "mu"), ("zbar", "zbar"), ("attn_out_mean", "attn_out"),
                  ("mlp_out_mean", "mlp_out"), ("centroid", "centroid"))


def assert_store_equals_loops(ds, ref: dict, n_layers: int) -> None:
    """A finalized store's means (``ds``, float64) equal :func:`loop_means`' ``ref``: NaN exactly where the loops
    have NaN (the layers without attention), the rest to 1e-5."""
    for name, key in STORE_VS_LOOPS:
        want = ref[key]
        got = np.asarray(ds[name].values, dtype=np.float64)[:n_layers]
        assert np.array_equal(np.isnan(got), np.isnan(want)), name
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * finite_scale(want), equal_nan=True, err_msg=name)


def mean_field_patch(model, ad, tokens, tracked, name: str, path):
    """The kernel of ``tokens``' own statistics (written to ``path / "s.zarr"``) and the patch that writes its
    ẑ over every substituted read: ``(zhat, sub, replace)`` with ``replace(layer, reads)`` for ``patch_reads``."""
    import torch

    from mfpipe.meanfield.kernel import kernel_from_store
    from mfpipe.stats import accumulate_shard, finalize, open_stats, write_store

    sums = accumulate_shard(model, ad, tokens, tracked, batch_size=4, device="cpu", progress=False)
    meta = {"model": f"tiny-{name}", "revision": "r", "half": "stats", "corpus_fingerprint": "-",
            "layer_kinds": list(ad.layer_kinds)}
    kernel = kernel_from_store(open_stats(write_store(finalize(sums, tracked, meta), path / "s.zarr")),
                               tracked, min_count=1)
    zhat, sub = kernel.zhat(*kernel.buckets(tokens))

    def replace(layer, reads):
        return torch.where(sub[..., None, None], zhat[layer].to(reads.dtype), reads)

    return zhat, sub, replace
