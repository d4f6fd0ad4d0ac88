"""Layer-localized kernel substitution (tab:qwen-layers) and the rogue-dimension tables (tab:rogue-dims,
tab:qwen-pinned), mfpipe.experiments.rollout.localized: an empty layer set is the plain rollout exactly, every layer
the substitute kernel's rollout exactly; the rogue ratios against a direct computation."""

from types import SimpleNamespace

import numpy as np
import pytest
from tiny_models import make_tiny_model

from mfpipe.experiments.rollout import algorithm as R
from mfpipe.experiments.rollout import kernels as K
from mfpipe.experiments.rollout import localized as LZ
from mfpipe.models.adapters import get_adapter

N = 6


def _setup(mt="llama", seed=0):
    a = get_adapter(make_tiny_model(mt, seed=2))
    L, H, d = a.n_layers, a.n_heads, a.d_model
    rng = np.random.default_rng(seed)
    P = rng.random((L, H, N, N + 2))
    P /= P.sum(-1, keepdims=True)
    init = rng.normal(size=(N, d)).astype(np.float32)
    bos = rng.normal(size=(L + 1, d)).astype(np.float32)
    truth = R.rollout(a, P, bos, init=init) + 0.1 * rng.normal(size=(L + 1, N, d))
    return a, SimpleNamespace(P=P, bos=bos, init=init, truth=truth, types=np.arange(N))


def test_empty_set_is_the_plain_rollout_and_all_layers_the_substitutes():
    a, s = _setup()
    S = K.meanq(s.P)
    preds = LZ.localized_rollouts(a, s, S, LZ.layer_sets(a.n_layers))
    assert np.array_equal(preds["none (measured kernel)"], R.rollout(a, s.P, s.bos, init=s.init))
    assert np.array_equal(preds[f"all {a.n_layers} layers"], R.rollout(a, S, s.bos, init=s.init))
    assert not np.array_equal(preds["layer 0 only"], preds["none (measured kernel)"])


def test_localized_table_damage_and_user_sets():
    a, s = _setup()
    df = LZ.localized_table(a, s, substitute="meanq", user_sets=[[-1]]).set_index("layers")
    assert df.loc["none (measured kernel)", "damage"] == 0.0
    total = df.loc[f"all {a.n_layers} layers", "damage"]
    # damage: the cosine given up against the measured kernel (the truth here is its rollout plus noise: substituting
    # every layer gives some up)
    np.testing.assert_allclose(df["damage"], df.loc["none (measured kernel)", "cosine"] - df["cosine"], rtol=0, atol=0)
    assert total > 0
    assert df.loc["layer 0 only", "damage_share"] == pytest.approx(df.loc["layer 0 only", "damage"] / total)
    assert df.loc[f"layers {a.n_layers - 1}", "substituted"] == str(a.n_layers - 1)
    with pytest.raises(ValueError, match="not a layer"):
        LZ.layer_sets(2, [[5]])


def test_rogue_table_ratios():
    rng = np.random.default_rng(1)
    c = rng.normal(size=(3, 50, 40))
    c[1, :, 7] *= 40.0  # one dimension far above the median at depth 1
    df = LZ.rogue_table(c, factor=15.0)
    assert df["dim"].tolist() == [7] and bool(df["pinned"].iloc[0]) and df["n_pinned"].iloc[0] == 1
    rms = np.sqrt((c**2).mean(1))
    assert df["ratio_depth1"].iloc[0] == pytest.approx(rms[1, 7] / np.median(rms[1]))
    none = LZ.rogue_table(rng.normal(size=(3, 50, 40)), factor=15.0, n_widest=3)
    assert len(none) == 3 and not none["pinned"].any() and (none["n_pinned"] == 0).all()
    assert none["max_ratio"].is_monotonic_decreasing
