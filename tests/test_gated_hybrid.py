"""Issue 59 items 3 and 5: hybrids whose attention layers gate their output (mfpipe.models.adapters.gate). Two tiny
hybrids, each with another mixer at layers 0 and 2 and attention at 1 and 3 whose reads enter the output projection
times a sigmoid gate of the position's input: Qwen3-Next (gated delta-nets; the gate is each head's second half of the
query projection, one per read entry, read before the values) and LFM-3 (short convolutions; ``g_proj``, one gate per
head, read after the values; post-norms on both branches); and Laguna, no hybrid, whose gate is a softplus of
``g_proj``, one per head (a dense first MLP, then mixtures of experts). Each is placed with its layer kinds and its
gate; its
statistics equal per-position loops over the model's own forward (HF's ``output_attentions`` /
``output_hidden_states`` and plain torch hooks on modules named here by hand), the reads being probabilities x values
(not the gated projection input); its own reads written back leave the logits bit-identical; mean-field reads written
back equal a torch hook that puts them, times the forward's own gate, at the output projection's input; the rollout
with each type reading only itself is the model's own forward of each type as a sequence of one token (the gate taken
of the centroid). The gated families pass every conformance check."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from layer_loops import assert_store_equals_loops, loop_means, mean_field_patch
from stats_reference import BOS, VOCAB, tracked_for, zipf_windows

from mfpipe.models.adapters import describe, get_adapter
from mfpipe.models.tiny import random_model

H, KV, DH, D = 4, 2, 16, 64
# per family, written by hand: its layer kinds, the gate's source and layout (n, chunks, offset) and activation (a
# sigmoid where none is named), whether it runs before the values, the attention-input norm, and the modules whose
# outputs are the attention and MLP branches
SPECS = {
    "qwen3_next": dict(kinds=("gated_delta_net", "attention") * 2, gate="q_proj", layout=(H * DH, H, DH), first=True,
                       norm="input_layernorm", attn_out="self_attn", mlp_out="mlp"),
    "lfm3": dict(kinds=("convolution", "attention") * 2, gate="g_proj", layout=(H, 1, 0), first=False,
                 norm="operator_norm", attn_out="post_operator_norm", mlp_out="post_ffn_norm"),
    "laguna": dict(kinds=("attention",) * 4, gate="g_proj", layout=(H, 1, 0), first=False, act="softplus",
                   norm="input_layernorm", attn_out="self_attn", mlp_out="mlp"),
}


def _attention(family: str) -> tuple[int, ...]:
    return tuple(l for l, k in enumerate(SPECS[family]["kinds"]) if k == "attention")


def tiny_gated(family: str, seed: int = 3):
    from transformers import LagunaConfig, Lfm3Config, Qwen3NextConfig

    common = dict(vocab_size=VOCAB, hidden_size=D, intermediate_size=128, num_hidden_layers=4, num_attention_heads=H,
                  num_key_value_heads=KV, head_dim=DH, max_position_embeddings=128, bos_token_id=BOS,
                  eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    if family == "qwen3_next":
        cfg = Qwen3NextConfig(layer_types=["linear_attention", "full_attention"] * 2, linear_conv_kernel_dim=4,
                              linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                              linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                              shared_expert_intermediate_size=32, **common)
    elif family == "laguna":  # layer 0's MLP dense, the others' 4 experts (2 per token) and a shared one
        cfg = LagunaConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                           shared_expert_intermediate_size=32, **common)
    else:  # a full and a sliding attention layer (window 8 of the 16 positions)
        cfg = Lfm3Config(layer_types=["conv", "full_attention", "conv", "sliding_attention"], sliding_window=8,
                         conv_L_cache=3, **common)
    cfg._attn_implementation = "eager"
    return random_model(cfg, seed=seed)


@pytest.fixture(scope="module", params=sorted(SPECS))
def gated(request):
    return request.param, tiny_gated(request.param)


def _gate(family: str, out: torch.Tensor) -> torch.Tensor:
    """The gate [..., H, dh] of the source's output, written here by hand: Qwen3-Next's per head the second half of its
    2 x dh query outputs; LFM-3's one per head, spread over the head's read; Laguna's so, through a softplus."""
    if family == "qwen3_next":
        return torch.sigmoid(out.view(*out.shape[:-1], H, 2 * DH)[..., DH:])
    if family == "laguna":
        return torch.nn.functional.softplus(out.float())[..., None].expand(*out.shape, DH)
    return torch.sigmoid(out)[..., None].expand(*out.shape, DH)


