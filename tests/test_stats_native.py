"""Pass 1's two CPU engines give the same sums bit for bit: the torch ops (every device) and the compiled loops of
mfpipe.stats.native (CPU with numba, the default there). The brute-force tests (tests/test_stats_reference.py) run
the default engine; this ties the torch form, which GPUs run, to it exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from stats_reference import tracked_for, zipf_windows
from tiny_models import TINY_MODEL_TYPES, make_tiny_model

import mfpipe.stats.pass1 as pass1
from mfpipe.models.adapters import get_adapter
from mfpipe.stats import accumulate_shard, native
from mfpipe.stats.errors import StatsError

pytestmark = pytest.mark.skipif(not native.available(), reason="numba is not installed")


# the sums made from the attention-input norm, which the native engine normalises itself where the adapter gives
# the norm's form: equal to the torch engine's to float32 rounding (the rest: bit for bit)
NORM_SUMS = ("ln_in_sum", "value_sum")


def _sums(model, adapter, tokens, tracked, engine, helper=False, norm_form=True):
    def make(ad, n, T, device):
        acc = pass1.Accumulator(ad.n_layers, ad.n_heads, ad.d_model, ad.d_head, n, T, device=device,
                                attn_input_norm=ad.attn_input_norm, value_weights=ad.value_weights,
                                helper_thread=helper, engine=engine,
                                attn_input_norm_form=ad.attn_input_norm_form if norm_form else None,
                                attn_out_weights=ad.attn_out_weights, mlp_out_from_resid=ad.mlp_out_from_resid)
        # every tiny model has a form
        assert (getattr(acc._engine, "norm_forms", None) is not None) == (engine == "native" and norm_form)
        return acc

    return accumulate_shard(model, adapter, tokens, tracked, batch_size=5, device="cpu", progress=False, reducer=make)


@pytest.mark.parametrize("model_type", TINY_MODEL_TYPES)
def test_native_engine_gives_the_torch_sums_bit_for_bit(model_type, monkeypatch):
    """Every sum of every architecture, identical: one pair chunk per batch with the kernel added once per batch,
    and small chunks with each layer's kernel added as it comes (and, there, the cell-indexed compaction table and
    the helper thread's split)."""
    model = make_tiny_model(model_type, seed=11)
    adapter = get_adapter(model)
    tokens = zipf_windows(12, T=20, seed=5)
    tracked = tracked_for(tokens)
    for variant in ("plain", "chunked"):
        with monkeypatch.context() as mp:
            if variant == "chunked":
                mp.setattr(pass1, "PAIR_CHUNK", 300)  # groups of one or two windows
                mp.setattr(pass1, "DEFERRED_SUMS_MAX", 0)
                mp.setattr(pass1, "RANK_TABLE_MAX", 4)
                mp.setattr(pass1, "HELPER_MIN_PROBS", 0)
            ref = _sums(model, adapter, tokens, tracked, "torch")
            got = _sums(model, adapter, tokens, tracked, "native", helper=variant == "chunked")
        assert ref.keys() == got.keys()
        assert ref["P_sum"].any() and ref["nbar_sum"].any() and ref["cooc"].any()  # not vacuous
        for k in ref:
            assert ref[k].dtype == got[k].dtype, (variant, k)
            if k in NORM_SUMS:  # the native engine sums the norm's normalised rows itself (NormForm)
                scale = np.abs(ref[k]).max()
                np.testing.assert_allclose(got[k], ref[k], rtol=2e-6, atol=2e-6 * scale, err_msg=f"{variant} {k}")
                continue
            assert np.array_equal(ref[k], got[k], equal_nan=True), (variant, k)
        if variant == "plain":  # through the norm module, the native engine's norm sums are the torch engine's too
            got = _sums(model, adapter, tokens, tracked, "native", norm_form=False)
            for k in NORM_SUMS:
                assert np.array_equal(ref[k], got[k], equal_nan=True), k


def test_engine_choice():
    assert pass1.Accumulator(1, 1, 4, 4, 3, 8).engine == "native"  # the default on CPU
    assert pass1.Accumulator(1, 1, 4, 4, 3, 8, engine="torch").engine == "torch"
    with pytest.raises(ValueError, match="engine must be"):
        pass1.Accumulator(1, 1, 4, 4, 3, 8, engine="numba")
    with pytest.raises(StatsError, match="runs on CPU"):
        pass1.Accumulator(1, 1, 4, 4, 3, 8, device="meta", engine="native")



