import numpy as np
import pytest
import torch

from mfpipe.experiments.rollout import kernels as K

L, H, N = 3, 2, 6


def _P(seed=0, L=L, H=H, N=N):
    rng = np.random.default_rng(seed)
    return rng.dirichlet(np.ones(N + 2), size=(L, H, N))


def _C(seed=0):
    rng = np.random.default_rng(seed)
    c = rng.integers(0, 20, size=(N, N))
    c = c + c.T
    np.fill_diagonal(c, 0)
    return c


@pytest.mark.parametrize("name", [k for k in K.KERNEL_NAMES if k != "context_free_kernel"])
def test_kernels_row_stochastic(name):
    P = _P()
    Kr = K.build_kernel(name, P, cooc_counts=_C(), seed=3)
    assert Kr.shape == P.shape
    K.check_row_stochastic(Kr)


def test_check_row_stochastic_rejects():
    P = _P()
    P[0, 0, 0, 0] += 0.1
    with pytest.raises(ValueError):
        K.check_row_stochastic(P)
    with pytest.raises(ValueError):
        K.check_row_stochastic(np.zeros((2, 3)))


def test_meanq_uniform_hand_case():
    # L = H = 1, N = 2 (columns: t0, t1, <bos>, <other>)
    P = np.array([[[[0.2, 0.3, 0.4, 0.1], [0.5, 0.1, 0.2, 0.2]]]])
    avg = [0.35, 0.2, 0.3, 0.15]  # the mean of the two rows
    np.testing.assert_allclose(K.meanq(P)[0, 0], [avg, avg])
    w_avg = [(1 * 0.2 + 3 * 0.5) / 4, (1 * 0.3 + 3 * 0.1) / 4, (1 * 0.4 + 3 * 0.2) / 4, (1 * 0.1 + 3 * 0.2) / 4]
    np.testing.assert_allclose(K.meanq(P, weights=[1, 3])[0, 0], [w_avg, w_avg])
    # uniform: tracked budgets 0.5 and 0.6 spread over the N = 2 tracked types; <bos> / <other> kept
    np.testing.assert_allclose(K.uniform(P)[0, 0], [[0.25, 0.25, 0.4, 0.1], [0.3, 0.3, 0.2, 0.2]])
    with pytest.raises(ValueError):
        K.meanq(P, weights=[1, -1])


def test_rowshuffle_is_seeded_derangement_per_head():
    P = _P(2)
    a, b, c = K.rowshuffle(P, seed=5), K.rowshuffle(P, seed=5), K.rowshuffle(P, seed=6)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    perms = set()
    for l in range(L):
        for h in range(H):
            # each output row is some other row of the same (l, h)
            match = [(np.abs(P[l, h] - a[l, h, s]).sum(-1) < 1e-12).nonzero()[0] for s in range(N)]
            pi = np.array([m[0] for m in match])
            assert sorted(pi) == list(range(N)) and not (pi == np.arange(N)).any()
            perms.add(tuple(pi))
    assert len(perms) > 1  # independent permutations across heads / layers


def test_p0only_pavg_substitute():
    P = _P(3)
    p0 = K.p0only(P)
    for l in range(L):
        np.testing.assert_array_equal(p0[l], P[0])
    pa = K.pavg(P)
    np.testing.assert_allclose(pa[2, 1], P[:, 1].mean(0))
    sub = K.substitute_layers(P, pa, [0])
    np.testing.assert_array_equal(sub[0], pa[0])
    np.testing.assert_array_equal(sub[1:], P[1:])


def test_cooc_hand_case():
    P = np.array([[[[0.2, 0.3, 0.4, 0.1], [0.5, 0.1, 0.2, 0.2]]]])  # L=H=1, N=2: tracked mass 0.5, 0.6
    C = np.array([[0, 3], [1, 1]])
    Kc = K.cooc(P, C)
    np.testing.assert_allclose(Kc[0, 0, 0], [0.0, 0.5, 0.4, 0.1])
    np.testing.assert_allclose(Kc[0, 0, 1], [0.3, 0.3, 0.2, 0.2])
    # extra columns of C (e.g. [N, N+2] counts) are ignored; an empty row spreads uniformly
    Kc2 = K.cooc(P, np.array([[0, 0, 5, 5], [1, 1, 0, 0]]))
    np.testing.assert_allclose(Kc2[0, 0, 0], [0.25, 0.25, 0.4, 0.1])
    with pytest.raises(ValueError):
        K.cooc(P, np.array([[0, 0], [1, 1]]), empty_rows="raise")


