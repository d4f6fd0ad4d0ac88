"""Mean-field deviation of every head on every context (paper Sec. 6: eq:deviation, eq:dev-decomp, eq:mcov-mctx,
eq:head-meters, eq:ddec; App. B eq:dev-split-app) — the tensor math, one definition for pass 2, the prompt
classes and the lenses.

For a head on a context X with query type s (a tracked position j, prefix 0..j; :mod:`mfpipe.meanfield.ccmf`):

* ``z``     = Σ_i A_i v_i, the head's read (what attention computed);
* ``ẑ``     = Σ_t Â_stX μ_t, the context-conditional mean field (eq:ccmf);
* ``mixed`` = Σ_t Â_stX v̄_tX, predicted attention on the actual in-context values, where v̄_tX = Σ_{i∈t} A_i v_i
  / A_stX is the attention-weighted mean value of the prefix's type-t keys (A_stX = Σ_{i∈t} A_i);

so the covariance term (a) = z − mixed and the contextualization term (b) = mixed − ẑ sum to z − ẑ exactly
(eq:dev-decomp). Per key position i of type t the mixed weight is Â_stX A_i / A_stX (where A_stX underflows to 0
the prediction's own per-position weight is used: v̄_tX is then undefined and the term reads Â's values).

Geometry: "the value function includes the head's output projection, so all quantities are in residual-stream
units" (App. P): vectors stay in head space (``dh``) and every inner product is taken through the head's slice of
the output projection, ⟨x, y⟩ = x O_h O_hᵀ yᵀ with ``O_h = out_proj_slices(l)[h]`` ``[dh, d]`` (:func:`residual_gram`),
which equals the dot product of the head's residual-stream contributions x O_h and y O_h (no bias: it is shared by
the heads; where the attention gates its reads, of (x * g) O_h and (y * g) O_h with g the query's own gate:
:func:`gate_head_major`). Then D = 1 − cos(z, ẑ) (eq:deviation) and, with e = z − ẑ and e⊥ its component orthogonal
to ẑ, σ_cov = a·e⊥/|e⊥|², σ_ctx = b·e⊥/|e⊥|² (σ_cov + σ_ctx = 1), M_cov = σ_cov D, M_ctx = σ_ctx D (eq:mcov-mctx,
summing to D). When e⊥ vanishes (z collinear with ẑ: D is 0 or 2) the shares are undefined (the paper's footnote);
we split D evenly and count the case (``degenerate``).

The per-type corpus deviation (eq:ddec) compares the head's mean read per query type, z̄_s = E_s[z], with the mean
prediction E_s[ẑ] by a cosine centred over the query types with at least ``min_occurrences`` occurrences
(:func:`corpus_deviation`).

Two forms of the per-context terms, tied by tests: :func:`occurrence_terms` spells the definition out over every
(query, key) position pair; :func:`mfpipe.deviation.queries.query_terms` (what pass 2 runs) computes the same at the
query positions only, with Â and the attention per key type held in type space.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

__all__ = ["key_type_ranks", "same_type_sums", "OccurrenceTerms", "occurrence_terms", "residual_gram", "layer_grams",
           "gram_dot", "deviation_cosine", "meters", "stack_head_major", "gate_head_major", "meters_head_major",
           "corpus_deviation", "MIN_OCCURRENCES"]

MIN_OCCURRENCES = 50  # eq:ddec: S̄ averages over the query types with at least this many occurrences
TINY = 1e-30


def key_type_ranks(kb: Tensor) -> Tensor:
    """Per window, each position's bucket as a rank among the window's distinct buckets: ``[B, T]`` in ``0..T-1``
    (positions of one bucket share a rank). Lets per-type sums over a window's keys be a scatter into T slots."""
    s, order = kb.sort(dim=1)
    new = torch.ones_like(s, dtype=torch.long)
    new[:, 1:] = (s[:, 1:] != s[:, :-1]).long()
    ranks_sorted = new.cumsum(1) - 1
    return torch.empty_like(ranks_sorted).scatter_(1, order, ranks_sorted)


