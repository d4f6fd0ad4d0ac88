"""The dereferencing ablation of App. positional (causal): mid-forward, a subspace S projected out of some heads'
summed write through the adapters' read/patch site (``patch_out``: the output projection's output), and what it
costs.

Arms (:func:`ablation_arms`): the carriers with S; the control of the same S removed from the same layers'
non-carrier heads; random subspaces of S's dimension (seeded, ``n_random`` draws: mean and spread). Each arm's next-token
loss increase over the unablated forward on the same eval windows, per token and by the category of the predicted
token (:func:`token_categories`), and for the carriers' arm the consumers: per downstream head, the mean L2 change of
its attention pattern (each query's row over the keys).
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["project_out_heads", "ablation_arms", "run_ablation", "token_categories", "CATEGORIES"]

CATEGORIES = ("number", "word-initial", "continuation", "punctuation", "other")


def project_out_heads(out: torch.Tensor, reads: torch.Tensor, O: torch.Tensor, heads, basis: torch.Tensor
                      ) -> torch.Tensor:
    """``out − P_S(Σ_{h ∈ heads} O_h z_h)``: ``out [B,T,d]`` the output projection's output, ``reads [B,T,H,dh]``,
    ``O [H, dh, d]`` the layer's per-head slices, ``basis [d, k]`` orthonormal (k = 0: ``out`` unchanged)."""
    if basis.shape[1] == 0 or not len(heads):
        return out
    idx = torch.as_tensor(list(heads), device=out.device)
    write = torch.einsum("bthe,hed->btd", reads[:, :, idx].to(out.dtype), O[idx].to(out.device, out.dtype))
    S = basis.to(out.device, out.dtype)
    return out - (write @ S) @ S.T


def ablation_arms(carriers, L: int, H: int, S: np.ndarray, n_random: int, seed: int) -> list[tuple]:
    """``[(arm, {layer: [heads]}, basis [d, k], draw)]``: carriers (S), non-carriers of the carriers' layers (S), and
    ``n_random`` random orthonormal ``[d, k]`` bases on the carriers (seeded)."""
    by: dict = {}
    for l, h in carriers:
        by.setdefault(int(l), []).append(int(h))
    others = {l: [h for h in range(H) if h not in hs] for l, hs in by.items()}
    arms = [("carriers", by, S, 0), ("non-carriers", {l: hs for l, hs in others.items() if hs}, S, 0)]
    rng = np.random.default_rng([int(seed), 0x5A])
    d, k = S.shape
    for i in range(int(n_random)):
        q, _ = np.linalg.qr(rng.normal(size=(d, max(k, 1))))
        arms.append(("random", by, q[:, :k], i))
    return arms


def run_ablation(adapter, windows: np.ndarray, arms, *, batch_size: int, progress=None) -> dict:
    """Every arm of ``arms`` (:func:`ablation_arms`) on ``windows [n, T]``: ``base`` the unablated token loss
    ``[n, T-1]``, ``loss[i]`` arm ``i``'s, and ``consumers [L, H]`` the mean L2 change of each head's attention rows
    under the first arm (the carriers)."""
    L, H = adapter.n_layers, adapter.n_heads
    O = torch.stack([adapter.out_proj_slices(l).detach().float() for l in range(L)])
    n, T = windows.shape
    base = np.zeros((n, T - 1))
    loss = [np.zeros((n, T - 1)) for _ in arms]
    change, rows = torch.zeros(L, H, dtype=torch.float64), 0
    for b0 in range(0, n, max(1, int(batch_size))):
        ids = torch.from_numpy(np.asarray(windows[b0 : b0 + int(batch_size)], dtype=np.int64))
        probs: dict = {}
        r = adapter.run(ids, select=("attn_probs",), loss=True,
                        on_layer=lambda cap: probs.__setitem__(cap.layer, _cpu(cap.attn_probs)))
        base[b0 : b0 + len(ids)] = r.token_loss.double().cpu().numpy()
        for i, (_, by, basis, _) in enumerate(arms):
            S = torch.as_tensor(np.asarray(basis), dtype=torch.float32)

            def patch(layer, out, reads, by=by, S=S):
                return project_out_heads(out, reads, O[layer], by[layer], S) if layer in by else None

            seen: dict = {}
            cb = (lambda cap: seen.__setitem__(cap.layer, _cpu(cap.attn_probs))) if i == 0 else None
            ra = adapter.run(ids, select=("attn_probs",) if i == 0 else (), loss=True, patch_out=patch, on_layer=cb)
            loss[i][b0 : b0 + len(ids)] = ra.token_loss.double().cpu().numpy()
            if i == 0:
                for l in range(L):  # [B, H, T, T] -> each query row's L2 change, summed over batch and queries
                    change[l] += (float("nan") if probs[l] is None  # a hybrid's layer of another mixer: no rows
                                  else (seen[l].double() - probs[l].double()).norm(dim=-1).sum((0, 2)))
        rows += len(ids) * T
        if progress is not None:
            progress.update(len(ids))
    return {"base": base, "loss": loss, "consumers": (change / max(rows, 1)).numpy()}


def _cpu(probs):
    return None if probs is None else probs.detach().cpu()  # None: a hybrid's layer of another mixer


def token_categories(tokenizer, ids: np.ndarray) -> np.ndarray:
    """The category (index into :data:`CATEGORIES`) of each predicted token ``ids[:, 1:]`` from the tokenizer's
    strings: **number** (its text, stripped, is digits, possibly with ``,`` ``.``: a token inside a number);
    **word-initial** (a space, then a letter); **continuation** (a letter with no space before, after a token
    ending in a letter: a subword inside a word); **punctuation** (only punctuation); **other** (the rest)."""
    import string

    ids = np.asarray(ids, dtype=np.int64)
    vocab, inv = np.unique(ids, return_inverse=True)  # each distinct token's string once
    text = [tokenizer.decode([int(t)]) for t in vocab]
    punct = set(string.punctuation) | set("“”‘’—–…")
    core = [x.strip() for x in text]
    number = np.array([bool(c) and all(ch.isdigit() or ch in ",." for ch in c) and any(ch.isdigit() for ch in c)
                       for c in core])
    initial = np.array([x[:1].isspace() and c[:1].isalpha() for x, c in zip(text, core)])
    starts, ends = np.array([x[:1].isalpha() for x in text]), np.array([x[-1:].isalpha() for x in text])
    mark = np.array([bool(c) and all(ch in punct for ch in c) for c in core])
    inv = inv.reshape(ids.shape)
    t, prev = inv[:, 1:], inv[:, :-1]
    # in this order: a token that is several kinds takes the first
    return np.select([number[t], initial[t], starts[t] & ends[prev], mark[t]], [0, 1, 2, 3], 4).astype(np.int64)