def test_self_kernel():
    s = K.self_kernel(2, 3, 4)
    K.check_row_stochastic(s)
    assert s[1, 2, 3, 3] == 1.0


def test_context_free_kernel_on_tiny_model():
    from tiny_models import make_tiny_model

    model = make_tiny_model("llama")
    ids = np.array([5, 9, 17])
    cf = K.context_free_kernel(model, ids, bos_id=1, batch_size=2)
    cfg = model.config
    assert cf.shape == (cfg.num_hidden_layers, cfg.num_attention_heads, 3, 5)
    K.check_row_stochastic(cf, atol=1e-5)
    mask = np.zeros((3, 5), bool)
    mask[np.arange(3), np.arange(3)] = True
    mask[:, 3] = True
    assert (cf[..., ~mask] == 0).all()
    with torch.no_grad():
        att = model(torch.tensor([[1, 9]]), output_attentions=True).attentions
    np.testing.assert_allclose(cf[1, :, 1, 3], att[1][0, :, 1, 0].numpy(), atol=1e-6)
    np.testing.assert_allclose(cf[1, :, 1, 1], att[1][0, :, 1, 1].numpy(), atol=1e-6)


def test_probability_rounding_bounds_the_row_sums_of_a_bfloat16_softmax():
    """Rows of attention probabilities computed in bfloat16 (Gemma-2, Llama-3 presets) sum to 1 only to the format's
    rounding: within probability_rounding('bfloat16'), and beyond the float32 tolerance the rollout used before."""
    gen = torch.Generator().manual_seed(0)
    # a kernel's shape [..., N, N + 2]: 128 query types, 128 key types, BOS and <other>
    probs = torch.softmax(torch.randn(4, 128, 130, generator=gen).to(torch.bfloat16), dim=-1).double().numpy()
    dev = np.abs(probs.sum(-1) - 1).max()
    assert 1e-4 < dev <= K.probability_rounding("bfloat16")
    K.check_row_stochastic(probs, atol=1e-4 + K.probability_rounding("bfloat16"))
    with pytest.raises(ValueError, match="do not sum to 1"):
        K.check_row_stochastic(probs, atol=1e-4 + K.probability_rounding("float32"))


# ------------------------------------------------------------------------------- one layer at a time
@pytest.mark.parametrize("name", [k for k in K.KERNEL_NAMES if k != "context_free_kernel"] + ["meanq_weighted",
                                                                                                  "substituted"])
def test_a_layered_kernel_equals_the_whole_array_bit_for_bit(name):
    """Every kernel of a :class:`LayerKernel` P (the rollout jobs' store read one layer at a time) equals the
    whole-array kernel exactly, layer by layer and whole; the source is read one layer per access."""
    from mfpipe.experiments.rollout.layered import LayerKernel

    P = _P(seed=5, L=4, H=3, N=7)
    P[1, 2, 3] = np.nan  # a NaN row (a type with no query) stays where it was
    reads = []
    lazy = LayerKernel(P.shape, lambda l: reads.append(l) or P[l])
    w = np.random.default_rng(1).random(7)

    def build(P):
        if name == "meanq_weighted":
            return K.meanq(P, w)
        if name == "substituted":
            return K.substitute_layers(P, K.uniform(P), [1, -1])
        return K.build_kernel(name, P, cooc_counts=np.random.default_rng(2).integers(0, 9, (7, 9)), seed=3)

    want, got = build(P), build(lazy)
    assert isinstance(got, LayerKernel) and got.shape == want.shape
    for l in (2, 0, 3, 1):
        assert np.array_equal(got[l], want[l], equal_nan=True), l
    assert np.array_equal(np.asarray(got), want, equal_nan=True)
    assert all(0 <= l < 4 for l in reads)
    layer = got[0]
    layer[:] = -1.0  # a caller writing into its layer changes nothing the next access sees
    assert np.array_equal(got[0], want[0], equal_nan=True)


def _halves(model, ad, n: int | None = None) -> dict:
    """The statistics and evaluation halves' stores of ``model`` (Zipf windows, ``n`` tracked types: the default
    set where None), written to a temporary folder."""
    import pathlib
    import tempfile

    from stats_reference import tracked_for, zipf_windows

    from mfpipe.stats import accumulate_shard, finalize, write_store

    root, paths = pathlib.Path(tempfile.mkdtemp()), {}
    tracked = tracked_for(zipf_windows(24, seed=1), **({} if n is None else {"n": n}))
    for half, seed in (("stats", 1), ("eval", 2)):
        sums = accumulate_shard(model, ad, zipf_windows(24, seed=seed), tracked, batch_size=8, device="cpu",
                                progress=False)
        meta = {"model": "tiny", "revision": "r1", "half": half, "corpus": "z", "corpus_fingerprint": "f",
                "model_type": ad.model_type}
        paths[half] = write_store(finalize(sums, tracked, meta), root / f"{half}.zarr")
    return paths


