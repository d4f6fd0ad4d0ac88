"""Issue 59 item 5: the families whose blocks join the residual in another way, or whose embedding reaches block 0 in
another way, placed and read right (mfpipe.models.adapters.residual, probe, site):

* the residual added inside the attention and the MLP modules (BLOOM's fused dropout_add; MPT's MLP), a branch scale
  (MiniCPM-3), a bias the last attention returns for the block to add (GPT-NeoX-Japanese), one norm shared by the
  embedding and the end of the stack (NanoChat), sinusoidal position tables (XGLM's module, CTRL's buffer after a
  sqrt(d) scale): each tiny copy of the default config passes every conformance check, and the site's attention and
  MLP branches add up to the model's own next residual (the statistics' residual model), its final residual is the
  one the final norm reads (also through the J-lens's hook);
* a decoder without a final norm is placed with none;
* a mixture of experts after a dense first block is called as the mixture needs (the probe's block is the dense one);
* the census tells an encoder from a decoder by more than rounding (attends_ahead's tolerance).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

# family -> what its placement must say
FORMS = {
    "bloom": dict(attn_residual=True, mlp_residual=True, embed_norm="word_embeddings_layernorm"),
    "mpt": dict(attn_residual=False, mlp_residual=True),
    "minicpm3": dict(latent_proj="self_attn.kv_a_proj_with_mqa"),  # and a branch scale (below)
    "gpt_neox_japanese": dict(attn_bias="attention.dense_bias"),
    "nanochat": dict(embed_norm="norm", final_norm="norm"),
    "xglm": dict(position_table="embed_positions", position_row_offset=2, embed_scale=1.0),
    "ctrl": dict(position_table="pos_encoding", position_row_offset=0, embed_scale=8.0),
}


def _tiny(family: str):
    from mfpipe.models.defaults import default_config
    from mfpipe.models.tiny import random_model, shrink_config

    torch.manual_seed(0)
    return random_model(shrink_config(default_config(family)))


@pytest.mark.parametrize("family", list(FORMS))
def test_each_residual_form_is_placed_and_read_as_the_model_computes(family):
    from mfpipe.conformance import check_model
    from mfpipe.models.adapters import get_adapter
    from mfpipe.models.adapters.jacobian import final_residual

    model = _tiny(family)
    adapter = get_adapter(model)
    placed = adapter.structure.as_dict()
    assert {k: placed[k] for k in FORMS[family]} == FORMS[family]
    if family == "minicpm3":  # scale_depth / sqrt(L), the block's own number (to the bit)
        assert adapter.structure.branch_scale == model.model.layers[0].residual_scale != 1.0
    rows = check_model(model, adapter.structure)
    assert all(r.ok for r in rows), [(r.name, r.error) for r in rows if not r.ok]
    ids = torch.randint(0, 100, (2, 10), generator=torch.Generator().manual_seed(1))
    caps, finals = [], []
    adapter.capture(ids, caps.append, finals.append)
    with torch.no_grad():
        hidden = model(ids, output_hidden_states=True, use_cache=False).hidden_states
    for c in caps:  # the branches as the site reads them add up to the model's next residual
        w = adapter.attn_out_weights(c.layer)  # what the statistics pass derives attn_out by (MiniCPM-3's: scaled)
        if w is not None:
            derived = torch.einsum("bthk,hkd->btd", c.reads, w[0]) + (0 if w[1] is None else w[1])
            torch.testing.assert_close(derived, c.attn_out, rtol=1e-5, atol=1e-5)
        nxt = caps[c.layer + 1].resid_in if c.layer + 1 < adapter.n_layers else finals[0]
        scale = float(nxt.abs().max())
        assert float((c.resid_in + c.attn_out + c.mlp_out - nxt).abs().max()) <= 1e-5 * scale, c.layer
        torch.testing.assert_close(c.resid_mid, c.resid_in + c.attn_out)
        torch.testing.assert_close(c.resid_in, hidden[c.layer].float())
    torch.testing.assert_close(adapter.final_norm(finals[0]), hidden[-1].float())
    torch.testing.assert_close(final_residual(adapter, ids), finals[0])


def test_the_attention_branch_of_bloom_is_its_projection_s_output_patched_or_not():
    from mfpipe.models.adapters import get_adapter

    model = _tiny("bloom")
    adapter = get_adapter(model)
    ids = torch.randint(0, 100, (1, 8), generator=torch.Generator().manual_seed(2))
    block = model.transformer.h[0]
    dense, down = [], []
    handles = [block.self_attention.dense.register_forward_hook(lambda m, a, out: dense.append(out)),
               block.mlp.dense_4h_to_h.register_forward_hook(lambda m, a, out: down.append(out))]
    try:
        plain, halved = [], []
        adapter.run(ids, select=("attn_out", "mlp_out", "resid_mid"), on_layer=plain.append)
        adapter.run(ids, select=("attn_out",), on_layer=halved.append, patch_out=lambda l, out, reads: out * 0.5)
    finally:
        for h in handles:
            h.remove()
    torch.testing.assert_close(plain[0].attn_out, dense[0], rtol=0, atol=0)
    torch.testing.assert_close(halved[0].attn_out, 0.5 * dense[0])  # layer 0: the same input in both runs
    # the MLP's branch: its output less the residual it adds (to float32 rounding of the sum), and adapter.mlp's
    torch.testing.assert_close(plain[0].mlp_out, down[0], rtol=0, atol=1e-6 * float(plain[0].resid_mid.abs().max()))
    torch.testing.assert_close(adapter.mlp(0, plain[0].resid_mid), down[0])


def test_a_mixture_of_experts_after_a_dense_block_is_called_as_the_mixture_needs():
    import transformers

    from mfpipe.models.adapters import get_adapter
    from mfpipe.models.tiny import random_model

    cfg = transformers.Qwen3MoeConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=128, max_position_embeddings=128,
                                      mlp_only_layers=[0], num_experts=4, num_experts_per_tok=2,
                                      moe_intermediate_size=32)
    model = random_model(cfg)
    adapter = get_adapter(model)
    assert type(model.model.layers[0].mlp).__name__ == "Qwen3MoeMLP"  # the probe's block: a dense MLP
    x3 = torch.randn(1, 3, 64)
    with torch.no_grad():  # the dense MLP takes rows as they come; the mixture reads [B, T, d] only
        torch.testing.assert_close(model.model.layers[0].mlp(x3[0]), model.model.layers[0].mlp(x3)[0])
        with pytest.raises(ValueError):
            model.model.layers[1].mlp(x3[0])
    assert adapter.structure.mlp_sequences
    x = torch.randn(5, 64)  # the rollout's centroids: [K, d] rows, each routed as a token
    torch.testing.assert_close(adapter.mlp(1, x), adapter.mlp(1, x[None])[0], rtol=0, atol=0)


class _Leaky(torch.nn.Module):
    """A decoder whose logits at every position move with the last token by ``eps`` of their size."""

    def __init__(self, inner, eps: float):
        super().__init__()
        self.inner, self.eps, self.config = inner, eps, inner.config

    def forward(self, input_ids):
        logits = self.inner(input_ids=input_ids).logits
        return SimpleNamespace(logits=logits + self.eps * logits.abs().max() * input_ids[:, -1:, None].float())


def test_attends_ahead_reads_more_than_rounding():
    from mfpipe.models.census import attends_ahead
    from mfpipe.models.tiny import make_tiny_model

    llama = make_tiny_model("llama")
    assert not attends_ahead(_Leaky(llama, 0.0))
    assert not attends_ahead(_Leaky(llama, 1e-6))  # batched expert kernels' rounding (DBRX, AFMoE): a decoder
    assert attends_ahead(_Leaky(llama, 1e-2))  # ten times the tolerance (a thousandth): reads later tokens


def test_no_final_norm_is_a_structure_too():
    """A decoder whose last block's output is what the LM head reads (a tiny Llama without its final norm) is placed
    with none and passes every check; the site's and the J-lens's final residual is the last block's output."""
    from mfpipe.conformance import check_model
    from mfpipe.models.adapters import get_adapter
    from mfpipe.models.adapters.jacobian import final_residual
    from mfpipe.models.tiny import make_tiny_model

    model = make_tiny_model("llama", seed=1)
    model.model.norm = torch.nn.Identity()
    adapter = get_adapter(model)
    assert adapter.structure.final_norm is None
    rows = check_model(model, adapter.structure)
    assert all(r.ok for r in rows), [(r.name, r.error) for r in rows if not r.ok]
    ids = torch.randint(0, 100, (1, 9), generator=torch.Generator().manual_seed(3))
    finals = []
    adapter.run(ids, on_final=finals.append)
    with torch.no_grad():
        last = model(ids, output_hidden_states=True, use_cache=False).hidden_states[-1]
    torch.testing.assert_close(finals[0], last, rtol=0, atol=0)
    torch.testing.assert_close(final_residual(adapter, ids), last, rtol=0, atol=0)


@pytest.mark.parametrize("family,why", [("hy_v4", "its blocks carry 4 residual streams mixed by hyper-connections")])
def test_what_cannot_be_placed_is_refused_saying_why(family, why):
    """HY-V4's blocks carry hc_mult residual streams mixed by hyper-connections ([B, T, 4, d] between the blocks): a
    refusal that says so, not a probe that crashes on the shapes. (Gemma-4's per-layer inputs, refused here before,
    are placed: tests/test_joins.py.)"""
    from mfpipe.models.adapters import UnsupportedArchitectureError, get_adapter

    with pytest.raises(UnsupportedArchitectureError, match=why):
        get_adapter(_tiny(family))
