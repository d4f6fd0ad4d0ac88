import numpy as np
import pytest

from mfpipe.experiments.rollout import metrics as M


def _cloud(n=12, d=7, seed=0, offset=5.0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, d)) + offset


def _rotation(d, seed=1):
    q, r = np.linalg.qr(np.random.default_rng(seed).normal(size=(d, d)))
    return q * np.sign(np.diag(r))


def test_identity_scores_perfect():
    t = _cloud()
    s = M.score_cloud(t, t)
    assert s["cosine"] == pytest.approx(1.0)
    assert s["rsa"] == pytest.approx(1.0)
    assert s["rel_error"] == pytest.approx(0.0, abs=1e-12)
    assert s["norm_ratio"] == pytest.approx(1.0)


def test_offsets_change_nothing():
    t = _cloud(seed=0)
    p = t + 0.3 * np.random.default_rng(5).normal(size=t.shape)
    base = M.score_cloud(p, t)
    shift = np.random.default_rng(7).normal(size=t.shape[1]) * 100
    for pp, tt in [(p + shift, t + shift), (p + shift, t), (p, t - 3 * shift)]:
        s = M.score_cloud(pp, tt)
        for k in M.METRICS:
            assert s[k] == pytest.approx(base[k], rel=1e-9, abs=1e-9), k


def test_rsa_rotation_and_scale_invariant():
    t = _cloud(seed=2)
    p = t + 0.5 * np.random.default_rng(3).normal(size=t.shape)
    r0 = M.rsa(p, t)
    assert r0 < 0.999
    R = _rotation(t.shape[1])
    assert M.rsa(p @ R, t) == pytest.approx(r0, rel=1e-10)
    assert M.rsa(3.0 * (p @ R) + 11.0, t) == pytest.approx(r0, rel=1e-10)
    # cosine is not rotation invariant
    assert M.centered_cosine(p @ R, t) < 0.9


def test_hand_computed_cases():
    t = np.array([[1.0, 0.0], [-1.0, 0.0]]) + 10.0  # centred: (±1, 0)
    p = np.array([[0.0, 1.0], [0.0, -1.0]]) - 4.0  # centred: (0, ±1), orthogonal
    assert M.centered_cosine(p, t) == pytest.approx(0.0, abs=1e-12)
    assert M.centered_relative_error(p, t) == pytest.approx(np.sqrt(2.0))
    assert M.centered_norm_ratio(p, t) == pytest.approx(1.0)
    p2 = 2.0 * (t - 10.0) + 1.0  # twice the true centred cloud
    assert M.centered_cosine(p2, t) == pytest.approx(1.0)
    assert M.centered_relative_error(p2, t) == pytest.approx(1.0)
    assert M.centered_norm_ratio(p2, t) == pytest.approx(2.0)
    assert M.centered_cosine(-t, t) == pytest.approx(-1.0)
    assert M.centered_relative_error(-t, t) == pytest.approx(2.0)
    # ratio of means, not mean of ratios: true radii 1 and 3 (centred cloud (±1,0), (0,±3))
    t4 = np.array([[1.0, 0], [-1, 0], [0, 3], [0, -3]])
    p4 = t4 + np.array([[0, 1.0], [0, 1], [0, 1], [0, 1]]) * np.array([[1], [-1], [1], [-1]])
    # centred p4 - t4 = (0,±1) each, |err| = 1 each -> 4 / (1+1+3+3) = 0.5
    assert M.centered_relative_error(p4, t4) == pytest.approx(0.5)


def test_a_cloud_without_numbers_scores_nan_and_a_zero_one_zero():
    """A hybrid's layer of another mixer has NaN clouds (no attention output): its cosine is NaN, not 0 (a 0 would
    enter the cross-layer mean as a reading); a zero prediction still scores 0 (the convention for a zero vector)."""
    t = np.array([[1.0, 0.0], [-1.0, 0.0]])
    assert np.isnan(M.centered_cosine(np.full_like(t, np.nan), t)) and np.isnan(M.centered_cosine(t, t * np.nan))
    assert M.centered_cosine(np.zeros_like(t), t) == 0.0
    nan_layer = M.score_layers(np.stack([t, t * np.nan]), np.stack([t, t * np.nan]))
    assert nan_layer["cosine"][0] == pytest.approx(1.0) and np.isnan(nan_layer["cosine"][1])
    assert M.cross_layer_summary(nan_layer["cosine"])[0] == pytest.approx(1.0)  # the NaN layer left out


