"""The positional experiment's occurrence collector (App. positional, App. protocol's repeated-text condition) on a tiny
model: :func:`collect` against a slow per-occurrence reference (one plain forward per window, per-position numpy),
the sampling's stride / position / budget, ``[BOS; c; c]`` sequences and the repeated-text deviation against a direct
mask on the deviation forward, the type-class look-up, and the deviation forward moved to the core (the prompts
experiment's names are the core's; ``on_capture`` once per layer)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from stats_reference import tiny_stats_half, tracked_for, zipf_windows

from mfpipe.experiments.positional import collect as C
from mfpipe.meanfield.forward import deviation_forward, kernel_for
from mfpipe.meanfield.kernel import kernel_from_store

T_CTX = 32


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    yield


@pytest.fixture(scope="module", params=["gpt2", "gemma2"])
def setup(request, tmp_path_factory):
    _, ad, _, tracked, _, _, st = tiny_stats_half(request.param, tmp_path_factory.mktemp("pos"), model_seed=5,
                                                  n_windows=24, token_seed=1, batch_size=8, context_length=T_CTX)
    ev = zipf_windows(12, T=T_CTX, seed=2).astype(np.int64)
    kernel = kernel_for(kernel_from_store(st, tracked, min_count=1), ad)
    zbar = torch.from_numpy(np.asarray(st.zbar().transpose("query", "layer", "head", "head_dim").values,
                                       dtype=np.float32))
    qb = tracked.query_bucket_lut()[ev]
    return ad, tracked, kernel, zbar, ev, qb


def _plain(ad, ids):
    """One plain forward of one window: per layer probs [H, T, T] and reads [T, H, dh] as float64 numpy."""
    caps = []
    ad.run(torch.as_tensor(ids)[None], select=("attn_probs", "reads"),
           on_layer=lambda c: caps.append((c.attn_probs[0].double().numpy().copy(), c.reads[0].double().numpy().copy())))
    return caps


def test_sampling_respects_stride_positions_and_budget():
    w, p = C.sample_occurrences(50, 64, stride=8, min_position=10, budget=64 * 7 + 5, seed=3)
    assert w.dtype == np.int64 and p.dtype == np.int64
    assert len(np.unique(w)) == 7 and set(np.unique(w)) <= set(range(50))
    assert (p >= 10).all() and (p <= 63).all() and len(np.unique(p % 8)) == 1
    pos = np.unique(p)
    assert len(w) == 7 * len(pos) and all((w == x).sum() == len(pos) for x in np.unique(w))
    assert np.array_equal(pos, np.arange(pos[0] % 8, 64, 8)[np.arange(pos[0] % 8, 64, 8) >= 10])
    assert np.array_equal(np.lexsort((p, w)), np.arange(len(w)))  # sorted by (window, position)
    w2, p2 = C.sample_occurrences(50, 64, stride=8, min_position=10, budget=64 * 7 + 5, seed=3)
    assert np.array_equal(w, w2) and np.array_equal(p, p2)
    offsets = {int(C.sample_occurrences(50, 64, stride=8, min_position=0, budget=64, seed=s)[1][0]) for s in range(20)}
    assert len(offsets) > 1  # the offset is drawn
    w3, _ = C.sample_occurrences(5, 64, stride=8, min_position=1, budget=10**6, seed=0)
    assert len(np.unique(w3)) == 5  # at most every window
    assert len(C.sample_occurrences(5, 64, stride=8, min_position=1, budget=63, seed=0)[0]) == 0


def test_collect_matches_a_per_occurrence_reference(setup):
    ad, tracked, kernel, zbar, ev, qb = setup
    window, position = C.sample_occurrences(len(ev), T_CTX, stride=3, min_position=2, budget=10**6, seed=0)
    occ = C.collect(ad, kernel, zbar, ev, qb, window, position, batch_size=5)
    tracked_pos = qb[window, position] >= 0
    assert len(occ) == tracked_pos.sum() and (occ.query_type >= 0).all()
    assert np.array_equal(occ.query_type, qb[occ.window, occ.position])
    L, H = ad.n_layers, ad.n_heads
    assert occ.delta.shape == (len(occ), L, H, zbar.shape[-1]) and occ.delta.dtype == np.float32
    assert occ.D.shape == occ.bos.shape == occ.other.shape == occ.offset.shape == (len(occ), L, H)
    assert occ.valid.any()
    rng = np.random.default_rng(0)
    picks = rng.choice(np.flatnonzero(occ.valid), size=6, replace=False)
    other_bucket = tracked.n + 1
    for i in picks:
        wi, p, s = int(occ.window[i]), int(occ.position[i]), int(occ.query_type[i])
        caps = _plain(ad, ev[wi])
        kb, qt = kernel.buckets(ev[wi : wi + 1])
        m, valid, _ = deviation_forward(ad, kernel, torch.as_tensor(ev[wi : wi + 1]), kb, qt)
        assert bool(valid[0, p])
        okey = kb[0].numpy() == other_bucket
        for l, (probs, reads) in enumerate(caps):
            np.testing.assert_allclose(occ.delta[i, l], reads[p] - zbar[s, l].double().numpy(), atol=1e-5)
            np.testing.assert_allclose(occ.bos[i, l], probs[:, p, 0], atol=1e-6)
            np.testing.assert_allclose(occ.other[i, l], probs[:, p, okey].sum(-1), atol=1e-6)
            np.testing.assert_array_equal(occ.offset[i, l], p - probs[:, p, : p + 1].argmax(-1))
            np.testing.assert_allclose(occ.D[i, l], m["D"][0, p, l].numpy(), atol=1e-5)
    # batching does not change the result; an untracked occurrence is dropped before the forward
    again = C.collect(ad, kernel, zbar.numpy(), ev, None, window[::-1], position[::-1], batch_size=12)
    assert np.array_equal(again.window, occ.window) and np.array_equal(again.position, occ.position)
    np.testing.assert_allclose(again.delta, occ.delta, atol=1e-5)
    np.testing.assert_allclose(again.D, occ.D, atol=1e-5)
    assert np.array_equal(again.valid, occ.valid)


def test_collect_timing_per_thousand_occurrences(setup):
    ad, tracked, kernel, zbar, ev, qb = setup
    window, position = C.sample_occurrences(len(ev), T_CTX, stride=1, min_position=1, budget=10**6, seed=1)
    t0 = time.perf_counter()
    occ = C.collect(ad, kernel, zbar, ev, qb, window, position, batch_size=12)
    dt = time.perf_counter() - t0
    print(f"\n{ad.model_type}: collect {len(occ)} occurrences in {dt:.3f} s ({1000 * dt / max(len(occ), 1):.3f} s / 1k)")
    assert len(occ) > 0


def test_repeated_sequences_are_bos_c_c(setup):
    ad, tracked, kernel, zbar, ev, qb = setup
    seqs = C.repeated_sequences(ev, 8, 10, bos_id=int(ev[0, 0]), seed=2)
    assert seqs.shape == (8, 21) and seqs.dtype == np.int64
    assert (seqs[:, 0] == ev[0, 0]).all() and np.array_equal(seqs[:, 1:11], seqs[:, 11:])
    for c in seqs[:, 1:11]:  # each chunk is k consecutive tokens of some window, after its BOS
        assert any(np.array_equal(w[s : s + 10], c) for w in ev for s in range(1, T_CTX - 9))
    assert np.array_equal(seqs, C.repeated_sequences(ev, 8, 10, bos_id=int(ev[0, 0]), seed=2))
    with pytest.raises(ValueError):
        C.repeated_sequences(ev, 100, 10, bos_id=0, seed=0)


def test_repeated_deviation_counts_second_copy_queries_only(setup):
    ad, tracked, kernel, zbar, ev, qb = setup
    k = 12
    seqs = C.repeated_sequences(ev, 10, k, bos_id=int(ev[0, 0]), seed=4)
    max_other, min_position = 0.5, 3
    got = C.repeated_deviation(ad, kernel, seqs, tracked.query_bucket_lut(), min_position=min_position,
                               max_other=max_other, batch_size=4)
    kb, qt = kernel.buckets(seqs)
    m, valid, _ = deviation_forward(ad, kernel, torch.as_tensor(seqs), kb, qt)
    probs = []
    ad.run(torch.as_tensor(seqs), select=("attn_probs",), on_layer=lambda c: probs.append(c.attn_probs.double().numpy().copy()))
    okey = kb.numpy() == tracked.n + 1
    other = np.stack([(p * okey[:, None, None, :]).sum(-1).transpose(0, 2, 1) for p in probs], axis=2)  # [B,T,L,H]
    D = m["D"].numpy()
    pos = np.arange(seqs.shape[1])
    keep = valid.numpy()[:, :, None, None] & (other <= max_other) & (pos >= min_position)[None, :, None, None]
    for name, mask in (("repeated", pos > k), ("first", (pos >= 1) & (pos <= k))):
        sel = keep & mask[None, :, None, None]
        n = sel.sum((0, 1))
        assert np.array_equal(got[f"n_{name}"], n)
        with np.errstate(invalid="ignore"):
            np.testing.assert_allclose(got[f"D_{name}"], np.where(sel, D, 0).sum((0, 1)) / n, atol=1e-9)
    assert got["n_repeated"].sum() > 0 and got["k"] == k and got["n_sequences"] == 10
    assert (other > max_other).any()  # the filter dropped something
    loose = C.repeated_deviation(ad, kernel, seqs, None, min_position=min_position, max_other=1.0, batch_size=10)
    assert (loose["n_repeated"] >= got["n_repeated"]).all() and (loose["n_repeated"] > got["n_repeated"]).any()


def test_class_types_picks_the_tracked_types_of_a_class():
    class Tok:
        def decode(self, ids):
            return {5: " January", 7: "march ", 9: "cat", 11: " MAY"}.get(ids[0], f"t{ids[0]}")

    tracked = tracked_for(np.array([[99, 9, 9, 9, 5, 5, 7, 11, 3]]), n=5, bos=99, vocab=100)
    got = C.class_types(Tok(), tracked, ["january", "March", "May", "june"])
    ids = tracked.type_ids[got]
    assert sorted(ids.tolist()) == [5, 7, 11]
    assert np.array_equal(tracked.query_bucket_lut()[ids], got)


def test_deviation_forward_moved_to_the_core_with_on_capture(setup):
    from mfpipe.experiments.prompts import classes

    assert classes.deviation_forward is deviation_forward and classes.kernel_for is kernel_for
    ad, tracked, kernel, zbar, ev, qb = setup
    ids = torch.as_tensor(ev[:3])
    kb, qt = kernel.buckets(ev[:3])
    seen = []
    m, valid, _ = deviation_forward(ad, kernel, ids, kb, qt, on_capture=lambda cap, ml: seen.append(
        (cap.layer, cap.attn_probs is not None and cap.values is not None and cap.reads is not None, ml["D"].clone())))
    assert [s[0] for s in seen] == list(range(ad.n_layers)) and all(s[1] for s in seen)
    for l, _, d in seen:
        assert torch.equal(d, m["D"][:, :, l])
    m0, valid0, _ = deviation_forward(ad, kernel, ids, kb, qt)
    assert all(torch.equal(m0[key], m[key]) for key in m0) and torch.equal(valid0, valid)
