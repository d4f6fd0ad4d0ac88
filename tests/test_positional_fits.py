"""App. positional's measures (issue 43) against slow references: posVar against a per-coordinate
``numpy.linalg.lstsq`` loop, the W_pos share of a known linear image of the code (1) and of a position-free Δ (≈ 0),
the principal-angle overlaps against ``scipy.linalg.subspace_angles``, the metric form in head space against the
residual-unit write, and the ridge decode against its shuffled baseline."""

from __future__ import annotations

import numpy as np
import pytest

from mfpipe.experiments.positional import fits as F

T, D, DH = 64, 32, 8


def _code(rng, T=T, d=D, rank=3, noise=0.0):
    """A smooth, low-rank position code W_pos [T, d] (as a learned table is: a few effective dimensions)."""
    basis = F.position_basis(np.arange(T), T)[:, :rank]
    return basis @ rng.normal(size=(rank, d)) + noise * rng.normal(size=(T, d))


def paper_basis(p, T):
    """The paper's 11 regressors of posVar (App. positional, "Positional fraction"), written out here rather than taken
    from the code under test: an intercept, p̃ = p / T, p̃², and sin / cos of 2πkp̃ for k = 1..4."""
    x = np.asarray(p, dtype=np.float64) / T
    return np.column_stack([np.ones_like(x), x, x ** 2,
                            np.sin(2 * np.pi * x), np.cos(2 * np.pi * x), np.sin(4 * np.pi * x), np.cos(4 * np.pi * x),
                            np.sin(6 * np.pi * x), np.cos(6 * np.pi * x), np.sin(8 * np.pi * x), np.cos(8 * np.pi * x)])


def _slow_share(Y, A):
    """The explained share, one coordinate at a time, of the regressors ``A`` (the intercept among them)."""
    num = den = 0.0
    for j in range(Y.shape[1]):
        beta, *_ = np.linalg.lstsq(A, Y[:, j], rcond=None)
        fit = A @ beta
        num += float(((fit - Y[:, j].mean()) ** 2).sum())
        den += float(((Y[:, j] - Y[:, j].mean()) ** 2).sum())
    return num / den


def test_posvar_equals_a_per_coordinate_lstsq_loop():
    rng = np.random.default_rng(0)
    p = rng.integers(8, T, size=500)
    delta = np.column_stack([np.sin(2 * np.pi * p / T), (p / T) ** 2]) @ rng.normal(size=(2, DH))
    delta += rng.normal(size=delta.shape)
    got = F.posvar(delta, p, T)
    assert got == pytest.approx(_slow_share(delta, paper_basis(p, T)), rel=1e-10)
    assert 0.05 < got < 0.95


def test_the_head_space_metric_gives_the_residual_units_share():
    """A fit in head space with G = O Oᵀ is the share of the residual-unit write Δ O (the map commutes with OLS)."""
    rng = np.random.default_rng(1)
    p = rng.integers(8, T, size=400)
    delta = np.outer(np.cos(2 * np.pi * p / T), rng.normal(size=DH)) + rng.normal(size=(400, DH))
    O = rng.normal(size=(DH, D))
    assert F.posvar(delta, p, T, G=O @ O.T) == pytest.approx(F.posvar(delta @ O, p, T), rel=1e-9)
    assert F.posvar(delta, p, T, G=O @ O.T) != pytest.approx(F.posvar(delta, p, T), rel=1e-3)


def test_a_linear_image_of_the_code_has_share_one_and_a_position_free_write_none():
    rng = np.random.default_rng(2)
    W = _code(rng)
    kept = np.arange(8, T)
    p = rng.choice(kept, size=800)
    image = W[p] @ rng.normal(size=(D, DH))
    assert F.wpos_share(image, p, W, kept, k=10) == pytest.approx(1.0, abs=1e-9)
    assert F.posvar(image, p, T) > 0.98  # a smooth code: the position function explains its image
    # a code of full rank with a few dominant dimensions: its top ten components hold nearly all of the image
    Wn = _code(rng, noise=0.01)
    assert F.wpos_share(Wn[p] @ rng.normal(size=(D, DH)), p, Wn, kept, k=10) > 0.999
    free = rng.normal(size=(800, DH))
    assert F.wpos_share(free, p, W, kept, k=10) < 0.03 and F.posvar(free, p, T) < 0.03
    r2, shuffled = F.ridge_decode(image, p, alpha=1e-3)
    assert r2 > 0.9 and abs(shuffled) < 0.1
    r2_free, _ = F.ridge_decode(free, p)
    assert r2_free < 0.05


def test_principal_overlaps_equal_scipys_subspace_angles():
    from scipy.linalg import subspace_angles

    rng = np.random.default_rng(3)
    for a, b in ((2, 2), (2, 5), (3, 1)):
        A, B = rng.normal(size=(D, a)), rng.normal(size=(D, b))
        ref = float(np.mean(np.cos(subspace_angles(A, B)) ** 2))
        assert F.principal_overlap(A, B) == pytest.approx(ref, abs=1e-12)
    A = rng.normal(size=(D, 3))
    assert F.principal_overlap(A, A @ rng.normal(size=(3, 3))) == pytest.approx(1.0)
    # random subspaces sit near the chance level max(a, b) / d
    d = 400
    draws = [F.principal_overlap(rng.normal(size=(d, 2)), rng.normal(size=(d, 2))) for _ in range(200)]
    assert np.mean(draws) == pytest.approx(F.chance_overlap(2, 2, d), rel=0.25)


def test_spans_leading_shares_and_participation():
    rng = np.random.default_rng(4)
    basis = np.linalg.qr(rng.normal(size=(D, 2)))[0]
    V = rng.normal(size=(300, 2)) @ basis.T
    assert F.share_in_span(V, basis) == pytest.approx(1.0)
    assert F.leading_share(V, 2) == pytest.approx(1.0) and F.leading_share(V, 1) < 1.0
    assert F.principal_overlap(F.subspace(V, 2), basis) == pytest.approx(1.0)
    iso = rng.normal(size=(5000, 4)) @ np.eye(4, D)
    assert F.participation_ratio(iso) == pytest.approx(4.0, rel=0.05)


def test_offset_features_one_hot_and_bins():
    o = np.array([0, 1, 7, 8, 15, 16, 40, 300])
    X = F.offset_features(o, small=8, bins=(16, 32))
    assert X.shape == (8, 8 + 3) and (X.sum(1) == 1).all()
    assert X[0, 0] == 1 and X[2, 7] == 1 and X[3, 8] == 1 and X[4, 8] == 1 and X[5, 9] == 1 and X[7, 10] == 1