def _hooked_forward(family, model, ids):
    """The model's own forward with plain torch hooks: per attention layer the probabilities, values, reads (P x V),
    gate, the output projection's input, attention and MLP branches (None at a layer of another mixer); the hidden
    states."""
    spec, layers = SPECS[family], model.model.layers
    got: dict[tuple[str, int], torch.Tensor] = {}
    handles = []

    def keep(key, l):
        return lambda m, i, o: got.__setitem__((key, l), o[0] if isinstance(o, tuple) else o)

    for l, block in enumerate(layers):
        if not hasattr(block, "self_attn"):
            continue
        a = block.self_attn
        handles += [getattr(a, spec["gate"]).register_forward_hook(keep("g", l)),
                    a.v_proj.register_forward_hook(keep("v", l)),
                    a.o_proj.register_forward_pre_hook(lambda m, i, l=l: got.__setitem__(("z", l), i[0])),
                    getattr(block, spec["attn_out"]).register_forward_hook(keep("a", l)),
                    getattr(block, spec["mlp_out"]).register_forward_hook(keep("m", l))]
    try:
        with torch.no_grad():
            out = model(ids, output_attentions=True, output_hidden_states=True, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    att = iter(a for a in out.attentions if a is not None)  # the attention layers' only
    B, T = ids.shape
    per = []
    for l in range(len(layers)):
        if ("v", l) not in got:
            per.append(None)
            continue
        probs = next(att).double()
        v = got[("v", l)].view(B, T, KV, DH).repeat_interleave(H // KV, dim=2).double()  # [B,T,H,dh]
        per.append(dict(probs=probs, values=v, reads=torch.einsum("bhqk,bkhd->bqhd", probs, v),
                        gate=_gate(family, got[("g", l)]).double(), z=got[("z", l)].view(B, T, H, DH).double(),
                        attn_out=got[("a", l)].double(), mlp_out=got[("m", l)].double()))
    return per, [h.double() for h in out.hidden_states]


def _loops(family, model, tokens, tracked, L):
    """Per-position loops (tests/layer_loops.py) over the hooked forward; NaN at the layers of another mixer."""
    per, hidden = _hooked_forward(family, model, torch.as_tensor(tokens.astype(np.int64)))
    return loop_means(per, hidden, tokens, tracked, L, H, DH, D)


def test_a_gated_hybrid_is_placed_with_its_gate(gated):
    family, model = gated
    spec, s = SPECS[family], describe(model)
    assert (s.layer_kinds or ("attention",) * 4) == spec["kinds"] and s.attn == "self_attn"
    assert s.value_source == "self_attn.v_proj"
    # the gate's source, slice and activation, and whether it runs before the values (the site reads in forward order)
    assert (s.output_gate, s.gate_layout, s.gate_first, s.gate_act) == (
        f"self_attn.{spec['gate']}", spec["layout"], spec["first"], spec.get("act", "sigmoid"))
    ad = get_adapter(model)
    assert ad.attention_layers == _attention(family) and ad.attn_out_weights(1) is None
    x = torch.randn(5, D, generator=torch.Generator().manual_seed(0))
    block = model.model.layers[1]
    with torch.no_grad():
        out = getattr(block.self_attn, spec["gate"])(getattr(block, spec["norm"])(x[None]))
    # the rollout's gate of a row: the forward's of a position (to float32 rounding: the rows here batched otherwise)
    assert float((ad.read_gate(1, x) - _gate(family, out)[0]).abs().max()) <= 1e-6


def test_reads_are_probabilities_times_values_and_the_gate_is_the_models(gated):
    family, model = gated
    ids = torch.as_tensor(zipf_windows(2, seed=5).astype(np.int64))
    per, _ = _hooked_forward(family, model, ids)
    caps = []
    get_adapter(model).capture(ids, caps.append)
    for l in _attention(family):
        p = per[l]
        # the reference's own premise: the projection reads the reads times the gate (else this test means nothing)
        assert float((p["z"] - p["reads"] * p["gate"]).abs().max()) < 1e-6
        assert float((caps[l].reads.double() - p["reads"]).abs().max()) < 1e-5
        assert float((caps[l].reads.double() - p["z"]).abs().max()) > 1e-2  # not the gated input


def test_statistics_equal_the_loops_on_a_gated_hybrid(gated):
    from mfpipe.stats import accumulate_shard, finalize

    family, model = gated
    tokens = zipf_windows(6, seed=1)
    tracked = tracked_for(tokens)
    ad = get_adapter(model)
    sums = accumulate_shard(model, ad, tokens, tracked, batch_size=4, device="cpu", progress=False)
    ds = finalize(sums, tracked, {"model": f"tiny-{family}", "layer_kinds": list(ad.layer_kinds)}, dtype=np.float64)
    ref = _loops(family, model, tokens, tracked, 4)
    assert tuple(ds["layer_kind"].values) == SPECS[family]["kinds"]
    assert_store_equals_loops(ds, ref, 4)


def test_substitution_writes_reads_through_the_models_own_gate(gated, tmp_path):

    family, model = gated
    ad = get_adapter(model)
    tokens = zipf_windows(8, seed=1)
    tracked = tracked_for(tokens)
    ids = torch.as_tensor(tokens.astype(np.int64))
    with torch.no_grad():
        want = model(ids, use_cache=False).logits
    got = ad.run(ids, patch_reads=lambda layer, reads: reads, logits=True)
    assert torch.equal(got.logits, want)  # own reads written back: the logits bit-identical
    zhat, sub, replace = mean_field_patch(model, ad, tokens, tracked, family, tmp_path)
    assert int(sub.sum()) > 10

    got = ad.run(ids, patch_reads=replace, logits=True).logits
    gates, handles = {}, []
    for l in _attention(family):
        a = model.model.layers[l].self_attn
        handles += [getattr(a, SPECS[family]["gate"]).register_forward_hook(
                        lambda m, i, o, l=l: gates.__setitem__(l, _gate(family, o))),
                    a.o_proj.register_forward_pre_hook(lambda m, i, l=l: (torch.where(
                        sub[..., None, None], zhat[l] * gates[l], i[0].view(*i[0].shape[:2], H, DH)).flatten(-2),))]
    try:
        with torch.no_grad():
            ref = model(ids, use_cache=False).logits
    finally:
        for h in handles:
            h.remove()
    assert float((got - ref).abs().max()) <= 1e-5 and float((got - want).abs().max()) > 1e-4


def test_the_rollout_gates_each_centroids_read_by_its_own_residual(gated):
    from mfpipe.experiments.rollout.algorithm import bos_residuals, rollout

    family, model = gated
    ad = get_adapter(model)
    types = torch.tensor([3, 5, 7, 11])
    with torch.no_grad():  # each type as a sequence of one token: it attends to itself alone
        hidden = model(types[:, None], output_hidden_states=True, use_cache=False).hidden_states
    K = np.full((4, H, 4, 6), np.nan)
    attn = list(_attention(family))
    K[attn] = 0.0
    for s in range(4):
        K[attn, :, s, s] = 1.0  # each type reads its own column: the one-token forward's attention
    got = torch.as_tensor(rollout(ad, K, bos_residuals(ad, BOS), type_ids=types.numpy()))
    for l in range(4):  # the residual entering each block (transformers' last hidden state is after the final norm)
        want = hidden[l][:, 0]
        assert float((got[l] - want).abs().max()) <= 1e-5 * max(1.0, float(want.abs().max())), l
    final = ad.final_norm(got[4])
    assert float((final - hidden[4][:, 0]).abs().max()) <= 1e-5 * max(1.0, float(hidden[4].abs().max()))


# Qwen3.5's text model and its composites are Qwen3-Next's attention; Ling's (bailing_hybrid) is latent attention with
# one gate per head; LARA-mini's attention has no gate (placed as a hybrid of gated delta-nets)
@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_text", "qwen3_5_moe", "lfm3", "bailing_hybrid",
                                    "lara_mini", "laguna", "axk2"])
