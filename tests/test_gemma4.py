"""Gemma-4 (issue 59 §1): its values are a scale-less RMS norm of each head's value projection (``v_norm``), its full
layers' heads twice as wide as its sliding ones (per-layer forms, mfpipe.models.adapters.layers), their values with
``attention_k_eq_v`` the norm of the keys' projection, and each block multiplies its output by ``layer_scalar`` (a
buffer, 1 at initialisation). The tiny copies below pass every conformance row with and without ``k_eq_v`` and with
``layer_scalar`` 0.7 and 1.3; the value norm and the scale are each checked against a reference written out here, and
dropping the scale from the structure fails the rebuild. What mfpipe does not place is refused saying so: the
per-layer input (PLE), the MoE block, layers that read another layer's keys and values, and the assistants (a
modelling refusal: every layer reads its target's keys and values)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers

from mfpipe.conformance import check_model
from mfpipe.models.adapters import UnsupportedArchitectureError, describe, get_adapter
from mfpipe.models.tiny import make_tiny_config, random_model

D, H, DH = 64, 4, 16


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    yield


def tiny(seed: int = 0, **overrides):
    """A tiny Gemma-4 text model (mfpipe.models.tiny's recipe: k_eq_v on its full layer 1) with ``overrides``."""
    torch.manual_seed(seed)
    return random_model(make_tiny_config("gemma4_text", **overrides), seed=seed)


def failed(model, structure=None) -> list:
    rows = check_model(model, structure or describe(model))
    assert len(rows) >= 15
    return [(r.name, r.error) for r in rows if not r.ok]


def rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x.double() ** 2).mean(-1, keepdim=True) + eps).to(x.dtype)


@pytest.mark.parametrize("k_eq_v", [True, False])
def test_the_values_are_the_norm_of_each_head_and_every_row_passes(k_eq_v):
    model = tiny(attention_k_eq_v=k_eq_v)
    s = describe(model)
    assert s.value_norm == "self_attn.v_norm" and s.resid_scale == "layer_scalar"
    full = "self_attn.k_proj" if k_eq_v else "self_attn.v_proj"
    assert [(f.head_dim, f.kv_heads, f.value_source) for f in s.layer_forms] == [
        (DH, 2, "self_attn.v_proj"), (2 * DH, 1 if k_eq_v else 2, full)]
    assert failed(model, s) == []
    adapter = get_adapter(model)
    assert adapter.d_head == 2 * DH and adapter.value_weights(0) is None  # no affine map: summed as read
    x = torch.randn(2, 5, D)
    for layer, form in enumerate(s.layer_forms):  # the norm by hand: each head's values over their rms, no scale
        block = model.model.layers[layer]
        h = block.input_layernorm(x)
        raw = dict(block.named_modules())[form.value_source](h).unflatten(-1, (form.kv_heads, form.head_dim))
        want = rms(raw, block.self_attn.v_norm.eps).repeat_interleave(H // form.kv_heads, dim=-2)
        got = adapter.value_map(layer, x)
        torch.testing.assert_close(got[..., : form.head_dim], want, rtol=1e-5, atol=1e-6)
        assert bool((got[..., form.head_dim:] == 0).all())  # padded coordinates (layer 0's 16 of 32)


def test_layer_scalar_multiplies_the_block_output():
    model = tiny(seed=1)
    with torch.no_grad():
        for layer, block in enumerate(model.model.layers):
            block.layer_scalar.fill_(0.7 + 0.6 * layer)
    adapter = get_adapter(model)
    assert not adapter.mlp_out_from_resid  # the residual gains s (resid_mid + mlp_out) - resid_in
    assert failed(model) == []
    # the scale by hand: the block's output is its input plus both branches, times layer_scalar
    ids = torch.randint(0, 100, (1, 7), generator=torch.Generator().manual_seed(2))
    caps = []
    adapter.capture(ids, caps.append)
    for layer, block in enumerate(model.model.layers):
        nxt = caps[layer + 1].resid_in if layer + 1 < len(caps) else None
        if nxt is not None:
            want = (caps[layer].resid_mid + caps[layer].mlp_out) * float(block.layer_scalar)
            torch.testing.assert_close(nxt, want, rtol=1e-5, atol=1e-5)
    # the rollout's block (each type a sequence of one token: each head reads its own value) is the model's own
    from mfpipe.experiments.rollout.algorithm import block_update

    caps, finals = [], []
    adapter.capture(torch.tensor([[3], [5], [7]]), caps.append, finals.append)
    nxt = [c.resid_in[:, 0] for c in caps[1:]] + [finals[0][:, 0]]
    for layer in range(adapter.n_layers):
        c = caps[layer].resid_in[:, 0]
        got = block_update(adapter, layer, c, adapter.value_map(layer, c))
        torch.testing.assert_close(got, nxt[layer], rtol=1e-5, atol=1e-5)
    # without the scale in the structure, the rebuilt blocks miss the forward's next residual
    plain = dataclasses.replace(describe(model), resid_scale=None)
    assert [n for n, _ in failed(model, plain)] == ["block: pieces rebuild the next residual (relative)"]


@pytest.mark.parametrize("overrides,why", [
    (dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32),
     r"a mixture of experts beside the MLP.*\(enable_moe_block\)"),
    (dict(num_hidden_layers=3, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
          num_kv_shared_layers=1),
     r"its last 1 layers \(num_kv_shared_layers\) read the keys and values an earlier layer computed")])
def test_what_is_not_placed_is_refused_saying_why(overrides, why):
    with pytest.raises(UnsupportedArchitectureError, match=why) as e:
        describe(tiny(**overrides))
    assert e.value.kind == "mfpipe"


@pytest.mark.parametrize("family,placed", [("gemma4_unified", True), ("gemma4_unified_text", True),
                                           ("gemma4_assistant", False), ("gemma4_text", True)])
def test_census_rows(family, placed):
    """The census's tiny copies: Gemma-4-Unified (no PLE) placed, through its language model too; an assistant refused
    as a drafter (modelling); Gemma-4's default config, PLE on (hidden_size_per_layer_input 256), placed and passing
    every conformance check (its blocks run with each row's token: tests/test_joins.py)."""
    from mfpipe.models.census import census_row

    row = census_row(family)
    if placed:
        assert row.accepted and row.passed == row.checks >= 15, row
    elif family == "gemma4_assistant":
        assert row.kind == "modelling" and row.reason.startswith("every layer attends to another model's keys/values: "
                                                                 "a drafter fed shared_kv_states"), row


def test_the_config_keys_it_reads_exist():
    """The refusals read these config keys (a rename in transformers would silently place what they refuse)."""
    cfg = transformers.Gemma4TextConfig()
    for key in ("num_kv_shared_layers", "hidden_size_per_layer_input", "enable_moe_block", "attention_k_eq_v"):
        assert hasattr(cfg, key), key
