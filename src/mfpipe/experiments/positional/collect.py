"""The occurrences App. positional analyses, read from one traced forward per batch of windows.

For a head ``(l, h)`` and a query occurrence at position ``p`` of an eval-half window, of tracked type ``s``:

* ``delta`` = z − z̄_s, the within-type write deviation (App. positional): the head's read at ``p`` (head space,
  before the output projection) minus the statistics half's mean read of type-``s`` queries (``MeanFieldStats.zbar``),
  times the query's own gate where the attention gates its reads (Qwen3-Next's: as the head writes it, and as the
  deviation's meters take it); NaN at a hybrid's layers without attention;
* ``D`` = 1 − cos(z, ẑ_sX), the per-context deviation against the context-conditional mean field (eq:deviation,
  residual-stream units), exactly the ``D`` of :func:`mfpipe.meanfield.forward.deviation_forward`;
* ``bos`` = the attention on position 0; ``offset`` = p − the key position with the largest attention (the first
  one on ties; the relative-code control); ``other`` = the attention on untracked (``<other>``) keys, App. P's
  vocabulary filter (what :class:`mfpipe.deviation.queries.QueryTerms` calls ``other``).

:func:`sample_occurrences` draws the occurrences (a seeded stride over positions of a seeded sample of windows),
:func:`collect` measures them; :func:`repeated_sequences` and :func:`repeated_deviation` give the repeated-text
condition of App. protocol (``[BOS; c; c]``, per-head mean ``D`` over second-copy queries);
:func:`class_types` picks the tracked types of a token class (e.g. the month names). Everything within a batch is
torch ops over the sampled positions; loops run over batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from mfpipe.meanfield.forward import deviation_forward, kernel_for
from mfpipe.meanfield.kernel import MeanFieldKernel

__all__ = ["Occurrences", "sample_occurrences", "prepare", "batches", "collect", "repeated_sequences",
           "repeated_deviation", "class_types"]


@dataclass
class Occurrences:
    """Per query occurrence (numpy): ``window``, ``position``, ``query_type`` int64 ``[n]``; ``delta [n, L, H, dh]``
    float32 (z − z̄_s); ``D``, ``bos``, ``other [n, L, H]`` float32; ``offset [n, L, H]`` int64; ``valid [n]`` bool (a
    tracked query type with a valid Â row in every layer; the other rows carry whatever the forward gave)."""

    window: np.ndarray
    position: np.ndarray
    query_type: np.ndarray
    delta: np.ndarray
    D: np.ndarray
    bos: np.ndarray
    offset: np.ndarray
    other: np.ndarray
    valid: np.ndarray

    def __len__(self) -> int:
        return int(self.window.shape[0])


_FIELDS = ("delta", "D", "bos", "offset", "other", "valid")


def sample_occurrences(n_windows: int, T: int, *, stride: int, min_position: int, budget: int, seed
                       ) -> tuple[np.ndarray, np.ndarray]:
    """``(window [n], position [n])`` int64, sorted by (window, position): the positions ``p`` with ``p ≡ o (mod
    stride)`` (``o`` a seeded offset in ``0..stride-1``) and ``min_position <= p <= T-1`` of ``budget // T`` windows
    (at most ``n_windows``) drawn in a seeded order. Untracked positions are dropped later, by :func:`collect`."""
    stride, T = int(stride), int(T)
    if stride < 1 or T < 1:
        raise ValueError(f"stride ({stride}) and T ({T}) must be positive")
    rng = np.random.default_rng(seed)
    offset = int(rng.integers(stride))
    n_use = min(int(n_windows), max(int(budget), 0) // T)
    win = np.sort(rng.permutation(int(n_windows))[:n_use]).astype(np.int64)
    pos = np.arange(offset, T, stride, dtype=np.int64)
    pos = pos[pos >= int(min_position)]
    return np.repeat(win, len(pos)), np.tile(pos, len(win))


def _query_types(query_buckets, tokens: np.ndarray, kernel: MeanFieldKernel) -> np.ndarray:
    """Query types ``[B, T]`` of ``tokens`` (position 0, BOS, is never a query): ``query_buckets`` None (the kernel's
    tracked set), a callable ``tokens -> [B, T]``, a per-token LUT ``[vocab]`` or the types themselves ``[B, T]``."""
    if query_buckets is None:
        qt = kernel.query_lut[tokens]
    elif callable(query_buckets):
        qt = np.asarray(query_buckets(tokens))
    else:
        q = np.asarray(query_buckets)
        qt = q[tokens] if q.ndim == 1 else q
    qt = np.array(qt, dtype=np.int64)
    if qt.shape != tokens.shape:
        raise ValueError(f"query types of shape {qt.shape} for tokens of shape {tokens.shape}")
    qt[:, 0] = -1
    return qt


def _batch(adapter, k: MeanFieldKernel, zbar: torch.Tensor, toks: np.ndarray, qt: np.ndarray, bi: np.ndarray,
           pi: np.ndarray, s: np.ndarray) -> dict[str, np.ndarray]:
    """One forward over windows ``toks [B, T]``: the fields of :class:`Occurrences` at ``(bi, pi)`` (type ``s``)."""
    dev = k.device
    kb, _ = k.buckets(toks)
    B, T = toks.shape
    L, H, n = adapter.n_layers, adapter.n_heads, len(bi)
    bi_t, pi_t, s_t = (torch.from_numpy(np.asarray(x, dtype=np.int64)).to(dev) for x in (bi, pi, s))
    # NaN (offset -1) where no attention layer writes them: a hybrid's other layers have no heads (the head tables
    # count none there: an "other" share of NaN passes no threshold)
    out = {"delta": torch.full((n, L, H, zbar.shape[-1]), float("nan"), dtype=torch.float32, device=dev),
           "bos": torch.full((n, L, H), float("nan"), dtype=torch.float32, device=dev),
           "other": torch.full((n, L, H), float("nan"), dtype=torch.float32, device=dev),
           "offset": torch.full((n, L, H), -1, dtype=torch.int64, device=dev)}
    other_key = (kb == k.n + 1).to(dev, torch.float32)[bi_t][:, None, :]  # [n, 1, T]: <other> keys
    future = (torch.arange(T, device=dev)[None, :] > pi_t[:, None])[:, None, :]  # [n, 1, T]: keys after p

    def on_capture(cap, m_layer):
        l = cap.layer
        P = cap.attn_probs[bi_t, :, pi_t].to(dev, torch.float32)  # [n, H, T]: the query rows
        delta = cap.reads[bi_t, pi_t].to(dev, torch.float32) - zbar[s_t, l]
        if cap.resid_in is not None:  # a gated attention: the deviation as the head writes it, times its query's own
            # gate (as the meters take it: deviation_forward), so Δ O_h is the head's write less the mean field's
            delta = delta * adapter.read_gate(l, cap.resid_in[bi_t, pi_t], cap.reads[bi_t, pi_t]).to(dev, delta.dtype)
        out["delta"][:, l] = delta
        out["bos"][:, l] = P[..., 0]
        out["other"][:, l] = (P * other_key).sum(-1)
        out["offset"][:, l] = pi_t[:, None] - P.masked_fill(future, float("-inf")).argmax(-1)

    m, valid, _ = deviation_forward(adapter, k, torch.from_numpy(toks), kb, torch.from_numpy(qt),
                                    on_capture=on_capture)
    out["D"] = m["D"][bi_t, pi_t].float()
    out["valid"] = valid[bi_t, pi_t]
    return {key: v.cpu().numpy() for key, v in out.items()}


def prepare(adapter, kernel: MeanFieldKernel, zbar, windows, query_buckets, window, position):
    """What :func:`collect` and :func:`batches` run on: ``(kernel, zbar tensor, windows, query types [n_windows, T],
    window, position, query_type)``, the occurrences of an untracked type dropped (they have no z̄_s) and the rest
    sorted by (window, position) (:func:`collect`'s arguments)."""
    k = kernel_for(kernel, adapter)
    windows = np.asarray(windows, dtype=np.int64)
    qb = _query_types(query_buckets, windows, k)
    zb = torch.as_tensor(zbar, dtype=torch.float32).to(k.device)
    if tuple(zb.shape[:3]) != (k.n, adapter.n_layers, adapter.n_heads):
        raise ValueError(f"zbar has shape {tuple(zb.shape)}, expected [N={k.n}, L={adapter.n_layers}, "
                         f"H={adapter.n_heads}, dh]")
    window, position = np.asarray(window, dtype=np.int64), np.asarray(position, dtype=np.int64)
    qtype = qb[window, position]
    keep = qtype >= 0
    order = np.lexsort((position[keep], window[keep]))
    return k, zb, windows, qb, window[keep][order], position[keep][order], qtype[keep][order]


def batches(adapter, prepared, *, batch_size: int, progress: bool = False, desc: str = "positional occurrences"):
    """Yield ``(lo, hi, part)`` per batch of ``batch_size`` distinct windows: ``part`` the fields of
    :class:`Occurrences` (``delta``, ``D``, ``bos``, ``offset``, ``other``, ``valid``) of the sorted occurrences
    ``lo:hi`` of ``prepared`` (:func:`prepare`). The same batches in the same order on every call, so a second pass
    gives the first's numbers bit for bit."""
    from tqdm.auto import tqdm

    k, zb, windows, qb, window, position, qtype = prepared
    uw = np.unique(window)
    bs = max(int(batch_size), 1)
    for b0 in tqdm(range(0, len(uw), bs), desc=desc, disable=not progress, mininterval=2.0, dynamic_ncols=True):
        w = uw[b0 : b0 + bs]
        lo, hi = np.searchsorted(window, w[0], "left"), np.searchsorted(window, w[-1], "right")
        bi = np.searchsorted(w, window[lo:hi])
        yield int(lo), int(hi), _batch(adapter, k, zb, windows[w], qb[w], bi, position[lo:hi], qtype[lo:hi])


def collect(adapter, kernel: MeanFieldKernel, zbar, windows, query_buckets, window, position, *, batch_size: int,
            progress: bool = False) -> Occurrences:
    """The occurrences ``(window, position)`` of ``windows [n_windows, T]`` (module docstring), one
    :func:`~mfpipe.meanfield.forward.deviation_forward` per batch of ``batch_size`` distinct windows, held whole (the
    job streams them instead: :mod:`mfpipe.experiments.positional.stream`).

    ``zbar [N, L, H, dh]`` the statistics half's per-type mean read (float32 tensor or array: ``MeanFieldStats.zbar``
    transposed to (query, layer, head, head_dim)); ``query_buckets`` the windows' query types ``[n_windows, T]``
    (``MeanFieldKernel.buckets`` / the tracked set's ``query_bucket_lut``; None: the kernel's). Occurrences of an
    untracked type are dropped first (they have no z̄_s); the rest come back sorted by (window, position)."""
    prepared = prepare(adapter, kernel, zbar, windows, query_buckets, window, position)
    parts = [part for _, _, part in batches(adapter, prepared, batch_size=batch_size, progress=progress)]
    L, H, dh = adapter.n_layers, adapter.n_heads, prepared[1].shape[-1]
    empty = {"delta": np.zeros((0, L, H, dh), np.float32), "D": np.zeros((0, L, H), np.float32),
             "bos": np.zeros((0, L, H), np.float32), "other": np.zeros((0, L, H), np.float32),
             "offset": np.zeros((0, L, H), np.int64), "valid": np.zeros(0, bool)}
    cols = {f: np.concatenate([p[f] for p in parts]) if parts else empty[f] for f in _FIELDS}
    return Occurrences(*prepared[4:], **cols)


def repeated_sequences(windows, n: int, k: int, *, bos_id: int, seed) -> np.ndarray:
    """``[BOS; c; c]`` rows ``[n, 1 + 2k]`` int64: ``c`` the ``k`` consecutive tokens of a window starting at a
    seeded position in ``1..T-k`` (after the window's BOS), from ``n`` distinct windows in a seeded order."""
    windows = np.asarray(windows)
    nw, T = windows.shape
    n, k = int(n), int(k)
    if not 1 <= k <= T - 1:
        raise ValueError(f"chunk length k={k} must lie in [1, T-1 = {T - 1}]")
    if n > nw:
        raise ValueError(f"{n} repeated sequences asked of {nw} windows")
    rng = np.random.default_rng(seed)
    pick = rng.permutation(nw)[:n]
    start = rng.integers(1, T - k + 1, size=n)
    c = windows[pick[:, None], start[:, None] + np.arange(k)[None, :]].astype(np.int64)
    return np.concatenate([np.full((n, 1), int(bos_id), np.int64), c, c], axis=1)


def repeated_deviation(adapter, kernel: MeanFieldKernel, sequences, query_buckets=None, *, min_position: int,
                       max_other: float, batch_size: int, progress: bool = False) -> dict:
    """The repeated-text condition (App. protocol): per head, the mean ``D`` (eq:deviation, as
    :func:`~mfpipe.meanfield.forward.deviation_forward`) over the valid queries of the second copy of ``[BOS; c; c]``
    (positions ``1+k..2k``), and of the first (``1..k``) for reference, both at positions ``>= min_position``; a
    head's occurrence is dropped where its attention on untracked keys exceeds ``max_other``.

    ``query_buckets``: the query types, as :func:`collect` takes them (None, a callable ``tokens -> [B, T]`` or a
    per-token LUT such as ``TrackedSet.query_bucket_lut()``). Returns numpy ``D_repeated``, ``n_repeated``,
    ``D_first``, ``n_first`` ``[L, H]`` (D NaN where a head has no occurrence) and ``n_sequences``, ``k``."""
    from tqdm.auto import tqdm

    k = kernel_for(kernel, adapter)
    seqs = np.asarray(sequences, dtype=np.int64)
    n, T = seqs.shape
    kk = (T - 1) // 2
    if T % 2 != 1 or T < 3 or not np.array_equal(seqs[:, 1 : 1 + kk], seqs[:, 1 + kk :]):
        raise ValueError("repeated sequences must be [BOS; c; c] (odd length >= 3, the chunk repeated)")
    dev, L, H = k.device, adapter.n_layers, adapter.n_heads
    pos = torch.arange(T, device=dev)
    copies = {"first": (pos >= 1) & (pos <= kk), "repeated": pos > kk}
    sums = {c: torch.zeros(L, H, dtype=torch.float64, device=dev) for c in copies}
    counts = {c: torch.zeros(L, H, dtype=torch.int64, device=dev) for c in copies}
    for b0 in tqdm(range(0, n, max(int(batch_size), 1)), desc="repeated text", disable=not progress,
                   mininterval=2.0, dynamic_ncols=True):
        toks = seqs[b0 : b0 + max(int(batch_size), 1)]
        kb, _ = k.buckets(toks)
        other_key = (kb == k.n + 1).to(dev, torch.float32)[:, None, None, :]  # [B, 1, 1, T]
        other = torch.full((*toks.shape, L, H), float("nan"), dtype=torch.float32, device=dev)  # NaN: no heads

        def on_capture(cap, m_layer, other=other, other_key=other_key):
            other[:, :, cap.layer] = (cap.attn_probs.to(dev, torch.float32) * other_key).sum(-1).transpose(1, 2)

        m, valid, _ = deviation_forward(adapter, k, torch.from_numpy(toks), kb,
                                        torch.from_numpy(_query_types(query_buckets, toks, k)), on_capture=on_capture)
        keep = valid[:, :, None, None] & (other <= float(max_other)) & (pos >= int(min_position))[None, :, None, None]
        for c, mask in copies.items():
            sel = keep & mask[None, :, None, None]
            sums[c] += torch.where(sel, m["D"], torch.zeros_like(m["D"])).sum((0, 1))
            counts[c] += sel.sum((0, 1))
    out = {"n_sequences": int(n), "k": int(kk)}
    for c in copies:
        nc = counts[c].cpu().numpy()
        with np.errstate(invalid="ignore", divide="ignore"):
            out[f"D_{c}"] = np.where(nc > 0, sums[c].cpu().numpy() / nc, np.nan)
        out[f"n_{c}"] = nc
    return out


def class_types(tokenizer, tracked, strings) -> np.ndarray:
    """The tracked query types (indices into ``tracked.type_ids``, as ``query_bucket_lut`` numbers them) whose token
    decodes, stripped and case-folded, to one of ``strings`` (the type-class test: e.g. the twelve month names)."""
    want = {str(s).strip().casefold() for s in strings}
    ids = np.asarray(tracked.type_ids, dtype=np.int64)
    hit = [tokenizer.decode([int(i)]).strip().casefold() in want for i in ids]
    return np.flatnonzero(np.asarray(hit, dtype=bool)).astype(np.int64)