def _rollout_peak(L: int, N: int, d: int) -> tuple[float, object]:
    """tracemalloc's peak bytes of run_rollouts (every default kernel) on a tiny Llama of ``L`` layers, width ``d``,
    at ``N`` tracked types, with the stores written before tracing starts."""
    import tracemalloc

    from mfpipe.experiments.rollout import runs as RO
    from mfpipe.models.adapters import get_adapter
    from mfpipe.models.tiny import make_tiny_model

    model = make_tiny_model("llama", seed=7, num_hidden_layers=L, hidden_size=d, intermediate_size=2 * d)
    ad = get_adapter(model)
    paths = _halves(model, ad, N)
    tracemalloc.start()
    try:
        RO.run_rollouts(model, ad, paths["stats"], paths["eval"], model_name="tiny", revision="r1")
        return tracemalloc.get_traced_memory()[1], ad
    finally:
        tracemalloc.stop()


def test_a_rollout_holds_its_kernel_one_layer_at_a_time_and_its_centroids_as_the_estimate_counts():
    """The rollout jobs' memory per layer (issue 58: at 3B-7B shape they held ~4 float64 kernels, 21 GiB for
    Llama-3.2-3B): from 2 to 4 layers the peak grows by less than one layer's float64 kernel a layer (it held 3.6)
    where the kernel dominates, and by the estimate's centroid copies (mfpipe.estimate.calibrate.layer_arrays)
    within 25 % where the centroids dominate."""
    from mfpipe.estimate.calibrate import layer_arrays

    (a, ad), (b, _) = _rollout_peak(2, 120, 64), _rollout_peak(4, 120, 64)
    kernel_layer = ad.n_heads * 120 * 122 * 8
    assert b - a < 2 * kernel_layer, (a, b, kernel_layer)
    (a, ad), (b, _) = _rollout_peak(2, 30, 512), _rollout_peak(4, 30, 512)
    per = lambda n: layer_arrays(n, ad.n_heads, 30, ad.d_head, 1, ad.d_model)["rollout"]  # noqa: E731
    assert 0.75 * (per(4) - per(2)) <= b - a <= 1.25 * (per(4) - per(2)), (a, b, per(2), per(4))


def test_rows_below_one_are_allowed_only_in_a_sinks_layers():
    P = _P()
    P[1] *= 0.8  # layer 1's rows lose a sink's share
    with pytest.raises(ValueError, match="layer 1"):
        K.check_row_stochastic(P, below=[0])
    K.check_row_stochastic(P, below=[1])
    with pytest.raises(ValueError, match="layer 1"):  # never above 1
        K.check_row_stochastic(np.concatenate([P[:1], P[1:2] * 1.3, P[2:]]), below=[1])
    assert K.below_one("mean_field", [1], 3) == (1,) and K.below_one("Pavg", [1], 3) == (0, 1, 2)
    assert K.below_one("P0only", [1], 3) == () and K.below_one("P0only", [0], 3) == (0, 1, 2)
    assert K.below_one("P0only", [1], 3, first=1) == (0, 1, 2)  # a hybrid's: from its first attention layer
    K.check_row_stochastic(K.pavg(P), below=K.below_one("Pavg", [1], 3))


@pytest.mark.parametrize("model_type", ["granite_swa", "mimo_v2_flash"])
def test_the_rollout_of_a_model_with_attention_sinks_runs_every_kernel(model_type):
    """A sink takes a share of each row of P and adds no value (the rows sum below 1 where it does: the adapter's
    sink_layers): every kernel of Table 1 rolls out, the scores finite; the adapter names exactly those layers."""
    from mfpipe.experiments.rollout import runs as RO
    from mfpipe.models.adapters import get_adapter
    from mfpipe.models.tiny import make_tiny_model
    from mfpipe.stats import open_stats

    model = make_tiny_model(model_type, seed=7)
    ad = get_adapter(model)
    paths = _halves(model, ad)
    rows = open_stats(paths["stats"]).P().sum("key").values  # [L, H, N]
    short = tuple(l for l in range(ad.n_layers) if (rows[l] < 1 - 1e-3).all())
    assert short and ad.sink_layers() == short
    df = RO.run_rollouts(model, ad, paths["stats"], paths["eval"], model_name="tiny", revision="r1")
    assert set(df["kernel"]) == set(RO.DEFAULT_KERNELS) and np.isfinite(df["value"]).all()
