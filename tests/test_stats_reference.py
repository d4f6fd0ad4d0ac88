"""The statistics engine against a per-position brute-force reference, on tiny random models of all six
architectures.

The reference never touches the adapter: it reads the tensors through an independent path (the shared HF
reference in ``tests/hf_reference.py``: ``output_attentions`` / ``output_hidden_states`` and plain torch
forward hooks on the HF modules) and computes
every statistic with Python loops over windows, positions, keys and heads.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hf_reference import next_residuals
from stats_reference import BOS, finite_scale, reference_capture, tracked_for, zipf_windows
from tiny_models import (COMPOSITE_MODEL_TYPES, NEW_MODEL_TYPES, PLACED_MODEL_TYPES, TINY_MODEL_TYPES, VOCAB,
                         make_tiny_model)

from mfpipe.corpus.tracked import TrackedSet
from mfpipe.models.adapters import get_adapter
from mfpipe.stats import MeanFieldStats, accumulate_shard, finalize, merge_sums
from mfpipe.stats.errors import StatsError


# ------------------------------------------------------------------------------ brute-force statistics
def reference_stats(model, tokens: np.ndarray, tracked: TrackedSet, batch: int = 4) -> dict[str, np.ndarray]:
    """Brute force: Python loops over windows, positions, keys and heads."""
    N = tracked.n
    K = N + 2
    rank = {int(t): i for i, t in enumerate(tracked.type_ids)}

    def bucket(w, j):
        if j == 0:
            return N
        return rank.get(int(tokens[w, j]), N + 1)

    caps = []
    for s in range(0, tokens.shape[0], batch):
        caps.append(reference_capture(model, torch.as_tensor(tokens[s : s + batch].astype(np.int64))))
    cap = {k: np.concatenate([c[k] for c in caps], axis=1) for k in ("probs", "values", "reads", "resid", "attn_out", "mlp_out", "ln_in")}
    L, nW, H, Tn, _ = cap["probs"].shape
    d = cap["resid"].shape[-1]
    dh = cap["values"].shape[-1]

    P = np.zeros((L, H, N, K))
    nbar = np.zeros((N, K))
    C = np.zeros((N, K), dtype=np.int64)
    cooc = np.zeros((N, K), dtype=np.int64)
    qn = np.zeros(N, dtype=np.int64)
    kn = np.zeros(K, dtype=np.int64)
    pos = np.zeros(Tn, dtype=np.int64)
    members: dict[int, list[tuple[int, int]]] = {t: [] for t in range(K)}
    for w in range(nW):
        for j in range(Tn):
            b = bucket(w, j)
            kn[b] += 1
            members[b].append((w, j))
            if j == 0 or b >= N:
                continue
            s = b
            qn[s] += 1
            pos[j] += 1
            counts = np.zeros(K, dtype=np.int64)
            for k in range(j + 1):
                counts[bucket(w, k)] += 1
            for t in range(K):
                nbar[s, t] += counts[t]
                if counts[t] >= 1:
                    C[s, t] += 1
            for k in range(max(0, j - 5), min(Tn, j + 6)):
                if k != j:
                    cooc[s, bucket(w, k)] += 1
            for l in range(L):
                for h in range(H):
                    for k in range(j + 1):
                        P[l, h, s, bucket(w, k)] += cap["probs"][l, w, h, j, k]
    with np.errstate(invalid="ignore", divide="ignore"):
        P = P / qn[None, None, :, None]
        nbar = nbar / qn[:, None]

    def bucket_mean(arr_fn, shape):
        out = np.full((K,) + shape, np.nan)
        for t in range(K):
            if members[t]:
                out[t] = np.mean([arr_fn(w, j) for (w, j) in members[t]], axis=0)
        return out

    centroid = np.stack([bucket_mean(lambda w, j: cap["resid"][l, w, j], (d,)) for l in range(L + 1)])
    resid_var = np.stack(
        [
            np.stack(
                [
                    np.mean([(cap["resid"][l, w, j] - centroid[l, t]) ** 2 for (w, j) in members[t]], axis=0)
                    if members[t] else np.full(d, np.nan)
                    for t in range(K)
                ]
            )
            for l in range(L + 1)
        ]
    )
    mu = np.zeros((L, H, K, dh))
    zbar = np.zeros((L, H, K, dh))
    for l in range(L):
        for h in range(H):
            mu[l, h] = bucket_mean(lambda w, j: cap["values"][l, w, h, j], (dh,))
            zbar[l, h] = bucket_mean(lambda w, j: cap["reads"][l, w, j, h], (dh,))
    attn_out = np.stack([bucket_mean(lambda w, j: cap["attn_out"][l, w, j], (d,)) for l in range(L)])
    resid_mid = np.stack([bucket_mean(lambda w, j: cap["resid"][l, w, j] + cap["attn_out"][l, w, j], (d,)) for l in range(L)])
    mlp_out = np.stack([bucket_mean(lambda w, j: cap["mlp_out"][l, w, j], (d,)) for l in range(L)])
    ln_in = np.stack([bucket_mean(lambda w, j: cap["ln_in"][l, w, j], (d,)) for l in range(L)])
    return dict(
        P=P, nbar=nbar, context_count=C, cooc=cooc, query_count=qn, key_count=kn, position_count=pos,
        centroid=centroid, resid_var=resid_var, mu=mu, zbar=zbar, attn_out_mean=attn_out,
        resid_mid_mean=resid_mid, mlp_out_mean=mlp_out, ln_in_mean=ln_in, _cap=cap,
    )


def assert_close(name, got, want, rtol=1e-5):
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, f"{name}: shape {got.shape} != {want.shape}"
    assert np.array_equal(np.isnan(got), np.isnan(want)), f"{name}: NaN pattern differs"
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * finite_scale(want), equal_nan=True, err_msg=name)


# ------------------------------------------------------------------------------------------- tests
SINKS = ("mimo_v2_flash",)  # families whose probabilities leave out an attention sink in some layers


@pytest.fixture(scope="module")
def windows():
    return zipf_windows(6, seed=1)


@pytest.mark.parametrize("model_type", TINY_MODEL_TYPES + NEW_MODEL_TYPES + PLACED_MODEL_TYPES + COMPOSITE_MODEL_TYPES)
def test_every_statistic_matches_bruteforce(model_type, windows):
    model = make_tiny_model(model_type, seed=3)
    tracked = tracked_for(windows)
    ref = reference_stats(model, windows, tracked, batch=4)
    cap = ref["_cap"]

    # the independent capture is self-consistent (so it is a valid reference)
    np.testing.assert_allclose(
        np.einsum("lbhqk,lbhkd->lbqhd", cap["probs"], cap["values"]), cap["reads"], rtol=1e-4, atol=1e-5
    )
    nxt = next_residuals(model, cap["resid"][:-1], cap["attn_out"], cap["mlp_out"])  # post-norm: a norm of the sum
    np.testing.assert_allclose(nxt, cap["resid"][1:], rtol=1e-4, atol=1e-4)

    adapter = get_adapter(model)
    sums = accumulate_shard(model, adapter, windows, tracked, batch_size=4, device="cpu", progress=False)
    ds = finalize(sums, tracked, {"model": model_type}, dtype=np.float64)
    for name in ("P", "nbar", "context_count", "cooc", "query_count", "key_count", "position_count", "centroid",
                 "resid_var", "mu", "zbar", "attn_out_mean", "resid_mid_mean", "mlp_out_mean", "ln_in_mean"):
        # resid_var = E[x²] - c² loses a few digits to cancellation; measure it against the spread itself
        assert_close(name, ds[name].values, ref[name], rtol=1e-4 if name == "resid_var" else 1e-5)
    # rows of P sum to 1 over the K buckets, for every type that has queries; below 1 where a sink takes a share of
    # each row (Granite-SWA's: mfpipe.models.adapters.sinks) or in a layer whose heads also attend to a sink the
    # probabilities leave out (MiMo-V2-Flash's sliding-window layers)
    rows = ds["P"].sum("key").values
    if adapter.structure.attn_sink is not None:
        assert (rows > 0).all() and (rows < 1 - 1e-3).all()
    else:
        for l, layer in enumerate(model.base_model.layers if model_type in SINKS else ()):
            if getattr(layer.self_attn, "sinks", None) is not None:
                assert (rows[l] < 1 - 1e-3).all(), rows[l]
                rows[l] = 1.0
        np.testing.assert_allclose(rows, 1.0, atol=1e-5)
    # the BOS column is the BOS position's attention; nbar has exactly one BOS per prefix
    np.testing.assert_allclose(ds["nbar"].values[:, tracked.n], 1.0)
    assert int(ds["key_count"].values[tracked.n]) == windows.shape[0]
    assert ds.attrs["n_tokens"] == windows.size and ds.attrs["n_windows"] == windows.shape[0]


def test_zero_query_types_are_nan(windows):
    """A tracked type that never occurs has NaN rows (not 0, not inf)."""
    model = make_tiny_model("gpt2", seed=0)
    tracked = tracked_for(windows)
    absent = next(i for i in range(VOCAB) if i != BOS and i not in set(windows.ravel().tolist()))
    ts = TrackedSet(
        type_ids=np.concatenate([tracked.type_ids, [absent]]), strings=tracked.strings + ["absent"],
        counts=np.concatenate([tracked.counts, [0]]), bos_id=BOS, vocab_size=VOCAB,
    )
    sums = accumulate_shard(model, get_adapter(model), windows, ts, batch_size=8, device="cpu", progress=False)
    ds = finalize(sums, ts, {})
    s = ts.n - 1
    assert int(ds["query_count"][s]) == 0
    for name in ("P", "nbar"):
        assert np.isnan(ds[name].sel(query=s).values).all(), name
    for name in ("centroid", "mu", "zbar", "mlp_out_mean"):
        assert np.isnan(ds[name].sel(key=s).values).all(), name
    others = ds["P"].isel(query=slice(0, s)).values
    assert np.isfinite(others).all()
    # the key column of the absent type is exactly 0 (attention to a type that is never there)
    assert (ds["P"].sel(key=s).isel(query=slice(0, s)).values == 0).all()


def _derived_against_summed(model_type, without: str, approx: tuple[str, ...]):
    """(adapter, tracked set, selects seen) after comparing the default pass (every derivation its adapter allows)
    with one that sums ``without`` (``"attn_out_weights"``, ``"value_weights"`` or ``"mlp_out_from_resid"``: that
    derivation left out) itself:
    the sums in ``approx`` equal to float32 rounding (and not vacuous), every other sum bit for bit."""
    from mfpipe.stats.pass1 import Accumulator

    model = make_tiny_model(model_type, seed=7)  # gpt2: Conv1D c_attn, gpt_neox: per-head qkv, llama: GQA v_proj
    adapter = get_adapter(model)
    tokens = zipf_windows(8, seed=4)
    tracked = tracked_for(tokens)
    seen = []

    def summing(ad, n, T, device):
        derive = dict(value_weights=ad.value_weights, attn_out_weights=ad.attn_out_weights,
                      mlp_out_from_resid=ad.mlp_out_from_resid)
        del derive[without]
        acc = Accumulator(ad.n_layers, ad.n_heads, ad.d_model, ad.d_head, n, T, device=device,
                          attn_input_norm=ad.attn_input_norm, attn_input_norm_form=ad.attn_input_norm_form, **derive)
        seen.append(acc.select)
        return acc

    derived = accumulate_shard(model, adapter, tokens, tracked, batch_size=4, device="cpu", progress=False)
    summed = accumulate_shard(model, adapter, tokens, tracked, batch_size=4, device="cpu", progress=False,
                              reducer=summing)
    for k in summed:
        if k in approx:
            scale = np.abs(summed[k]).max()
            assert scale > 1e-2  # not vacuous
            np.testing.assert_allclose(derived[k], summed[k], rtol=1e-5, atol=1e-5 * scale, err_msg=k)
            assert not np.array_equal(derived[k], summed[k]), k  # another computation: the derivation ran
        else:
            assert np.array_equal(derived[k], summed[k], equal_nan=True), k
    return adapter, tracked, seen


@pytest.mark.parametrize("model_type", TINY_MODEL_TYPES)
def test_attn_out_sums_from_the_read_sums_equal_the_summed_attn_out(model_type):
    """Where no norm follows the output projection, pass 1 derives the attn_out sums from the read sums through
    the adapter's output projection (attn_out is affine in the reads) and does not read attn_out; summing the
    captured attn_out instead gives the same attn_out and resid_mid sums (to float32 rounding), every other sum bit for
    bit. Gemma-2 and OLMo-2 (a norm after the projection) sum attn_out itself."""
    from mfpipe.stats.pass1 import Accumulator

    has_form = model_type not in ("gemma2", "olmo2")
    adapter, tracked, seen = _derived_against_summed(
        model_type, "attn_out_weights", ("attn_out_sum", "resid_mid_sum", "mlp_out_sum") if has_form else ())
    assert "attn_out" in seen[0]
    assert (adapter.attn_out_weights(0) is not None) == has_form
    acc = Accumulator(adapter.n_layers, adapter.n_heads, adapter.d_model, adapter.d_head, tracked.n, 16,
                      attn_out_weights=adapter.attn_out_weights)
    assert ("attn_out" in acc.select) != has_form  # the capture reads attn_out only where it is not derived
    if has_form:
        wrong = lambda layer: (torch.zeros(adapter.n_heads, adapter.d_model, adapter.d_head), None)  # noqa: E731
        with pytest.raises(StatsError, match=r"attn_out_weights\(0\) gives W .* do not match its layout"):
            Accumulator(adapter.n_layers, adapter.n_heads, adapter.d_model, adapter.d_head, tracked.n, 16,
                        attn_out_weights=wrong)


@pytest.mark.parametrize("model_type", TINY_MODEL_TYPES)
def test_mlp_out_sums_from_the_residual_sums_equal_the_summed_mlp_out(model_type):
    """In a float32 model pass 1 derives the mlp_out sums from the residual and attn_out sums (a block adds attn_out +
    mlp_out to the residual, sequential and parallel blocks alike) and does not read the MLP's output; summing the
    captured mlp_out instead gives the same mlp_out sums (to float32 rounding at the residual's scale), every other
    sum bit for bit. A model that is not float32 reads it."""
    from mfpipe.stats.pass1 import Accumulator

    adapter, tracked, seen = _derived_against_summed(model_type, "mlp_out_from_resid", ("mlp_out_sum",))
    assert "mlp_out" in seen[0]
    assert adapter.mlp_out_from_resid
    acc = Accumulator(adapter.n_layers, adapter.n_heads, adapter.d_model, adapter.d_head, tracked.n, 16,
                      mlp_out_from_resid=True)
    assert "mlp_out" not in acc.select and "mlp_out" not in acc.pos  # neither read nor accumulated
    assert not get_adapter(make_tiny_model(model_type, seed=7).to(torch.bfloat16)).mlp_out_from_resid


@pytest.mark.parametrize("model_type", ["gpt2", "gpt_neox", "llama"])
def test_value_sums_from_the_norm_sums_equal_the_summed_values(model_type):
    """Pass 1 derives the per-head value sums from the ln1(x) sums through the adapter's value projection
    (values are affine in ln1(x)) and does not read the values; summing the captured values instead gives the same
    value sums (to float32 rounding: another order of operations), and every other sum bit for bit."""
    from mfpipe.stats.pass1 import Accumulator

    adapter, tracked, seen = _derived_against_summed(model_type, "value_weights", ("value_sum",))
    assert "values" in seen[0] and "resid_mid" not in seen[0]
    acc = Accumulator(adapter.n_layers, adapter.n_heads, adapter.d_model, adapter.d_head, tracked.n, 16,
                      attn_input_norm=adapter.attn_input_norm, value_weights=adapter.value_weights)
    assert "values" not in acc.select and "resid_mid" not in acc.select  # the capture never reads them
    with pytest.raises(ValueError, match="pass attn_input_norm too"):
        Accumulator(1, 1, 4, 4, 3, 8, value_weights=adapter.value_weights)
    fused = lambda layer: (torch.zeros(adapter.n_heads, 3 * adapter.d_model, adapter.d_head), None)  # noqa: E731
    with pytest.raises(StatsError, match=r"value_weights\(0\) gives W .* does not match its layout"):
        Accumulator(adapter.n_layers, adapter.n_heads, adapter.d_model, adapter.d_head, tracked.n, 16,
                    attn_input_norm=adapter.attn_input_norm, value_weights=fused)


@pytest.mark.parametrize("model_type", ["gpt2", "gemma2"])
def test_helper_thread_gives_the_same_sums_bit_for_bit(model_type, monkeypatch):
    """Pass 1 with its helper thread (each layer's reduction split between two threads: half the heads of the kernel,
    part of the per-position sums) gives exactly the sums of one thread: one pair chunk per batch with the kernel
    added once per batch, and many small chunks with each layer's kernel added as it comes. An error on the helper
    thread is raised by on_layer."""
    import threading

    import mfpipe.stats.pass1 as acc_mod
    from mfpipe.stats.pass1 import Accumulator
    from mfpipe.stats.workspace import HelperThread

    model = make_tiny_model(model_type, seed=8)
    adapter = get_adapter(model)
    tokens = zipf_windows(10, T=24, seed=9)
    tracked = tracked_for(tokens)
    made = []

    def reducer(helper, derive):
        def make(ad, n, T, device):
            # derive: attn_out and mlp_out from the read and residual sums, as the workflow runs it (gpt2: the helper's
            # half is then the residual alone)
            more = dict(attn_out_weights=ad.attn_out_weights, mlp_out_from_resid=ad.mlp_out_from_resid) if derive else {}
            acc = Accumulator(ad.n_layers, ad.n_heads, ad.d_model, ad.d_head, n, T, device=device,
                              attn_input_norm=ad.attn_input_norm, value_weights=ad.value_weights, helper_thread=helper,
                              **more)
            made.append(acc)
            return acc
        return make

    def run(helper, derive):
        return accumulate_shard(model, adapter, tokens, tracked, batch_size=5, device="cpu", progress=False,
                                reducer=reducer(helper, derive))

    monkeypatch.setattr(acc_mod, "HELPER_MIN_PROBS", 0)  # the tiny models' layers are far below it
    splits = []
    real_both = HelperThread.both
    monkeypatch.setattr(HelperThread, "both", lambda self, here, there: (splits.append(1), real_both(self, here, there)))
    for chunked, derive in ((False, False), (True, False), (False, True)):
        with monkeypatch.context() as mp:
            if chunked:
                mp.setattr(acc_mod, "PAIR_CHUNK", 37)
                mp.setattr(acc_mod, "DEFERRED_SUMS_MAX", 0)
            one = run(False, derive)
            assert not splits
            two = run(True, derive)
            assert len(splits) == 2 * model.config.num_hidden_layers  # every layer of both batches was split
            splits.clear()
        assert made[-2]._helper is None and made[-1]._helper is None  # the shard loop closed the helper
        assert ("mlp_out" in made[-1].select) != derive
        for k in one:
            assert np.array_equal(one[k], two[k], equal_nan=True), (chunked, derive, k)

    def broken(self, l, parts, scratch, ln_from=None):
        if threading.current_thread().name.startswith("mfpipe-reducer"):  # the helper thread's half
            raise StatsError("helper half failed")
        return real(self, l, parts, scratch, ln_from)

    real = Accumulator._position_sums
    monkeypatch.setattr(Accumulator, "_position_sums", broken)
    with pytest.raises(StatsError, match="helper half failed"):
        run(True, True)


def test_kernel_reductions_agree(monkeypatch):
    """One pair chunk per batch with the kernel added once per batch, and many small pair chunks (one window each)
    with each layer's kernel added as it comes, give the same sums."""
    import mfpipe.stats.pass1 as acc_mod

    model = make_tiny_model("qwen3", seed=4)
    adapter = get_adapter(model)
    tokens = zipf_windows(10, T=24, seed=6)
    tracked = tracked_for(tokens)
    flat = accumulate_shard(model, adapter, tokens, tracked, batch_size=5, device="cpu", progress=False)
    with monkeypatch.context() as mp:
        mp.setattr(acc_mod, "PAIR_CHUNK", 37)  # force many pair chunks …
        mp.setattr(acc_mod, "DEFERRED_SUMS_MAX", 0)  # … and per-layer adds into the kernel sum
        win = accumulate_shard(model, adapter, tokens, tracked, batch_size=5, device="cpu", progress=False)
    for k in flat:
        if np.issubdtype(np.asarray(flat[k]).dtype, np.integer):
            assert np.array_equal(flat[k], win[k]), k
        else:
            np.testing.assert_allclose(win[k], flat[k], rtol=1e-6, atol=1e-7, err_msg=k)


def test_one_shard_equals_four_shards():
    model = make_tiny_model("llama", seed=5)
    tokens = zipf_windows(16, seed=2)
    tracked = tracked_for(tokens)
    adapter = get_adapter(model)
    one = accumulate_shard(model, adapter, tokens, tracked, batch_size=2, device="cpu", progress=False)
    parts = [accumulate_shard(model, adapter, tokens[i : i + 4], tracked, batch_size=2, device="cpu", progress=False)
             for i in range(0, 16, 4)]
    merged = merge_sums(parts)
    for k in one:
        if np.issubdtype(np.asarray(one[k]).dtype, np.integer):
            assert np.array_equal(one[k], merged[k]), k
        else:
            np.testing.assert_allclose(merged[k], one[k], rtol=1e-6, atol=1e-9, err_msg=k)
    a = finalize(one, tracked, {"model": "m"})
    b = finalize(merged, tracked, {"model": "m"})
    for name in a.data_vars:
        np.testing.assert_allclose(a[name].values, b[name].values, rtol=1e-6, atol=1e-7, err_msg=name)
    assert a.attrs == b.attrs


def test_expected_normalizer_is_near_one():
    """App. ccmf-analysis, Table `tab:ahat-empirical-bias`: E_s[N_X] = E_s[sum_t n_t(X) W_st] with the C >= 20 mask.

    Brute force over contexts; it equals sum of P_st over the unmasked support (exactly, by the definition
    W = P / nbar), is exactly 1 without the mask, and within a few percent of 1 with it."""
    model = make_tiny_model("gpt2", seed=7)
    tokens = zipf_windows(600, T=32, seed=3)
    tracked = tracked_for(tokens)
    sums = accumulate_shard(model, get_adapter(model), tokens, tracked, batch_size=100, device="cpu", progress=False)
    ds = finalize(sums, tracked, {}, dtype=np.float64)
    P, C = ds["P"].values, ds["context_count"].values
    N, K = tracked.n, tracked.n + 2
    rank = {int(t): i for i, t in enumerate(tracked.type_ids)}
    for min_count in (0, 20):
        keep = C >= max(min_count, 1)
        W = MeanFieldStats(ds).W(min_count=min_count).values  # the API's W, applied to brute-force context counts
        EN = np.zeros(W.shape[:3])
        for w in range(tokens.shape[0]):
            counts = np.zeros(K)
            counts[N] = 1
            for j in range(1, tokens.shape[1]):
                b = rank.get(int(tokens[w, j]), N + 1)
                counts[b] += 1
                if b < N:
                    EN[:, :, b] += W[:, :, b, :] @ counts  # N_X for this context, every head
        EN /= ds["query_count"].values[None, None, :]
        # W must be P over the TRUE mean counts on the kept support (nbar checked against brute force elsewhere)
        closed = np.where(keep[None, None], P, 0.0).sum(-1)
        np.testing.assert_allclose(EN, closed, rtol=1e-9)
        assert (W[:, :, ~keep] == 0).all()  # masked pairs carry no weight
        if min_count == 0:
            np.testing.assert_allclose(EN, 1.0, rtol=1e-5)  # rows of P sum to 1: N_X averages to exactly 1
        else:
            assert (~keep).any()  # the mask is not vacuous on this corpus …
            assert (EN <= 1 + 1e-6).all()
            assert abs(EN.mean() - 1.0) < 0.05, EN.mean()  # … and E_s[N_X] stays within a few percent of 1