def test_rsa_hand_case():
    t = np.array([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0], [0.0, -1.0]])
    # pairs (01,02,03,12,13,23): cos = (0,-1,0,0,-1,0)
    p = t.copy()
    p[1], p[3] = [0.0, 2.0], [0.0, -2.0]  # scaling points keeps cosines -> rsa 1
    assert M.rsa(p, t) == pytest.approx(1.0)
    pr = t[[0, 2, 1, 3]]  # swap two points -> cosines (-1,0,0,0,0,-1) vs (0,-1,0,0,-1,0): r = -1/2 by hand
    assert M.rsa(pr, t) == pytest.approx(-0.5)


def test_score_layers_and_summary():
    t = np.stack([_cloud(seed=i) for i in range(3)])
    p = t + 0.1
    sc = M.score_layers(p, t)
    assert set(sc) == set(M.METRICS) and all(v.shape == (3,) for v in sc.values())
    np.testing.assert_allclose(sc["cosine"], 1.0)
    mean, se = M.cross_layer_summary(np.array([1.0, 2.0, 3.0]))
    assert mean == pytest.approx(2.0) and se == pytest.approx(1.0 / np.sqrt(3.0))
    mean, se = M.cross_layer_summary(np.array([9.0, 1.0, 2.0, 3.0]), layers=slice(1, None))
    assert mean == pytest.approx(2.0)
    summ = M.summarize_scores(sc)
    assert summ["cosine"][0] == pytest.approx(1.0)


def test_shape_mismatch_raises():
    with pytest.raises(ValueError):
        M.score_cloud(np.zeros((3, 2)), np.zeros((3, 3)))


# ------------------------------------------------------------------------------ diagnostics (App. D, H, K)
from mfpipe.experiments.rollout import diagnostics as D  # noqa: E402


def _occurrences(seed=0, n_types=5, d=6, offset=50.0):
    rng = np.random.default_rng(seed)
    counts = rng.integers(1, 9, size=n_types)
    counts[2] = 0  # an unseen type is dropped
    occ = [offset + rng.normal(size=d) * 3 + rng.normal(size=(c, d)) * rng.uniform(0.2, 2, size=d) for c in counts]
    return counts, occ


def test_clustering_metrics_match_brute_force():
    counts, occ = _occurrences()
    sums = np.stack([o.sum(0) if len(o) else np.zeros(6) for o in occ])[None]
    sq = np.stack([(o**2).sum(0) if len(o) else np.zeros(6) for o in occ])[None]
    got = D.clustering_metrics(counts, sums, sq)
    X = np.concatenate([o for o in occ if len(o)])
    lab = np.concatenate([[t] * len(o) for t, o in enumerate(occ) if len(o)])
    cent = {t: occ[t].mean(0) for t in set(lab)}
    within = np.stack([X[i] - cent[lab[i]] for i in range(len(X))])
    v_w, v_tot = (within**2).sum(1).mean(), ((X - X.mean(0)) ** 2).sum(1).mean()
    assert got["eta2"][0] == pytest.approx(1 - v_w / v_tot, rel=1e-9)
    w_d, s_d = (within**2).mean(0), X.var(0)
    assert got["eta2_z"][0] == pytest.approx(np.mean(1 - w_d / s_d), rel=1e-9)
    for t in range(5):
        if counts[t] == 0:
            assert np.isnan(got["rel_rms"][0, t])
        else:
            want = np.sqrt(((occ[t] - cent[t]) ** 2).sum(1).mean()) / np.linalg.norm(cent[t])
            assert got["rel_rms"][0, t] == pytest.approx(want, rel=1e-7)


def test_clustering_degenerate_input_layer():
    # every occurrence equals its centroid (RoPE model input): eta2 = eta2_z = 1, rel_rms = 0
    c = np.random.default_rng(0).normal(size=(4, 5))
    n = np.array([3, 1, 2, 5])
    got = D.clustering_metrics(n, c * n[:, None], c**2 * n[:, None])
    assert got["eta2"] == pytest.approx(1.0) and got["eta2_z"] == pytest.approx(1.0)
    np.testing.assert_allclose(got["rel_rms"], 0.0, atol=1e-7)


def test_anisotropy_hand_case():
    c = np.array([[[3.0, 1.0], [3.0, -1.0], [5.0, 1.0], [5.0, -1.0]]])  # cbar = (4, 0)
    a = D.anisotropy(c)
    assert a["norm_mean"][0] == pytest.approx(4.0)
    assert a["mean_dist"][0] == pytest.approx(np.sqrt(2.0))
    assert a["ratio"][0] == pytest.approx(np.sqrt(2.0) / 4.0)