@pytest.mark.parametrize("deferred", [True, False])
def test_kernel_head_blocks_sum_each_head_in_pair_order(deferred, monkeypatch):
    """The kernel's head blocks (widths 8, 4, 2, 1) against float32 sums in pair order by np.add.at, for head ranges
    that need every width and start anywhere (the helper thread's halves): into the batch sums, and into P."""
    if not deferred:
        monkeypatch.setattr(pass1, "DEFERRED_SUMS_MAX", 0)
    rng = np.random.default_rng(3)
    B, H, T, N = 3, 15, 7, 4
    acc = pass1.Accumulator(2, H, 8, 4, N, T, engine="native")
    kb = rng.integers(0, N + 2, size=(B, T))
    qt = np.where(kb < N, kb, -1)
    acc.begin_batch(kb, qt)
    plan, eng = acc._plan, acc._engine
    pairs = plan.pairs
    p4 = rng.random((B, H, T, T), dtype=np.float32)
    # the pairs of each group in the plan's order, and their values of every head
    b_, j_, k_ = zip(*[(b, j, k) for b in range(B) for j in range(T) if qt[b, j] >= 0 for k in range(j + 1)])
    vals = p4[np.array(b_), :, np.array(j_), np.array(k_)]  # [M, H]
    assert len(pairs.m_off) == 2 and pairs.m_off[1] == len(b_)  # one group: the whole batch
    ref = np.zeros((len(pairs.cells), H), np.float32)
    np.add.at(ref, pairs.pinv[: len(b_)], vals)
    for heads in (range(0, 15), range(3, 12), range(7, 8), range(9, 15)):
        l = 1
        eng.kernel_heads(plan, l, torch.from_numpy(p4).reshape(-1), heads, acc._scratch)
        cols = slice(l * H + heads.start, l * H + heads.stop)
        if deferred:
            got = pairs.sums[:, cols]
        else:
            got = eng.arrays["P"][pairs.cells, cols]
            eng.arrays["P"][:] = 0
        assert np.array_equal(got, ref[:, heads.start : heads.stop]), heads


def test_norm_forms_are_checked_against_the_module():
    """A form is used only where it reproduces the norm module on the probe: the adapters' forms of all six
    architectures pass; a wrong scale (Gemma-2's 1 + w taken as w), a wrong kind or eps, a norm of another width,
    a norm module without a form and a model that is not float32 give None (the pass then calls the module)."""
    import dataclasses

    import torch

    for model_type in TINY_MODEL_TYPES:
        ad = get_adapter(make_tiny_model(model_type, seed=2))
        forms = native.checked_norm_forms(ad.attn_input_norm_form, ad.attn_input_norm, ad.n_layers, ad.d_model)
        assert forms is not None and len(forms) == ad.n_layers, model_type
        form = ad.attn_input_norm_form(0)
        if form.kind == "identity":
            continue
        with torch.no_grad():  # random, not the initial ones / zeros: a wrong form must show
            for l in range(ad.n_layers):
                m = ad._sub(l, ad.ATTN_NORM)
                m.weight.normal_()
                if getattr(m, "bias", None) is not None:
                    m.bias.normal_()
        good = native.checked_norm_forms(ad.attn_input_norm_form, ad.attn_input_norm, ad.n_layers, ad.d_model)
        assert good is not None, model_type
        wrong = {"kind": "rms" if form.kind == "layer" else "layer"}
        for change in (wrong, {"eps": 0.5}, {"eps": form.eps * 10}, {"scale": ad.attn_input_norm_form(0).scale * 1.01}):
            bad = native.checked_norm_forms(lambda l, c=change: dataclasses.replace(ad.attn_input_norm_form(l), **c),
                                            ad.attn_input_norm, ad.n_layers, ad.d_model)
            assert bad is None, (model_type, change)
    gemma = get_adapter(make_tiny_model("gemma2", seed=2))
    with torch.no_grad():
        for l in range(gemma.n_layers):
            gemma._sub(l, gemma.ATTN_NORM).weight.normal_()
    as_llama = native.checked_norm_forms(lambda l: dataclasses.replace(
        gemma.attn_input_norm_form(l), scale=gemma._sub(l, gemma.ATTN_NORM).weight), gemma.attn_input_norm,
        gemma.n_layers, gemma.d_model)
    assert as_llama is None
    assert native.checked_norm_forms(lambda l: None, gemma.attn_input_norm, gemma.n_layers, gemma.d_model) is None
    half = get_adapter(make_tiny_model("llama", seed=2).to(torch.bfloat16))
    assert half.attn_input_norm_form(0) is None