def same_type_sums(w: Tensor, ranks: Tensor) -> Tensor:
    """``out[b, h, j, i] = Σ_{i': bucket(i') = bucket(i)} w[b, h, j, i']`` for ``w [B, H, T, T]`` (query, key) and
    ``ranks [B, T]`` from :func:`key_type_ranks`: each key position gets its type's total weight in row j (for a
    causal ``w`` that is the type's weight in the prefix). One scatter and one gather, ``B H T²``."""
    B, H, T, _ = w.shape
    idx = ranks[:, None, None, :].expand(B, H, T, T)
    totals = torch.zeros_like(w).scatter_add_(-1, idx, w)
    return totals.gather(-1, idx)


@dataclass
class OccurrenceTerms:
    """One layer's reads and predictions per query position and head, head space ``[B, T, H, dh]``."""

    z: Tensor  # the read, Σ_i A_i v_i
    zhat: Tensor  # the mean field, Σ_t Â_stX μ_t (eq:ccmf)
    mixed: Tensor  # Σ_t Â_stX v̄_tX: predicted attention on the in-context values
    mixed_tracked: Tensor | None = None  # the same sum over the tracked key types only (when asked for)

    @property
    def covariance(self) -> Tensor:  # term (a) of eq:dev-decomp
        return self.z - self.mixed

    @property
    def contextualization(self) -> Tensor:  # term (b) of eq:dev-decomp
        return self.mixed - self.zhat


def occurrence_terms(probs: Tensor, values: Tensor, a_hat: Tensor, mu: Tensor, kb: Tensor, reads: Tensor | None = None,
                     ranks: Tensor | None = None, n_tracked: int | None = None) -> OccurrenceTerms:
    """z, ẑ and the mixed term for every (query position, head) of one layer.

    ``probs [B, H, T, T]`` attention (query, key), ``values [B, H, T, dh]``, ``a_hat [B, H, T, T]`` Â spread over key
    positions (:func:`mfpipe.meanfield.ccmf.pair_kernel`, transposed to batch-major), ``mu [H, K, dh]`` the bucket mean values,
    ``kb [B, T]`` key buckets. ``reads [B, T, H, dh]``: the model's own reads to use as z (default Σ_i A_i v_i).
    Rows that are not valid queries come out as whatever the inputs give (callers mask them). With ``n_tracked`` N
    also ``mixed_tracked``, the mixed sum over the tracked key buckets (``kb < N``) only."""
    dt = probs.dtype
    ranks = key_type_ranks(kb) if ranks is None else ranks
    a_hat = a_hat.to(dt)
    A_type = same_type_sums(probs, ranks)
    Ahat_type = same_type_sums(a_hat, ranks)
    mixed_w = torch.where(A_type > 0, Ahat_type * probs / A_type.clamp_min(TINY), a_hat)
    mixed = torch.matmul(mixed_w, values.to(dt))  # [B, H, T, dh]
    mixed_tracked = None
    if n_tracked is not None:
        tracked_keys = (kb < int(n_tracked)).to(dt)[:, None, None, :]
        mixed_tracked = torch.matmul(mixed_w * tracked_keys, values.to(dt)).transpose(1, 2)
    zhat = torch.matmul(a_hat, mu.to(dt)[:, kb].transpose(0, 1))  # μ of each key's bucket: [B, H, T, dh]
    z = torch.matmul(probs, values.to(dt)).transpose(1, 2) if reads is None else reads.to(dt)
    return OccurrenceTerms(z, zhat.transpose(1, 2), mixed.transpose(1, 2), mixed_tracked)


def residual_gram(out_proj_slices: Tensor) -> Tensor:
    """``G_h = O_h O_hᵀ`` ``[H, dh, dh]`` from ``[H, dh, d]``: the residual-stream inner product in head space."""
    o = out_proj_slices.to(torch.float64)
    return o @ o.transpose(1, 2)


def layer_grams(adapter) -> Tensor:
    """``[L, H, dh, dh]``: :func:`residual_gram` of every layer's output projection slices (the adapter's; NaN at a
    hybrid's layers of another mixer)."""
    return torch.stack([residual_gram(adapter.out_proj_slices(l).float()) for l in range(adapter.n_layers)])


def gram_dot(x: Tensor, y: Tensor, G: Tensor) -> Tensor:
    """⟨x, y⟩ through each head's gram, ``[..., H, dh] x [..., H, dh] -> [..., H]``."""
    return (torch.einsum("...hd,hde->...he", x, G.to(x.dtype)) * y).sum(-1)


