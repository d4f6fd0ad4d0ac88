"""Issue 59: Inkling's short convolutions over positions placed (mfpipe.models.adapters.convolved). A tiny Inkling (its
default config shrunk; a sliding-window block with a dense MLP and twice the KV heads, a full one with experts): its
values are a causal convolution of what ``v_proj`` writes, each branch passes one before it joins the residual. Placed
by what the modules are and read, it passes every conformance check (statistics against per-position loops, the values summed as the heads
read them, the substitution against a torch hook, the pieces rebuilding each next residual over the sequence); the
pieces on rows (the rollout's type centroids) run each row as a sequence of one position, as the model's own block
does on a one-token input; and a placement without the values' convolution fails the checks its values enter."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tiny_models import tiny_inkling

from mfpipe.conformance import check_model
from mfpipe.models.adapters import Adapter, describe


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    yield


@pytest.fixture(scope="module")
def inkling():
    return tiny_inkling(seed=3)


def test_placed_by_what_its_convolutions_read_and_every_check_passes(inkling):
    s = describe(inkling)
    assert (s.value_source, s.value_conv, s.post_attn_norm, s.post_mlp_norm, s.mlp, s.join) == (
        "self_attn.v_proj", "self_attn.v_sconv", "attn_sconv", "mlp_sconv", "mlp", "sum")
    # its sliding-window layer reads twice the KV heads: a layer form of its own (mfpipe.models.adapters.layers),
    # found by the value search over the convolutions' outputs as the placed block's
    assert [f.kv_heads for f in s.layer_forms] == [4, 2], s.layer_forms
    rows = check_model(inkling, s)
    assert all(r.ok for r in rows) and len(rows) >= 15, [(r.name, r.error) for r in rows if not r.ok]
    assert any(r.name.startswith("statistics: value means (summed as read)") for r in rows)  # no value weights


def test_without_the_values_convolution_the_checks_that_read_values_fail(inkling):
    """The placement's value_conv is what the checks see: the values taken at v_proj's output are not what the heads
    read (the reads are not probabilities times those values), and the pieces, valued so, do not rebuild the next
    residual."""
    s = dataclasses.replace(describe(inkling), value_conv=None)
    bad = {r.name for r in check_model(inkling, s) if not r.ok}
    assert {"site: reads = probabilities x values", "block: pieces rebuild the next residual (relative)"} <= bad, bad


@torch.no_grad()
def test_rows_are_sequences_of_one_position_as_the_models_block_runs_them(inkling):
    """On rows ``[N, d]`` a convolution sees one position (its last tap and the identity), on a sequence it mixes the
    positions before; the rollout's block step at the centroids equals the model's own decoder layer run on each row
    as a one-token sequence with its attention's output replaced by the mean-field branch
    (mfpipe.models.adapters.joins.run_block, the reference of joins of the block's own). Its cache holds convolution
    states the next token updates in place (``state_in_cache``)."""
    from mfpipe.experiments.rollout.algorithm import attention_output, block_update
    from mfpipe.models.adapters.joins import run_block

    adapter = Adapter(inkling, describe(inkling))
    assert adapter.state_in_cache  # its convolution states: the J-lens runs each window whole, as for hybrids
    layer = 0
    block = adapter.block_module(layer)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, adapter.d_model, generator=g)
    conv = block.attn_sconv
    assert torch.equal(adapter.post_attn_norm(layer, x), conv(x[:, None])[:, 0])
    assert not torch.allclose(adapter.post_attn_norm(layer, x[None])[0], adapter.post_attn_norm(layer, x))
    h = block.input_layernorm(x)[:, None]
    want = block.self_attn.v_sconv(block.self_attn.v_proj(h))[:, 0].unflatten(-1, (adapter.kv_heads(layer), -1))
    rep = adapter.n_heads // adapter.kv_heads(layer)
    got = adapter.value_map(layer, x)[:, ::rep]  # GQA: each KV head's first query head
    assert torch.equal(got, want)
    seq = adapter.value_map(layer, x[None])[0]
    assert torch.allclose(seq[0], adapter.value_map(layer, x)[0]) and not torch.allclose(seq[1:], got.repeat_interleave(
        rep, dim=1)[1:])  # the first position has no positions before it
    reads = torch.randn(5, adapter.n_heads, adapter.d_head, generator=g)
    for layer in range(adapter.n_layers):  # a dense MLP, then experts
        ref = run_block(adapter, layer, x, attention_output(adapter, layer, reads, bias=True, at=x))[1]
        torch.testing.assert_close(block_update(adapter, layer, x, reads), ref, rtol=1e-5, atol=1e-5)
