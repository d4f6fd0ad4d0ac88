"""The data and the per-position reference of the statistics tests (tests/test_stats_reference.py and the other
files that check statistics, pass 2, the mean field or the experiments on tiny random models): Zipfian windows,
the tracked set of a window sample, and the per-layer tensors of the shared HF/torch-hook reference
(``tests/hf_reference.py``) as float64 arrays."""

from __future__ import annotations

import numpy as np
import torch
from hf_reference import reference_run
from tiny_models import VOCAB

from mfpipe.corpus.tracked import TrackedSet

N_TRACKED = 20
T = 16
BOS = VOCAB - 1


# ---------------------------------------------------------------------------------------------- data
def finite_scale(want, floor: float = 0.0) -> float:
    """The largest magnitude among ``want``'s finite entries (1 where it has none), at least ``floor``: the scale of an
    absolute tolerance. Over the finite entries only: pass 2's top-k slots left empty are -inf (``top_D``), and an
    infinite scale made the tolerance infinite, checking nothing but where the infinities sit."""
    a = np.abs(np.asarray(want, dtype=np.float64))
    a = a[np.isfinite(a)]
    return max(float(a.max()) if a.size else 1.0, floor)


def zipf_windows(n_windows: int, T: int = T, seed: int = 0, bos: int = BOS, vocab: int = VOCAB) -> np.ndarray:
    """[BOS, t1 … t(T-1)] windows with Zipfian tokens (some types repeat within a window, many are untracked).
    The BOS id also appears at positions >= 1 now and then (it must land in `<other>`)."""
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, vocab + 1) ** 1.05
    p /= p.sum()
    toks = rng.permutation(vocab)[rng.choice(vocab, size=(n_windows, T), p=p)]
    toks[:, 0] = bos
    return toks.astype(np.int32)


def tracked_for(tokens: np.ndarray, n: int = N_TRACKED, bos: int = BOS, vocab: int = VOCAB) -> TrackedSet:
    counts = np.bincount(tokens[:, 1:].ravel(), minlength=vocab)
    counts[bos] = 0
    order = np.lexsort((np.arange(vocab), -counts))[:n]
    return TrackedSet(
        type_ids=order, strings=[f"tok{i}" for i in order], counts=counts[order], bos_id=bos, vocab_size=vocab
    )


# ----------------------------------------------------------------------------- a statistics half
STORE_META = {"model": "tiny", "revision": "r1", "half": "stats", "corpus": "zipf", "corpus_fingerprint": "fp"}


def tiny_stats_half(model_type: str, folder, *, model_seed: int, n_windows: int, token_seed: int, batch_size: int,
                    context_length: int = T):
    """A tiny random model of ``model_type`` and its statistics half over Zipfian windows of ``context_length``
    tokens, written as ``folder/stats.zarr``: (model, adapter, tokens, tracked, sums, meta, the opened store)."""
    from tiny_models import make_tiny_model

    from mfpipe.models.adapters import get_adapter
    from mfpipe.stats import accumulate_shard, finalize, open_stats, write_store

    model = make_tiny_model(model_type, seed=model_seed)
    ad = get_adapter(model)
    tokens = zipf_windows(n_windows, T=context_length, seed=token_seed)
    tracked = tracked_for(tokens)
    sums = accumulate_shard(model, ad, tokens, tracked, batch_size=batch_size, device="cpu", progress=False)
    meta = dict(STORE_META, model_type=ad.model_type)
    st = open_stats(write_store(finalize(sums, tracked, meta), folder / "stats.zarr"))
    return model, ad, tokens, tracked, sums, meta, st


# ------------------------------------------------------------------------------- reference capture
def reference_capture(model, ids: torch.Tensor) -> dict[str, np.ndarray]:
    """Per-layer tensors from the shared HF/torch-hook reference (tests/hf_reference.py), as float64 numpy:
    probs [L,B,H,T,T], values [L,B,H,T,dh], reads [L,B,T,H,dh], resid [L+1,B,T,d], attn_out / mlp_out / ln_in
    [L,B,T,d]."""
    ref = reference_run(model, ids)
    layers = ref["layers"]
    f64 = lambda t: t.double().numpy()  # noqa: E731
    stack = lambda key: np.stack([f64(r[key]) for r in layers])  # noqa: E731
    return {
        "probs": stack("probs"),
        "values": stack("values"),
        "reads": stack("reads"),
        "resid": np.stack([f64(r["resid_in"]) for r in layers] + [f64(ref["final"])]),
        "attn_out": stack("attn_out"),
        "mlp_out": stack("mlp_out"),
        "ln_in": stack("ln_in"),
        "parallel": bool(getattr(model.config, "use_parallel_residual", False)),
    }