def deviation_cosine(z: Tensor, zhat: Tensor, G: Tensor | None = None) -> Tensor:
    """D = 1 − cos(z, ẑ) per ``[..., H]`` (eq:deviation), in residual-stream units through ``G`` (head space
    when ``G`` is None). float64. A zero vector has cosine 0 (D = 1)."""
    z, zhat = z.to(torch.float64), zhat.to(torch.float64)
    if G is None:
        zz, hh, zh = (z * z).sum(-1), (zhat * zhat).sum(-1), (z * zhat).sum(-1)
    else:  # gram_dot's terms, with z's gram product computed once for ⟨z,z⟩ and ⟨z,ẑ⟩ (the same arithmetic)
        Gz, Gh = (torch.einsum("...hd,hde->...he", x, G.to(torch.float64)) for x in (z, zhat))
        zz, hh, zh = (Gz * z).sum(-1), (Gh * zhat).sum(-1), (Gz * zhat).sum(-1)
    return 1.0 - zh / (zz * hh).clamp_min(TINY).sqrt()


def meters(terms: OccurrenceTerms, G: Tensor, gate: Tensor | None = None) -> dict[str, Tensor]:
    """Per occurrence and head ``[..., H]`` (float64): ``D``, ``sigma_cov``, ``sigma_ctx``, ``M_cov`` = σ_cov D,
    ``M_ctx`` = σ_ctx D and ``degenerate`` (bool: e⊥ = 0, shares split evenly). See the module docstring. ``gate``
    ``[..., H, dh]``: each occurrence's output gate where the attention gates its reads (:func:`gate_head_major`)."""
    shape = terms.z.shape[:-1]  # [..., H]
    m = meters_head_major(gate_head_major(stack_head_major(terms), gate), G)
    return {k: v.transpose(0, 1).reshape(shape) for k, v in m.items()}


def stack_head_major(terms: OccurrenceTerms) -> Tensor:
    """``[3, H, dh, n]`` float64: z, ẑ, mixed of ``[..., H, dh]`` terms (n = the leading axes flattened), head-major
    with the rows last, so that each head's gram product is one ``G @ x`` over its n rows (on CPU about twice as fast
    as ``x @ G`` in float64) and the inner products reduce over ``dh`` with the rows contiguous (the cast to float64
    is this one copy)."""
    H, dh = terms.z.shape[-2:]
    X = torch.empty(3, H, dh, terms.z[..., 0, 0].numel(), dtype=torch.float64, device=terms.z.device)
    for i, x in enumerate((terms.z, terms.zhat, terms.mixed)):
        X[i].copy_(x.reshape(-1, H, dh).permute(1, 2, 0))
    return X


def gate_head_major(X: Tensor, gate: Tensor | None) -> Tensor:
    """:func:`stack_head_major`'s ``X [3, H, dh, n]`` with each row's z, ẑ and mixed times its query's output gate
    ``gate [n, H, dh]`` (in place; ``X`` as it is where None). Where the attention gates its reads
    (:mod:`mfpipe.models.adapters.gate`) a head writes ``(z * g) O_h`` at a query of gate g, and the mean field read
    there goes through the same gate (the rollout's), so the meters' residual-stream inner products are the gated
    reads': G_h becomes diag(g) O_h O_hᵀ diag(g) per query. A gate of one value per head (LFM-3, Ling) cancels in
    every meter; one per read entry (Qwen3-Next, Qwen3.5) does not."""
    if gate is None:
        return X
    H, dh = X.shape[1:3]
    return X.mul_(gate.reshape(-1, H, dh).permute(1, 2, 0).to(X.device, X.dtype)[None])


