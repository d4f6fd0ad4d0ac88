"""Float32 accumulation against a float64 reference on a 2 M-token-equivalent count (issue 13).

Pass 1 sums every batch in float32 and adds the batch sums once per batch into the shard's sums (float32 for
the attention kernel P, float64 for the per-position sums); partials store float32 except the residual sums and
squares. The reference here sums the same synthetic captures in float64 with numpy einsums (independent of the
accumulator's gather / index_add code), 500 batches x 4096 tokens = 2.05 M tokens, split into 4 shards that
go through save_partial / load_partial / merge_sums / finalize like the workflow.

Stated bound (docs: mfpipe.stats.pass1): relative error of every kernel sum <= (m + n_b) u, u = 2^-24, m the most
pairs of one cell in a batch, n_b the batches of a shard (here <= (4100 + 125) u = 2.5e-4, worst case); measured
it is ~1e-6, and the test holds the store to RTOL below. Partials rounded to k mantissa bits
(stats.partial_mantissa_bits) add 2^-(k+1) to that bound (mfpipe.stats.partials.round_mantissa).
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from mfpipe.stats import finalize, load_partial, merge_sums, save_partial
from mfpipe.stats.pass1 import Accumulator

L, H, d, dh, N, T, B = 2, 2, 8, 4, 20, 64, 64
K = N + 2
N_BATCHES, N_SHARDS = 500, 4
RTOL = 2e-6  # what the test holds the merged store to (relative to each statistic's scale); measured <= 3e-7


def _batch(rng):
    tok = rng.zipf(1.3, size=(B, T)) - 1
    kb = np.where(tok < N, tok, N + 1)
    kb[:, 0] = N
    qt = np.where(kb < N, kb, -1)
    qt[:, 0] = -1
    logits = rng.standard_normal((B, H, T, T)).astype(np.float32) * 2
    logits[:, :, np.triu_indices(T, 1)[0], np.triu_indices(T, 1)[1]] = -np.inf
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    # residuals far from the origin (a large common offset): E[x²] - c² cancels, the hard case for float32
    acts = {n: (rng.standard_normal((L, B, T, d)) + 30.0).astype(np.float32) for n in ("resid", "attn_out", "mlp_out")}
    acts["values"] = rng.standard_normal((L, B, H, T, dh)).astype(np.float32) + 5
    acts["reads"] = rng.standard_normal((L, B, T, H, dh)).astype(np.float32) - 5
    acts["final"] = (rng.standard_normal((B, T, d)) * 0.1 + 50.0).astype(np.float32)
    return kb, qt, probs, acts


def _ref_add(ref, kb, qt, probs, acts):
    koh = np.eye(K)[kb]  # [B,T,K]
    qoh = np.where(qt[..., None] >= 0, np.eye(N)[np.maximum(qt, 0)], 0.0)  # [B,T,N]
    p64 = probs.astype(np.float64)
    ref["P_sum"] += np.einsum("bjs,bhjt->hst", qoh, p64 @ koh[:, None])[None].repeat(L, 0)
    for l in range(L):
        x = acts["resid"][l].astype(np.float64)
        ref["resid_sum"][l] += np.einsum("btk,btd->kd", koh, x)
        ref["resid_sq_sum"][l] += np.einsum("btk,btd->kd", koh, x * x)
        ref["attn_out_sum"][l] += np.einsum("btk,btd->kd", koh, acts["attn_out"][l].astype(np.float64))
        ref["mlp_out_sum"][l] += np.einsum("btk,btd->kd", koh, acts["mlp_out"][l].astype(np.float64))
        ref["value_sum"][l] += np.einsum("btk,bhtd->hkd", koh, acts["values"][l].astype(np.float64))
        ref["read_sum"][l] += np.einsum("btk,bthd->hkd", koh, acts["reads"][l].astype(np.float64))
    f = acts["final"].astype(np.float64)
    ref["resid_sum"][L] += np.einsum("btk,btd->kd", koh, f)
    ref["resid_sq_sum"][L] += np.einsum("btk,btd->kd", koh, f * f)


@pytest.fixture(scope="module")
def shards():
    """The float64 reference and each shard's accumulator sums (4 shards of 125 batches x 4096 tokens)."""
    rng = np.random.default_rng(0)
    ref = {"P_sum": np.zeros((L, H, N, K)), "resid_sum": np.zeros((L + 1, K, d)), "resid_sq_sum": np.zeros((L + 1, K, d)),
           "attn_out_sum": np.zeros((L, K, d)), "mlp_out_sum": np.zeros((L, K, d)), "value_sum": np.zeros((L, H, K, dh)),
           "read_sum": np.zeros((L, H, K, dh))}
    out = []
    per_shard = N_BATCHES // N_SHARDS
    for _ in range(N_SHARDS):
        acc = Accumulator(L, H, d, dh, N, T)  # no attention-input norm: ln_in stays NaN in both
        for _ in range(per_shard):
            kb, qt, probs, acts = _batch(rng)
            _ref_add(ref, kb, qt, probs, acts)
            acc.begin_batch(kb, qt)
            pt = torch.from_numpy(probs)
            for l in range(L):
                r = torch.from_numpy(acts["resid"][l])
                ao = torch.from_numpy(acts["attn_out"][l])
                acc.on_layer(SimpleNamespace(layer=l, resid_in=r, attn_probs=pt, values=torch.from_numpy(acts["values"][l]),
                                             reads=torch.from_numpy(acts["reads"][l]), attn_out=ao, resid_mid=r + ao,
                                             mlp_out=torch.from_numpy(acts["mlp_out"][l])))
            acc.on_final(torch.from_numpy(acts["final"]))
            acc.end_batch()
        out.append((acc.sums(), per_shard * B))
    return ref, out