def test_counts_of_batches_that_never_end_reach_the_sums():
    """The native engine adds a batch's nbar / C parts at end_batch; batches that are only begun (model-free counts,
    tests/synthetic_stats.py) still have them in sums(), equal to the torch engine's (which adds them at once)."""
    from mfpipe.stats.buckets import window_buckets

    tokens = zipf_windows(9, T=20, seed=8)
    tracked = tracked_for(tokens)
    kb, qt = window_buckets(tokens, tracked.key_bucket_lut(), tracked.query_bucket_lut(), tracked.n)
    got = {}
    for engine in ("torch", "native"):
        acc = pass1.Accumulator(1, 1, 4, 4, tracked.n, 20, engine=engine)
        for b0 in range(0, 9, 4):
            acc.begin_batch(kb[b0 : b0 + 4], qt[b0 : b0 + 4])
        got[engine] = acc.sums()
    for k in ("nbar_sum", "context_count", "cooc", "query_count", "key_count", "position_count"):
        assert got["torch"][k].any(), k
        assert np.array_equal(got["torch"][k], got["native"][k]), k


def test_sums_taken_before_a_batch_ends_do_not_count_it_twice():
    """sums() adds the counts of a batch that is begun and not ended (complete_counts); when that batch then ends, its
    end_batch adds only its kernel sums: the final counts equal the torch engine's, which adds them at begin_batch."""
    from mfpipe.stats.buckets import window_buckets

    model = make_tiny_model("gpt2", seed=3)
    adapter = get_adapter(model)
    tokens = zipf_windows(4, T=20, seed=6)
    tracked = tracked_for(tokens)
    kb, qt = window_buckets(tokens, tracked.key_bucket_lut(), tracked.query_bucket_lut(), tracked.n)
    got = {}
    for engine in ("torch", "native"):
        acc = pass1.Accumulator(adapter.n_layers, adapter.n_heads, adapter.d_model, adapter.d_head, tracked.n, 20,
                                engine=engine)
        acc.begin_batch(kb, qt)
        acc.sums()  # mid-batch
        adapter.run(tokens, select=acc.select, on_layer=acc.on_layer, on_final=acc.on_final)
        acc.end_batch()
        got[engine] = {k: np.array(v) for k, v in acc.sums().items()}
    for k in ("nbar_sum", "context_count", "cooc", "P_sum"):
        assert got["torch"][k].any(), k
        assert np.array_equal(got["torch"][k], got["native"][k]), k


def test_deferred_cooc_half_equals_the_direct_count_whatever_the_order_of_batches():
    """The native plan leaves cooc's forward half of tracked columns to one symmetrization when the sums are read
    (a key of tracked type t after a type-s query is a type-t query with a key of bucket s before it, where a query's
    type is its key bucket and every tracked key is a query). A batch where that does not hold (a query type other
    than its key bucket, a tracked key that is not a query) ends the deferral mid-shard, and so does sums() taken
    between batches; the counts equal the torch engine's, which counts both halves directly, in every order."""
    from mfpipe.stats.buckets import window_buckets

    tokens = zipf_windows(12, T=20, seed=12)
    tracked = tracked_for(tokens)
    n = tracked.n
    kb, qt = window_buckets(tokens, tracked.key_bucket_lut(), tracked.query_bucket_lut(), n)
    odd = qt.copy()  # queries of another type than their key bucket
    odd[qt >= 0] = (qt[qt >= 0] + 1) % n
    assert (odd != qt).any()
    unasked = qt.copy()  # tracked keys that are not queries (a tracked type that is not a query type)
    unasked[qt == 0] = -1
    assert (unasked != qt).any()
    batches = {"same": [(kb[i : i + 3], qt[i : i + 3]) for i in range(0, 12, 3)]}
    batches["odd after same"] = batches["same"][:2] + [(kb[6:9], odd[6:9])] + batches["same"][3:]
    batches["odd first"] = [(kb[0:3], odd[0:3])] + batches["same"][1:]
    batches["unasked after same"] = batches["same"][:2] + [(kb[6:9], unasked[6:9])] + batches["same"][3:]
    for name, seq in batches.items():
        for sums_between in (False, True):
            got = {}
            for engine in ("torch", "native"):
                acc = pass1.Accumulator(1, 1, 4, 4, n, 20, engine=engine)
                for i, (k, q) in enumerate(seq):
                    acc.begin_batch(k, q)
                    if sums_between and i == 1:
                        acc.sums()
                got[engine] = acc.sums()
            assert got["torch"]["cooc"].any()
            for k in ("cooc", "nbar_sum", "context_count"):
                assert np.array_equal(got["torch"][k], got["native"][k]), (name, sums_between, k)
    acc = pass1.Accumulator(1, 1, 4, 4, n, 20, engine="native")
    acc.begin_batch(kb, qt)
    assert acc._engine.cooc_deferred[0] == 1  # window_buckets' batches defer it
    acc.sums()
    assert acc._engine.cooc_deferred[0] == 0
