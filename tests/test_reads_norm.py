"""Issue 59: an attention that norms every head's reads together before its output projection (BitNet's
``attn_sub_norm``, an RMS norm over all H x dh reads of a position: mfpipe.models.adapters.normed). On a tiny BitNet,
against plain torch hooks on modules named here by hand: the model is placed with the norm; the site's reads are
probabilities x values (the norm's input), not the projection's input; the statistics equal per-position loops over
the model's own forward; own reads written back leave the logits bit-identical, and mean-field reads written back equal
a torch pre-hook that puts them at the norm's input (the model's own norm then computed of them); the rollout with each
type reading only itself is the model's own forward of each type as a sequence of one token (the factor taken of the
rollout's reads). Its quantized form (the released checkpoints' AutoBitLinear, which quantizes its input to 8 bits) is
refused, naming its layers (and at planning: tests/test_preflight.py). The other paths from a read to the residual:
tests/test_gated_paths.py (its BitNet case)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from layer_loops import assert_store_equals_loops, loop_means, mean_field_patch
from stats_reference import BOS, VOCAB, tracked_for, zipf_windows

from mfpipe.models.adapters import describe, get_adapter
from mfpipe.models.tiny import random_model

H, KV, DH, D, L = 4, 2, 16, 64, 3


@pytest.fixture(scope="module")
def bitnet():
    from transformers import BitNetConfig

    cfg = BitNetConfig(vocab_size=VOCAB, hidden_size=D, intermediate_size=128, num_hidden_layers=L,
                       num_attention_heads=H, num_key_value_heads=KV, max_position_embeddings=128, bos_token_id=BOS,
                       eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    cfg._attn_implementation = "eager"
    model = random_model(cfg, seed=3)
    with torch.no_grad():  # the norm's weights away from 1: its factor is no plain 1 / rms
        for block in model.model.layers:
            block.self_attn.attn_sub_norm.weight.uniform_(0.5, 2.0, generator=torch.Generator().manual_seed(9))
    return model


def _hooked_forward(model, ids):
    """Per layer the probabilities, values, reads (P x V), the norm's input and output, the attention and MLP branches
    from HF's outputs and plain torch hooks; the hidden states."""
    got, handles = {}, []

    def keep(key, l):
        return lambda m, i, o: got.__setitem__((key, l), o[0] if isinstance(o, tuple) else o)

    for l, block in enumerate(model.model.layers):
        a = block.self_attn
        handles += [a.v_proj.register_forward_hook(keep("v", l)),
                    a.attn_sub_norm.register_forward_hook(lambda m, i, o, l=l: got.update({("n_in", l): i[0],
                                                                                          ("n_out", l): o})),
                    a.register_forward_hook(keep("a", l)), block.mlp.register_forward_hook(keep("m", l))]
    try:
        with torch.no_grad():
            out = model(ids, output_attentions=True, output_hidden_states=True, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    B, T = ids.shape
    per = []
    for l in range(L):
        probs = out.attentions[l].double()
        v = got["v", l].view(B, T, KV, DH).repeat_interleave(H // KV, dim=2).double()
        per.append(dict(probs=probs, values=v, reads=torch.einsum("bhqk,bkhd->bqhd", probs, v),
                        norm_in=got["n_in", l].view(B, T, H, DH).double(),
                        norm_out=got["n_out", l].view(B, T, H, DH).double(),
                        attn_out=got["a", l].double(), mlp_out=got["m", l].double()))
    return per, [h.double() for h in out.hidden_states]


def test_the_norm_of_the_reads_is_placed_and_the_reads_are_its_input(bitnet):
    s = describe(bitnet)
    assert s.reads_norm == "self_attn.attn_sub_norm" and s.output_gate is None and s.value_source == "self_attn.v_proj"
    ad = get_adapter(bitnet)
    assert ad.attn_out_weights(0) is None  # attn_out is no affine map of the reads: summed as read
    ids = torch.as_tensor(zipf_windows(2, seed=5).astype(np.int64))
    per, _ = _hooked_forward(bitnet, ids)
    caps = []
    ad.capture(ids, caps.append)
    for l in range(L):
        p = per[l]
        assert float((p["norm_in"] - p["reads"]).abs().max()) < 1e-5  # the reference's premise
        assert float((caps[l].reads.double() - p["reads"]).abs().max()) < 1e-5
        assert float((caps[l].reads.double() - p["norm_out"]).abs().max()) > 1e-2  # not the normed input
        # the factor of a position's reads: the norm's own output, every head's read times it
        g = ad.read_gate(l, None, caps[l].reads).double()
        assert float((caps[l].reads.double() * g - p["norm_out"]).abs().max()) < 1e-5
    with pytest.raises(ValueError, match="norms every head's reads together"):
        ad.read_gate(0, caps[0].resid_in)


def test_statistics_equal_the_loops(bitnet):
    from mfpipe.stats import accumulate_shard, finalize

    tokens = zipf_windows(6, seed=1)
    tracked = tracked_for(tokens)
    ad = get_adapter(bitnet)
    sums = accumulate_shard(bitnet, ad, tokens, tracked, batch_size=4, device="cpu", progress=False)
    ds = finalize(sums, tracked, {"model": "tiny-bitnet"}, dtype=np.float64)
    per, hidden = _hooked_forward(bitnet, torch.as_tensor(tokens.astype(np.int64)))
    assert_store_equals_loops(ds, loop_means(per, hidden, tokens, tracked, L, H, DH, D), L)


def test_substitution_writes_the_reads_before_the_models_own_norm(bitnet, tmp_path):
    ad = get_adapter(bitnet)
    tokens = zipf_windows(8, seed=1)
    ids = torch.as_tensor(tokens.astype(np.int64))
    with torch.no_grad():
        want = bitnet(ids, use_cache=False).logits
    assert torch.equal(ad.run(ids, patch_reads=lambda layer, reads: reads, logits=True).logits, want)
    zhat, sub, replace = mean_field_patch(bitnet, ad, tokens, tracked_for(tokens), "bitnet", tmp_path)
    assert int(sub.sum()) > 10
    got = ad.run(ids, patch_reads=replace, logits=True).logits
    handles = [block.self_attn.attn_sub_norm.register_forward_pre_hook(lambda m, i, l=l: (torch.where(
        sub[..., None, None], zhat[l], i[0].view(*i[0].shape[:2], H, DH)).flatten(-2),))
        for l, block in enumerate(bitnet.model.layers)]
    try:
        with torch.no_grad():
            ref = bitnet(ids, use_cache=False).logits
    finally:
        for h in handles:
            h.remove()
    assert float((got - ref).abs().max()) <= 1e-5 and float((got - want).abs().max()) > 1e-4


def test_the_rollout_takes_the_factor_of_its_own_reads(bitnet):
    from mfpipe.experiments.rollout.algorithm import bos_residuals, rollout

    ad = get_adapter(bitnet)
    types = torch.tensor([3, 5, 7, 11])
    with torch.no_grad():  # each type as a sequence of one token: it attends to itself alone
        hidden = bitnet(types[:, None], output_hidden_states=True, use_cache=False).hidden_states
    K = np.zeros((L, H, 4, 6))
    for s in range(4):
        K[:, :, s, s] = 1.0  # each type reads its own column: the one-token forward's attention
    got = torch.as_tensor(rollout(ad, K, bos_residuals(ad, BOS), type_ids=types.numpy()))
    for l in range(L):
        want = hidden[l][:, 0]
        assert float((got[l] - want).abs().max()) <= 1e-5 * max(1.0, float(want.abs().max())), l
    final = ad.final_norm(got[L])
    assert float((final - hidden[L][:, 0]).abs().max()) <= 1e-5 * max(1.0, float(hidden[L].abs().max()))


def test_quantized_projections_are_refused_naming_them(bitnet):
    """AutoBitLinear subclasses nn.Linear with a forward of its own (its input quantized to 8 bits): its output in the
    probe forward is no linear map of its weight, so the placement refuses it, naming it."""
    import copy

    from transformers.integrations.bitnet import AutoBitLinear

    from mfpipe.models.adapters import UnsupportedArchitectureError

    model = copy.deepcopy(bitnet)
    for block in model.model.layers:
        a = block.self_attn
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            lin = getattr(a, name)
            q = AutoBitLinear(lin.in_features, lin.out_features, bias=lin.bias is not None, online_quant=True)
            q.weight.data.copy_(lin.weight.data)
            setattr(a, name, q)
    x, o = torch.randn(3, D), model.model.layers[0].self_attn.o_proj
    assert not torch.allclose(o(x), x @ o.weight.T)  # (the test's premise: no linear map of its weight)
    with pytest.raises(UnsupportedArchitectureError, match=r"its projection self_attn.o_proj \(AutoBitLinear\) is not the linear "
                       r"map of its weight \(a quantized layer\); use a full-precision"):
        describe(model)