def meters_head_major(X: Tensor, G: Tensor) -> dict[str, Tensor]:
    """:func:`meters` of :func:`stack_head_major`'s ``X [3, H, dh, n]``: each ``[H, n]``.

    Two gram products, G z and G ẑ, give the five inner products ⟨z,z⟩, ⟨z,ẑ⟩, ⟨ẑ,ẑ⟩, ⟨m,z⟩, ⟨m,ẑ⟩ (m the mixed
    term), and every quantity of the split is a combination of those: with e = z − ẑ, c = ⟨e,ẑ⟩/⟨ẑ,ẑ⟩ and
    e⊥ = z − (1 + c) ẑ, |e⊥|² = |e|² − c⟨e,ẑ⟩, ⟨a, e⊥⟩ for a = z − m and ⟨b, e⊥⟩ for b = m − ẑ expand bilinearly.
    In float64 from float32 inputs the expansions lose ~1e-16 of |z|² + |ẑ|² (a relative 1e-16 / D on D, far below
    the inputs' own precision); e⊥ counts as zero (degenerate: the shares split evenly) below 1e-13 of that."""
    G = G.to(X.dtype)
    Gz, Gh = torch.bmm(G, X[0]), torch.bmm(G, X[1])  # [H, dh, n]
    zz, zh, zm = (X * Gz).sum(2)  # [H, n] each
    hh, hm = (X[1:] * Gh).sum(2)
    eh = zh - hh
    coef = torch.where(hh > TINY, eh / hh.clamp_min(TINY), torch.zeros_like(hh))
    pp = (zz - 2.0 * zh + hh) - coef * eh  # |e⊥|²
    c1 = 1.0 + coef
    a_perp = zz - c1 * zh - zm + c1 * hm  # ⟨z − m, z − (1 + c) ẑ⟩
    b_perp = zm - c1 * hm - zh + c1 * hh  # ⟨m − ẑ, z − (1 + c) ẑ⟩
    degenerate = pp <= 1e-13 * (zz + hh)
    safe = torch.where(degenerate, torch.ones_like(pp), pp)
    s_cov = torch.where(degenerate, torch.full_like(pp, 0.5), a_perp / safe)
    s_ctx = torch.where(degenerate, torch.full_like(pp, 0.5), b_perp / safe)
    D = 1.0 - zh / (zz * hh).clamp_min(TINY).sqrt()  # deviation_cosine from the same products
    return {"D": D, "sigma_cov": s_cov, "sigma_ctx": s_ctx, "M_cov": s_cov * D, "M_ctx": s_ctx * D,
            "degenerate": degenerate}


def corpus_deviation(zbar: np.ndarray, zhat_bar: np.ndarray, counts: np.ndarray, gram: np.ndarray,
                     min_occurrences: int = MIN_OCCURRENCES) -> tuple[np.ndarray, np.ndarray]:
    """eq:ddec per head: ``(S [L, H, N], S_bar [L, H])``.

    ``zbar``/``zhat_bar [L, H, N, dh]`` the mean read and mean prediction per query type (head space), ``counts
    [N]`` or ``[L, H, N]`` the occurrences behind each mean, ``gram [L, H, dh, dh]`` (:func:`residual_gram`). Over
    the types with ``counts >= min_occurrences`` both are centred (the type-mean removed) and compared by cosine in
    residual-stream units; ``S_s = 1 − cos_c``, NaN for the other types; ``S̄`` their mean (NaN with < 2 types)."""
    zbar = np.asarray(zbar, dtype=np.float64)
    zhat_bar = np.asarray(zhat_bar, dtype=np.float64)
    L, H, N, dh = zbar.shape
    keep = np.broadcast_to(np.asarray(counts) >= int(min_occurrences), (L, H, N))
    S = np.full((L, H, N), np.nan)
    S_bar = np.full((L, H), np.nan)
    for l in range(L):
        for h in range(H):
            k = keep[l, h] & np.isfinite(zbar[l, h]).all(-1) & np.isfinite(zhat_bar[l, h]).all(-1)
            if k.sum() < 2:
                continue
            x = zbar[l, h, k] - zbar[l, h, k].mean(0)
            y = zhat_bar[l, h, k] - zhat_bar[l, h, k].mean(0)
            G = np.asarray(gram[l, h], dtype=np.float64)
            xy = np.einsum("sd,de,se->s", x, G, y)
            xx = np.einsum("sd,de,se->s", x, G, x)
            yy = np.einsum("sd,de,se->s", y, G, y)
            S[l, h, k] = 1.0 - xy / np.sqrt(np.maximum(xx * yy, TINY))
            S_bar[l, h] = S[l, h, k].mean()
    return S, S_bar