def test_gap_diagnostics_on_tiny_model():
    """The MLP gap and both Jensen gaps against the HF modules of a tiny GPT-2, with per-type loops."""
    import torch
    from tiny_models import make_tiny_model

    from mfpipe.models.adapters import get_adapter

    model = make_tiny_model("gpt2")
    ad = get_adapter(model)
    blocks = model.transformer.h
    L, d, H = ad.n_layers, ad.d_model, ad.n_heads
    dh = d // H
    rng = np.random.default_rng(0)
    x = torch.as_tensor(rng.normal(size=(L, 3, 2, d)) * 2, dtype=torch.float32)  # 3 types x 2 occurrences
    cent = x.mean(2)

    def cos_rel(a, b):  # (1 - cos, ||a - b|| / ||b||) of two vectors
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        return 1 - a @ b / np.linalg.norm(a) / np.linalg.norm(b), np.linalg.norm(a - b) / np.linalg.norm(b)

    with torch.no_grad():
        mlp = lambda l, v: blocks[l].mlp(blocks[l].ln_2(v))  # noqa: E731  (GPT-2: the branch the residual gets)
        val = lambda l, v: blocks[l].attn.c_attn(blocks[l].ln_1(v))[..., 2 * d:].reshape(*v.shape[:-1], H, dh)  # noqa: E731
        # MLP gap: at the mean input vs the occurrence mean; one occurrence per type -> exact
        occ_mean = torch.stack([mlp(l, x[l]).mean(1) for l in range(L)])
        two = D.mlp_gap(ad, cent, occ_mean)
        for l in range(L):
            for t in range(3):
                np.testing.assert_allclose(two["at_mean"][l, t], mlp(l, cent[l, t]).numpy(), rtol=1e-5, atol=1e-6)
        want = M.score_layers(two["at_mean"], occ_mean.numpy())
        for m in M.METRICS:
            np.testing.assert_allclose(two[m], want[m], rtol=1e-6)
        assert (two["rel_error"] > 1e-4).all()
        one = D.mlp_gap(ad, x[:, :, 0], torch.stack([mlp(l, x[l, :, 0]) for l in range(L)]))
        np.testing.assert_allclose(one["cosine"], 1.0, atol=1e-6)
        np.testing.assert_allclose(one["rel_error"], 0.0, atol=1e-5)
        # Jensen gap of ln_1: E[ln_1 x] vs ln_1(c), per layer and type
        g = D.value_jensen_gap(ad, torch.stack([blocks[l].ln_1(x[l]).mean(1) for l in range(L)]), cent)
        # ... and of the values: mu_t (mean value over occurrences) vs v(c_t), per layer, head and type
        mu = torch.stack([val(l, x[l]).mean(1).transpose(0, 1) for l in range(L)])  # [L, H, N, dh]
        gm = D.value_jensen_gap_mu(ad, mu, cent)
        for l in range(L):
            for t in range(3):
                want_dir, want_rel = cos_rel(blocks[l].ln_1(x[l, t]).mean(0), blocks[l].ln_1(cent[l, t]))
                assert g["rel"][l, t] == pytest.approx(want_rel, rel=1e-4) and want_rel > 1e-3
                assert g["dir"][l, t] == pytest.approx(want_dir, rel=1e-3, abs=1e-7)
                for h in range(H):
                    want_dir, want_rel = cos_rel(val(l, x[l, t])[:, h].mean(0), val(l, cent[l, t])[h])
                    assert gm["rel"][l, h, t] == pytest.approx(want_rel, rel=1e-4)
                    assert gm["dir"][l, h, t] == pytest.approx(want_dir, rel=1e-3, abs=1e-7)
        g0 = D.value_jensen_gap_mu(ad, torch.stack([val(l, x[l, :, 0]).transpose(0, 1) for l in range(L)]), x[:, :, 0])
        np.testing.assert_allclose(g0["rel"], 0.0, atol=1e-5)
    s = D.gap_summary(np.array([[1.0, 2.0, 3.0, 4.0, 5.0]]))
    assert s["median"][0] == 3.0 and s["q25"][0] == 2.0 and s["q75"][0] == 4.0
    # the MLP reads the post-attention residual (sequential) or the block input (GPT-NeoX parallel residual)
    mid = cent.numpy() + 1
    np.testing.assert_array_equal(D.mlp_input_means(ad, cent, resid_mid_mean=mid), mid)
    neox = get_adapter(make_tiny_model("gpt_neox"))
    np.testing.assert_array_equal(D.mlp_input_means(neox, cent, resid_mid_mean=mid), cent.numpy())
