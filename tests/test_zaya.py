"""Issue 59: Zaya, placed since stop 80 (its refusal named its embedding, its delayed values and its router state).
A tiny Zaya (tests/tiny_models.tiny_zaya): the embedding enters as ``(e + b) * s`` by the base model's own vectors
(mfpipe.models.adapters.residual.affine_candidates); its CCA projection returns the values, the first half of its KV heads
the current position's and the second half the previous position's (adapters.returned); its blocks scale both terms
of each residual sum (a join of their own, run by the block: adapters.joins) and hand the next block their router
state, which the next router adds to its own (adapters.calls.with_carried: carried along the rows a run visits layer
by layer). Every conformance check (statistics and value means against per-position loops over HF's own attention
and hidden states, the mean-field write-back against a torch hook, the pieces rebuilding each next residual, the
router state carried) passes; the rollout and its accounting run with the state carried, and a block run without it
is refused by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from stats_reference import BOS, tracked_for, zipf_windows
from tiny_models import VOCAB, tiny_zaya

from mfpipe.models.adapters import get_adapter


@pytest.fixture(scope="module")
def zaya():
    return tiny_zaya(vocab_size=VOCAB, bos_token_id=BOS, eos_token_id=None, pad_token_id=None)


def test_zaya_is_placed_by_what_its_modules_do_and_passes_every_conformance_check(zaya):
    from mfpipe.conformance import check_model
    from mfpipe.models.adapters.calls import carried_state

    ad = get_adapter(zaya)
    s = ad.structure
    assert s.embed_affine == ("input_hidden_states_bias", "input_hidden_states_scale")
    assert s.value_source == "self_attn.qkv_proj#2" and s.join == "model" and ad.value_weights(0) is None
    assert carried_state(ad) == (0, 1)  # block l + 1's first argument after the residual is block l's output [1]
    rows = check_model(zaya)
    assert len(rows) >= 15 and all(r.ok for r in rows), [r for r in rows if not r.ok]
    # the embedding as the model's forward hands it to block 0
    ids = torch.as_tensor(zipf_windows(2, seed=4)[:, :9].astype(np.int64))
    with torch.no_grad():
        h0 = zaya(ids, output_hidden_states=True, use_cache=False).hidden_states[0]
    torch.testing.assert_close(ad.embed(ids).float(), h0.float(), rtol=0, atol=1e-6)
    assert not torch.allclose(zaya.model.embed_tokens(ids), h0)  # the affine map is live (random b and s)


def test_a_16_bit_zaya_reads_its_embedding_map_too():
    """In bfloat16 the model's rounding would let ``e`` alone, or ``e * s``, pass for ``(e + b) * s`` with ``s`` near
    1 and ``b`` small: the probe takes the closest form that fits, the pair, exact in the model's dtype."""
    import copy

    model = copy.deepcopy(tiny_zaya(vocab_size=VOCAB, bos_token_id=BOS, eos_token_id=None, pad_token_id=None))
    model = model.to(torch.bfloat16)
    with torch.no_grad():
        model.model.input_hidden_states_bias.normal_(0, 0.01, generator=torch.Generator().manual_seed(0))
    ad = get_adapter(model)
    assert ad.structure.embed_affine == ("input_hidden_states_bias", "input_hidden_states_scale")
    ids = torch.tensor([[BOS, 3, 5, 7, 9]])
    with torch.no_grad():
        h0 = model(ids, output_hidden_states=True, use_cache=False).hidden_states[0]
    assert torch.equal(ad.embed(ids).float(), h0.float())


def test_the_delayed_values_and_the_router_state(zaya):
    """On sequences the value map is the model's; on rows (a rollout's: each a sequence of one position) a delayed
    head reads what the model's first position reads (no earlier position). A block after the first run without the
    router state its predecessor hands on is refused by name; with it carried along the layers, the block outputs on
    the true residuals are the model's (the conformance check above, rebuilt here on another model's rows)."""
    from mfpipe.models.adapters.joins import run_block

    ad = get_adapter(zaya)
    ids = torch.as_tensor(zipf_windows(2, seed=4)[:, :9].astype(np.int64))
    with torch.no_grad():
        hid = zaya(ids, output_hidden_states=True, use_cache=False).hidden_states
    x = hid[1].float()
    seq = ad.value_map(1, x)  # [B, T, H, dh]
    rows = ad.value_map(1, x.reshape(-1, x.shape[-1])).reshape(seq.shape)
    KV, H = ad.n_kv_heads, ad.n_heads
    current, delayed = slice(0, H // 2), slice(H // 2, H)  # KV heads 0 | 1, each expanded to H / KV query heads
    assert KV == 2
    torch.testing.assert_close(rows[:, :, current], seq[:, :, current], rtol=0, atol=1e-6)
    torch.testing.assert_close(rows[:, 0, delayed], seq[:, 0, delayed], rtol=0, atol=1e-6)
    assert not torch.allclose(rows[:, 1:, delayed], seq[:, 1:, delayed])  # the sequence's read the previous position
    branch = torch.zeros_like(x.reshape(-1, x.shape[-1]))
    with pytest.raises(ValueError, match="router state"):
        run_block(ad, 1, x.reshape(-1, x.shape[-1]), branch)
    carry: dict = {}
    run_block(ad, 0, hid[0].float().reshape(-1, x.shape[-1]), branch, carry=carry)
    assert carry["state"].shape[0] == x.shape[0] * x.shape[1]
    run_block(ad, 1, x.reshape(-1, x.shape[-1]), branch, carry=carry)


def test_the_rollout_and_its_accounting_carry_the_router_state(zaya):
    """The rollout (Alg. 1), the teacher-forced error accounting and the divergence step table run on Zaya with each
    trajectory's own router state, and give finite readings."""
    from mfpipe.experiments.rollout import accounting as AC
    from mfpipe.experiments.rollout import algorithm as R
    from mfpipe.experiments.rollout import divergence as DV
    from mfpipe.experiments.rollout import runs as RO
    from mfpipe.stats import MeanFieldStats, accumulate_shard, finalize

    ad = get_adapter(zaya)
    tokens = zipf_windows(6, seed=1)
    tracked = tracked_for(tokens)
    sums = accumulate_shard(zaya, ad, tokens, tracked, batch_size=3, device="cpu", progress=False)
    st = MeanFieldStats(finalize(sums, tracked, {"model": "tiny-zaya", "revision": "r", "half": "stats"},
                                 dtype=np.float64))
    setup = RO.prepare(ad, st, st)
    rolled = R.rollout(ad, setup.P, setup.bos, init=setup.init)
    assert rolled.shape[0] == ad.n_layers + 1 and np.isfinite(rolled).all()
    ed = AC.error_decomposition_table(ad, setup)
    assert np.isfinite(ed[ed.metric == "cosine"].value).all()
    rolled, true = DV.trajectories(ad, setup, setup.P)
    steps = DV.step_table(ad, setup.P, setup.bos, rolled, true, setup.types)
    assert np.isfinite(steps["tf_cosine"]).all()
    curv = DV.curvature_table(ad, setup.P, setup.bos, rolled, true, setup.types, alphas=(0.5,))
    assert np.isfinite(curv["err_in_rel"]).all()