def test_gated_families_pass_every_conformance_check(family):
    from mfpipe.models.census import census_row

    row = census_row(family)
    assert row.accepted, row


def test_a_gate_of_a_latent_of_the_input_is_the_forwards_own_at_every_position():
    """AXK-2's gate is a slice of q_gate_proj, which reads the query latent (q_a_layernorm(q_a_proj(x)) beside
    q_a_proj(x)), not the attention's input: the placement finds it there (the gates at offset 48 of each head's 80
    outputs), and the gate the rollout takes of a residual row (read_gate: the block's own code on the row, read off
    q_gate_proj) is the forward's own at every position of a sequence, to float32 rounding; so is the gate read_gate
    takes from inside a traced forward (the function vectors' cue gates, the J-lens agreement's head writes), where
    the block's code runs as plain torch calls (calls.untraced: nnsight's trace failed on it, stop 72's CI)."""
    from mfpipe.experiments.fv.heads import cue_reads
    from mfpipe.experiments.fv.prompts import FVPrompt
    from mfpipe.jlens.agreement import decode_vectors
    from mfpipe.models.defaults import default_config
    from mfpipe.models.tiny import shrink_config

    model = random_model(shrink_config(default_config("axk2")), seed=3)
    ad = get_adapter(model)
    s = ad.structure
    assert s.output_gate.endswith("q_gate_proj") and s.gate_act == "sigmoid" and not s.gate_direct, s
    n, chunks, offset = s.gate_layout
    assert n == ad.n_heads * ad.d_head and chunks == ad.n_heads and offset > 0, s.gate_layout
    got = {}
    handles = []
    for l in ad.attention_layers:
        src = ad.block_module(l).get_submodule(s.output_gate)
        handles.append(src.register_forward_hook(lambda m, i, o, l=l: got.__setitem__(("g", l), o)))
    caps = []
    ids = torch.randint(0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))
    try:
        ad.capture(ids, caps.append)
    finally:
        for h in handles:
            h.remove()
    # first from inside a trace, on a fresh adapter (nothing of its one-token calls kept from a call outside one)
    reads = cue_reads(ad, [FVPrompt(tokens=w.numpy(), answer=1, pair=i) for i, w in enumerate(ids)], batch_size=2)
    for l in ad.attention_layers:
        out = got[("g", l)]  # [B, T, H x (qk + dv)]: each head's query, then its gate
        want = torch.sigmoid(out.view(*out.shape[:-1], ad.n_heads, -1)[..., offset:offset + ad.d_head].float())
        torch.testing.assert_close(reads.g[:, l], want[:, -1], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ad.read_gate(l, caps[l].resid_in), want, rtol=1e-5, atol=1e-6)
    decoded = decode_vectors(ad, ids.numpy(), n_decode=4, seed=0, batch_size=2)
    assert all(torch.isfinite(v).all() for v in decoded.values())
