"""Issue 59: an MLP branch that is the sum of several modules reading one input (Granite-4.0-H's and GraniteMoeShared's
``block_sparse_moe(h) + shared_mlp(h)``: mfpipe.models.adapters.residual.mlp_siblings). Before stop 81 the placement
took the one module named "...MLP" for the whole branch: the conformance rebuild failed on every such model, so a
Granite-4.0-H or a GraniteMoeShared checkpoint with shared experts was refused at planning. Here: the placement names
both modules in the order they run; every conformance check passes (statistics against per-position loops, the
mean-field write-back against a torch hook, the rebuild); the adapter's MLP branch and the site's captured one equal
the block's own modules called by hand; the MLP-unit decomposition says why it does not apply. Both models have their
checkpoints' embedding multiplier (12; 1 in the default config, which hid that the placement refused it). And the
census: a hybrid whose default config is Mamba throughout (Bamba's, Granite-4's) is checked with an attention layer,
as its checkpoints have; BLT, whose heads sit in sub-models, is no "state-space model"."""

from __future__ import annotations

import pytest
import torch
from stats_reference import VOCAB
from tiny_models import tiny_granite_hybrid

from mfpipe.models.adapters import describe, get_adapter


@pytest.fixture(scope="module")
def granite():
    return tiny_granite_hybrid()


def _shared(seed: int = 4):
    from transformers import GraniteMoeSharedConfig

    from mfpipe.models.tiny import random_model

    cfg = GraniteMoeSharedConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, shared_intermediate_size=96,
                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                 num_experts_per_tok=2, residual_multiplier=0.25, embedding_multiplier=12.0,
                                 logits_scaling=8.0, max_position_embeddings=128,
                                 tie_word_embeddings=False)
    cfg._attn_implementation = "eager"
    return random_model(cfg, seed=seed)


def test_both_modules_are_the_mlp_and_every_check_passes(granite):
    from mfpipe.conformance import check_model

    for model, scale in ((granite, 0.5), (_shared(), 0.25)):
        s = describe(model)
        assert s.mlp_siblings == ("block_sparse_moe", "shared_mlp") and s.branch_scale == scale, s
        assert s.embed_scale == model.config.embedding_multiplier == 12.0  # (1 in the default: 12 in checkpoints)
        rows = check_model(model, s, seed=0)
        assert len(rows) >= 15 and all(r.ok for r in rows), [(r.name, r.detail) for r in rows if not r.ok]


def test_one_module_alone_is_no_sum():
    """A GraniteMoeShared without shared experts (its default: ``shared_intermediate_size`` 0) has one MLP module."""
    from transformers import GraniteMoeSharedConfig

    from mfpipe.models.tiny import random_model

    cfg = GraniteMoeSharedConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                 num_experts_per_tok=2, max_position_embeddings=128)
    cfg._attn_implementation = "eager"
    s = describe(random_model(cfg, seed=4))
    assert s.mlp == "block_sparse_moe" and s.mlp_siblings == ()


@torch.no_grad()
def test_the_mlp_branch_is_the_blocks_two_modules_by_hand(granite):
    a = get_adapter(granite)
    block = granite.model.layers[1]  # the attention block
    g = torch.Generator().manual_seed(0)
    mid = torch.randn(5, 64, generator=g)
    h = block.post_attention_layernorm(mid[None])
    want = 0.5 * (block.block_sparse_moe(h) + block.shared_mlp(h))[0]
    torch.testing.assert_close(a.mlp(1, mid), want, rtol=1e-5, atol=1e-6)
    # the site's capture of the branch: the block's output less its input and its attention's scaled output
    ids = torch.randint(3, VOCAB, (1, 9), generator=g)
    seen = {}
    hooks = [block.register_forward_hook(lambda m, args, kw, out: seen.update(x=args[0] if args else kw[
        "hidden_states"], y=out[0] if isinstance(out, tuple) else out), with_kwargs=True),
             block.self_attn.register_forward_hook(lambda m, args, out: seen.update(attn=out[0]))]
    try:
        granite(ids, use_cache=False)  # a plain forward with the torch hooks
    finally:
        for hk in hooks:
            hk.remove()
    caps = {}
    a.run(ids, select=["mlp_out"], on_layer=lambda c: caps.setdefault(c.layer, c.mlp_out))
    want = seen["y"] - seen["x"] - 0.5 * seen["attn"]
    torch.testing.assert_close(caps[1].reshape(want.shape), want.float(), rtol=1e-4, atol=1e-5)


def test_the_unit_decomposition_says_why_it_does_not_apply(granite):
    from mfpipe.models.adapters.mlp_units import MOE_REASON, NoUnitDecomposition, mlp_units

    with pytest.raises(NoUnitDecomposition, match="mixture of experts") as e:
        mlp_units(get_adapter(granite), 1, torch.zeros(2, 64))
    assert MOE_REASON in str(e.value)


def test_the_census_checks_a_mamba_default_with_an_attention_layer_and_says_what_blt_is():
    from mfpipe.models.census import _with_attention_layer, census_row
    from mfpipe.models.defaults import default_config

    for family, key in (("bamba", "attn_layer_indices"), ("granitemoehybrid", "layer_types")):
        config = default_config(family)
        assert "full_attention" not in config.layers_block_type  # Mamba throughout, as transformers ships it
        made, note = _with_attention_layer(config)
        kinds = made.layers_block_type
        assert kinds[1] == "full_attention" and kinds.count("full_attention") == 1 and key in note, (family, kinds)
        assert "full_attention" not in config.layers_block_type  # the default itself untouched
    row = census_row("blt")
    assert not row.placed and row.kind == "mfpipe" and "state-space" not in row.reason
    assert row.reason.startswith("its attention heads sit in 4 sub-models of its config (decoder_config, "
                                 "encoder_config, global_config, patcher_config)"), row.reason


def test_planning_accepts_a_saved_granite_config(granite, tmp_path):
    """A saved Granite-4.0-H's config.json holds ``time_step_limit`` as ``[0.0, {"__float__": "Infinity"}]``
    (transformers' way of writing an infinity); the workflow's planning builds its tiny copy from that file's contents
    (mfpipe.conformance.conformance_cached) and used to fail on the tag: a Granite-4.0-H was refused at planning."""
    import json

    from mfpipe.conformance import conformance_cached

    granite.config.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert {"__float__": "Infinity"} in cfg["time_step_limit"]
    assert conformance_cached(cfg, tmp_path / "cache.json") is None
