"""Pass 1's two CPU engines give the same sums bit for bit: the torch ops (every device) and the compiled loops of
mfpipe.stats.native (CPU with numba, the default there). The brute-force tests (tests/test_stats_reference.py) run
the default engine; this ties the torch form, which GPUs run, to it exactly."""

from __future__ import annotations

import numpy as np
import pytest
from test_stats_reference import tracked_for, zipf_windows
from tiny_models import TINY_MODEL_TYPES, make_tiny_model

import mfpipe.stats.pass1 as pass1
from mfpipe.models.adapters import get_adapter
from mfpipe.stats import accumulate_shard, native
from mfpipe.stats.errors import StatsError

pytestmark = pytest.mark.skipif(not native.available(), reason="numba is not installed")


def _sums(model, adapter, tokens, tracked, engine, helper=False):
    def make(ad, n, T, device):
        return pass1.Accumulator(ad.n_layers, ad.n_heads, ad.d_model, ad.d_head, n, T, device=device,
                                 attn_input_norm=ad.attn_input_norm, value_weights=ad.value_weights,
                                 helper_thread=helper, engine=engine)

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
            assert np.array_equal(ref[k], got[k], equal_nan=True), (variant, k)


def test_engine_choice():
    assert pass1.Accumulator(1, 1, 4, 4, 3, 8).engine == "native"  # the default on CPU
    assert pass1.Accumulator(1, 1, 4, 4, 3, 8, engine="torch").engine == "torch"
    with pytest.raises(ValueError, match="engine must be"):
        pass1.Accumulator(1, 1, 4, 4, 3, 8, engine="numba")
    with pytest.raises(StatsError, match="runs on CPU"):
        pass1.Accumulator(1, 1, 4, 4, 3, 8, device="meta", engine="native")

