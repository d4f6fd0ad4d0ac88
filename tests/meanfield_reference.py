"""The slow reference of the context-conditional mean field (tests/test_substitution.py, tests/test_prompts_icl.py):
ẑ and the substituted positions of a :class:`mfpipe.meanfield.kernel.MeanFieldKernel` on token windows, with Python
loops over windows, positions, heads and keys (eq:w-def-appendix, eq:ccmf), float64."""

from __future__ import annotations

import numpy as np


def slow_zhat(kernel, tokens):
    """ẑ per layer [L,B,T,H,dh] and substituted [B,T] with loops over windows, positions, heads and keys
    (eq:w-def-appendix, eq:ccmf), float64."""
    W = kernel.W.double().numpy()
    mu = kernel.mu.double().numpy()
    L, H, N, K = W.shape
    dh = mu.shape[-1]
    B, T = tokens.shape
    out = np.zeros((L, B, T, H, dh))
    sub = np.zeros((B, T), dtype=bool)
    for b in range(B):
        for j in range(1, T):
            s = kernel.query_lut[tokens[b, j]]
            if s < 0:
                continue
            buckets = [kernel.n] + [int(kernel.key_lut[tokens[b, k]]) for k in range(1, j + 1)]
            counts = {t: buckets.count(t) for t in set(buckets)}
            ok = True
            for l in range(L):
                for h in range(H):
                    norm = sum(n * W[l, h, s, t] for t, n in counts.items())
                    if not np.isfinite(norm) or norm <= 0:
                        ok = False
                        continue
                    for t, n in counts.items():
                        out[l, b, j, h] += n * W[l, h, s, t] / norm * mu[l, h, t]
            sub[b, j] = ok
    out[:, ~sub] = 0.0
    return out, sub