def _merged_errors(shards, tmp_path, mantissa_bits):
    """Write the shards' partials (rounded to ``mantissa_bits`` or exact), merge them like the workflow, and return
    (relative error of the kernel sum per cell, of each per-position sum and each finalized statistic per scale)."""
    ref, parts = shards
    paths = []
    for i, (sums, n_windows) in enumerate(parts):
        paths.append(save_partial(tmp_path / f"shard-{i}.zarr", sums, {"n_windows": n_windows}, mantissa_bits=mantissa_bits))
    loaded = [load_partial(p) for p in paths]
    assert all(meta["mantissa_bits"] == mantissa_bits for _, meta in loaded)
    merged = merge_sums((sums for sums, _ in loaded), names=[str(p) for p in paths])
    assert int(merged["n_tokens"]) == N_BATCHES * B * T >= 2_000_000, int(merged["n_tokens"])

    # the sums themselves: relative error per cell (kernel) / per statistic scale (per-position sums)
    P, Pref = merged["P_sum"], ref["P_sum"]
    nz = Pref > 0
    assert np.array_equal(P > 0, nz)
    errs = {"P_sum per cell": (np.abs(P[nz] - Pref[nz]) / Pref[nz]).max()}
    for key in ("resid_sum", "resid_sq_sum", "attn_out_sum", "mlp_out_sum", "value_sum", "read_sum"):
        errs[key] = np.abs(merged[key] - ref[key]).max() / np.abs(ref[key]).max()

    # the store: merged float32 partials against the float64 accumulation, through finalize (float64 means)
    tracked = {"key_lut": np.arange(K), "query_lut": np.arange(K), "n": N}
    full = dict(merged)
    for key, v in ref.items():
        full[key] = v
    full["resid_mid_sum"] = ref["resid_sum"][:L] + ref["attn_out_sum"]
    got = finalize(merged, tracked, {}, dtype=np.float64)
    want = finalize(full, tracked, {}, dtype=np.float64)
    for name in ("P", "centroid", "resid_var", "mu", "zbar", "attn_out_mean", "resid_mid_mean", "mlp_out_mean"):
        g, w = got[name].values, want[name].values
        assert np.array_equal(np.isnan(g), np.isnan(w)), name
        errs[name] = np.nanmax(np.abs(g - w)) / np.nanmax(np.abs(w))
    print(f"mantissa_bits={mantissa_bits}: max relative error vs float64:", {k: f"{v:.1e}" for k, v in errs.items()})
    return errs


def test_float32_partials_match_a_float64_accumulation(shards, tmp_path):
    errs = _merged_errors(shards, tmp_path, None)
    assert max(errs.values()) < RTOL, errs


def test_rounded_partials_match_a_float64_accumulation_within_the_rounding_bound(shards, tmp_path):
    """Partials rounded to 11 mantissa bits (the presets' stats.partial_mantissa_bits): every merged sum and
    statistic within RTOL + 2^-12 of the float64 accumulation (the sums here are of one sign per cell, so each
    partial's relative rounding bound carries to their sum), and the rounding is really there."""
    bits = 11
    errs = _merged_errors(shards, tmp_path, bits)
    bound = RTOL + 2.0 ** -(bits + 1)
    assert max(errs.values()) < bound, errs
    assert errs["P_sum per cell"] > 2.0 ** -(bits + 3), errs  # rounded, not exact
    # the residual sums keep 24 bits more: resid_var (E[x²] - c², an offset of 30 sigma) stays at float32's level
    assert errs["resid_var"] < RTOL, errs
