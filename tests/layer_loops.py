"""The per-position loop reference of the statistics on a model whose layers are not all attention (a hybrid's other
mixers, a layer-pattern model's MLP-only blocks): shared by tests/test_hybrid.py, tests/test_forms.py and
tests/test_gated_hybrid.py, each of which captures its model's per-layer tensors with hooks of its own."""

from __future__ import annotations

import numpy as np


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
