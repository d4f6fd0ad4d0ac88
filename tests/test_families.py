"""Issue 30: adapters by structure and the conformance command.

Every verified architecture (the paper's six and the families placed by structure) passes ``mfpipe conformance`` on
its tiny recipe; so do tiny copies of full-size default configs (the real switches: Llama-3's rope scaling, Phi-3's
long-rope factors, GPT-J's rotary share, Gemma-3's layer pattern); a deliberately mis-described model fails, naming
the check, with a non-zero exit; a model that cannot be placed is refused with one line naming what did not match.
(The statistics and the substitution of Mistral, Qwen2, Phi-3, GPT-J and Gemma-3 against the brute-force references:
tests/test_stats_reference.py and tests/test_substitution.py.)
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import transformers
from tiny_models import NEW_MODEL_TYPES, VERIFIED_MODEL_TYPES, make_tiny_model

from mfpipe import cli, conformance
from mfpipe.models.adapters import UnsupportedArchitectureError, describe, get_adapter
from mfpipe.models.tiny import random_model, shrink_config


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    yield


def failing(rows):
    return [r.name for r in rows if not r.ok]


@pytest.mark.parametrize("model_type", VERIFIED_MODEL_TYPES)
def test_every_verified_architecture_passes_conformance(model_type):
    rows = conformance.check_model(make_tiny_model(model_type, seed=2))
    assert not failing(rows), conformance.table(rows)
    assert len(rows) == 15 and all(r.error <= r.tolerance for r in rows)


@pytest.mark.parametrize("model_type,overrides", [("stablelm", {"use_parallel_residual": True}),
                                                  ("gemma3_text", {"num_key_value_heads": 1}),
                                                  ("falcon", {"new_decoder_architecture": True, "num_kv_heads": 2}),
                                                  ("falcon", {"multi_query": False})])
def test_variants_place_and_pass(model_type, overrides):
    model = make_tiny_model(model_type, **overrides)
    s = describe(model)
    if model_type == "stablelm":  # x + attn(ln(x)) + mlp(ln(x)): the MLP shares the attention's norm
        assert s.parallel_residual and s.mlp_norm == s.attn_norm == "input_layernorm"
    if overrides.get("new_decoder_architecture"):  # [(q q | k | v) per KV head]: 2 chunks, values at 3 dh
        assert (s.value_layout, s.kv_heads, s.value_chunks, s.value_offset) == ("chunked", 2, 2, 48)
        assert (s.attn_norm, s.mlp_norm, s.parallel_residual) == ("ln_attn", "ln_mlp", True)
    if overrides.get("multi_query") is False:  # one KV head per head, laid out per head as GPT-NeoX's
        assert s.value_layout == "neox" and s.kv_heads is None
    assert not failing(conformance.check_model(model))


FULL_SIZE = {
    "llama3": lambda: transformers.LlamaConfig(num_key_value_heads=8, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}),
    "phi3-128k": lambda: transformers.Phi3Config(
        rope_scaling={"type": "longrope", "short_factor": [1.0] * 48, "long_factor": [1.5] * 48},
        original_max_position_embeddings=4096, max_position_embeddings=131072),
    "gptj-6b": transformers.GPTJConfig,
    "gemma3": transformers.Gemma3TextConfig,
    "mistral": transformers.MistralConfig,
}


@pytest.mark.parametrize("name", FULL_SIZE)
def test_a_tiny_copy_of_a_full_size_config_keeps_its_switches_and_passes(name, tmp_path):
    full = FULL_SIZE[name]()
    full.save_pretrained(tmp_path)
    tiny = conformance.tiny_copy(str(tmp_path))
    assert tiny.config.model_type == full.model_type and tiny.config.hidden_size == 64
    assert sum(p.numel() for p in tiny.parameters()) < 200_000
    if name == "gptj-6b":  # the rotary share of the head is kept: 64 of 256 -> 4 of 16
        assert tiny.config.rotary_dim == 4
    if name == "gemma3":  # both layer kinds survive the cut to two layers
        assert set(tiny.config.layer_types) == {"sliding_attention", "full_attention"}
    assert not failing(conformance.check_model(tiny))


def test_a_mis_described_model_fails_naming_the_check(monkeypatch, capsys):
    """The MLP's norm left out of a Llama description (as if it read the raw residual), or GPT-J described as
    sequential: conformance fails on the block rebuild; the command exits non-zero and prints the failing row."""
    llama = make_tiny_model("llama")
    s = describe(llama)
    bad = failing(conformance.check_model(llama, dataclasses.replace(s, mlp_norm=None)))
    assert "block: pieces rebuild the next residual (relative)" in bad
    gptj = make_tiny_model("gptj")
    bad = failing(conformance.check_model(gptj, dataclasses.replace(describe(gptj), parallel_residual=False)))
    assert "block: pieces rebuild the next residual (relative)" in bad
    # the command: a description broken where the norm sits after attention (OLMo-2's post-norm dropped)
    monkeypatch.setattr("mfpipe.models.adapters.describe",
                        lambda m: dataclasses.replace(describe(m), post_attn_norm=None))
    assert cli.main(["conformance", "olmo2"]) == 1
    out = capsys.readouterr().out
    assert "FAILED" in out and "NO" in out


def test_the_command_passes_and_refuses(capsys, tmp_path):
    assert cli.main(["conformance", "phi3"]) == 0
    assert "15 of 15 checks pass" in capsys.readouterr().out
    # a decoder whose heads are routed per token (JetMoE's mixture of attention heads) is not placed: one line, exit 2
    # (GPT-1's post-norm blocks and BitNet's norm of the reads, refused so before, are placed: tests/test_joins.py,
    # tests/test_reads_norm.py)
    # (a config whose keys' and values' projection kv_proj maps the width d to d: no output projection for it)
    transformers.JetMoeConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_key_value_heads=2,
                              kv_channels=16, num_local_experts=4, num_experts_per_tok=2, intermediate_size=128,
                              bos_token_id=1, eos_token_id=2).save_pretrained(tmp_path)
    assert cli.main(["conformance", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "its heads are routed per token" in err[0] and "mfpipe conformance" in err[0]
    assert cli.main([]) == 2


def test_placement_is_by_structure_not_by_name():
    """A Llama-shaped model under a name mfpipe has never seen is placed like Llama, with identical captures."""
    model = make_tiny_model("llama")
    ref = get_adapter(model)
    model.config.model_type = "my-own-llama"
    a = get_adapter(model)
    assert a.structure == ref.structure and a.model_type == "my-own-llama"
    ids = torch.randint(0, 128, (1, 8))
    got, want = [], []
    a.capture(ids, got.append)
    ref.capture(ids, want.append)
    assert all(torch.equal(g.reads, w.reads) and torch.equal(g.attn_probs, w.attn_probs) for g, w in zip(got, want))


def test_unplaceable_structures_say_what_did_not_match():
    model = make_tiny_model("llama")
    model.model.layers[0].extra_norm = type(model.model.norm)(64)  # a norm in the block that nothing calls: fine
    describe(model)
    config = shrink_config(transformers.BertConfig())
    with pytest.raises(UnsupportedArchitectureError, match="token embedding beside its blocks"):  # an encoder's
        describe(transformers.AutoModel.from_config(config))
    assert set(NEW_MODEL_TYPES) <= set(VERIFIED_MODEL_TYPES)
    # grouped-query attention stays grouped (8 KV heads of 32 -> 2 of 4), none stays none
    assert random_model(shrink_config(transformers.Qwen2Config(num_key_value_heads=8))).config.num_key_value_heads == 2
    assert shrink_config(transformers.Qwen2Config()).num_key_value_heads == 4


def test_a_mixture_of_experts_routes_each_centroid_as_the_model_routes_a_token():
    """Issue 48: Mixtral's MLP is its router and experts. The adapter's MLP on n rows (the rollout's centroids) gives
    each row the mixture its own top-k experts give it (a hand-routed reference), as the block's MLP does on a
    sequence; the rows do not share one routing."""
    from rollout_reference import moe_reference

    model = make_tiny_model("mixtral", seed=4)
    adapter = get_adapter(model)
    assert adapter.structure.mlp_sequences and adapter.structure.mlp == "mlp"
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(0))
    block = model.model.layers[1]
    got = adapter.mlp(1, x)
    h = block.post_attention_layernorm(x)
    with torch.no_grad():
        want = torch.stack([moe_reference(block.mlp, row) for row in h])
        routed = [set(torch.topk(block.mlp.gate.weight @ row, 2).indices.tolist()) for row in h]
        torch.testing.assert_close(got, block.mlp(h[None])[0], rtol=0, atol=0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert len({frozenset(r) for r in routed}) > 1  # the rows are routed to different experts


def test_the_failure_classes_are_placed_as_they_compute():
    """Issue 48's five families by their tiny recipes: what the probe decided of each."""
    place = {mt: describe(make_tiny_model(mt)) for mt in ("opt", "falcon", "cohere", "codegen")}
    opt = place["opt"]  # blocks one level down, position table from row 2, a three-module MLP
    assert (opt.layers, opt.final_norm, opt.position_table, opt.position_row_offset) == (
        "decoder.layers", "decoder.final_layer_norm", "decoder.embed_positions", 2)
    assert opt.mlp_chain == ("fc1", "activation_fn", "fc2") and opt.mlp == "fc2" and opt.mlp_norm == "final_layer_norm"
    falcon = place["falcon"]  # multi-query [q (4 heads) | k | v]: the "qkv" layout with one KV head
    assert (falcon.value_layout, falcon.kv_heads, falcon.parallel_residual) == ("qkv", 1, True)
    cohere = place["cohere"]  # a LayerNorm without bias, the logits scaled by the config's logit_scale
    assert cohere.norm_centred and cohere.logit_scale == 0.125 and cohere.parallel_residual
    codegen = place["codegen"]  # four shards [q | v | k] of 16 values each
    assert (codegen.value_layout, codegen.value_chunks, codegen.value_offset) == ("chunked", 4, 16)
    assert get_adapter(make_tiny_model("cohere")).attn_input_norm_form(0).kind == "layer"
    neo = random_model(shrink_config(transformers.GPTNeoConfig()))  # the block's attention wraps the attention proper
    assert describe(neo).attn == "attn.attention" and not failing(conformance.check_model(neo))


def test_a_norm_on_the_embedding_is_told_from_the_final_norm():
    """Issue 48's third class: two norms beside the blocks. A tiny Llama given a norm on its embedding (run before
    block 0, as BLOOM's word_embeddings_layernorm): the probe takes the one that reads the last block's output as
    the final norm and the one that reads the embedding's as the embedding norm, the adapter's embedding applies it,
    and every conformance check passes."""
    model = make_tiny_model("llama", seed=6)
    base = model.model
    base.add_module("embed_norm", type(base.norm)(64, eps=1e-6))
    with torch.no_grad():
        base.embed_norm.weight.add_(0.3 * torch.randn(64, generator=torch.Generator().manual_seed(1)))

    def normed(mod, args, kwargs):
        if args:
            return (base.embed_norm(args[0]), *args[1:]), kwargs
        return args, dict(kwargs, hidden_states=base.embed_norm(kwargs["hidden_states"]))

    base.layers[0].register_forward_pre_hook(normed, with_kwargs=True)
    s = describe(model)
    assert (s.final_norm, s.embed_norm) == ("norm", "embed_norm")
    ids = torch.tensor([[3, 9, 4]])
    torch.testing.assert_close(get_adapter(model).embed(ids), base.embed_norm(base.embed_tokens(ids)))
    assert not failing(conformance.check_model(model))


@pytest.mark.parametrize("model_type", ["opt", "falcon", "mixtral"])
def test_the_captured_branches_add_up_to_the_next_residual(model_type):
    """The site's attn_out and mlp_out of the placed classes, as [B, T, d]: OPT's MLP runs on [B * T, d], Falcon adds
    the attention branch into its MLP's output in place, Mixtral's MLP is its experts; resid_in[l] + attn_out +
    mlp_out is the next block's input (the last: the final residual)."""
    model = make_tiny_model(model_type, seed=8)
    caps, finals = [], []
    get_adapter(model).capture(torch.randint(0, 120, (2, 9), generator=torch.Generator().manual_seed(0)),
                               caps.append, finals.append)
    nxt = [c.resid_in for c in caps[1:]] + finals
    for c, want in zip(caps, nxt):
        assert c.mlp_out.shape == c.resid_in.shape == (2, 9, 64)
        torch.testing.assert_close(c.resid_in + c.attn_out + c.mlp_out, want, rtol=1e-5, atol=1e-5)


def test_a_multimodal_composite_is_placed_through_its_language_model(tmp_path):
    """Issue 59 item 4: a tiny Gemma-3 composite (its text model beside a SigLIP tower) is placed as its language
    model: the adapter's model is the text-only causal LM built on the composite's own modules (shared, no tower), its
    logits on text-only input are the composite's bit for bit, and the composite saved to a folder loads through
    mfpipe's loader as that text LM, as a hub id of it would (its statistics and substitution against the references:
    tests/test_stats_reference.py, tests/test_substitution.py; conformance: above)."""
    from mfpipe.models.adapters.composite import is_composite, language_model
    from mfpipe.models.loader import load_model

    comp = make_tiny_model("gemma3", seed=6)
    assert type(comp).__name__ == "Gemma3ForConditionalGeneration" and is_composite(comp.config)
    adapter = get_adapter(comp)
    lm = adapter.model
    assert type(lm).__name__ == "Gemma3ForCausalLM" and lm is not comp
    assert (adapter.model_type, adapter.n_layers, adapter.n_heads, adapter.d_model) == ("gemma3_text", 2, 4, 64)
    assert lm.model is comp.model.language_model and lm.get_output_embeddings() is comp.lm_head
    shared = {id(p) for p in comp.parameters()}
    assert all(id(p) in shared for p in lm.parameters())
    assert not any("vision" in n or "projector" in n for n, _ in lm.named_parameters())
    ids = torch.randint(0, 120, (2, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = comp(ids, use_cache=False).logits
        torch.testing.assert_close(lm(ids, use_cache=False).logits, want, rtol=0, atol=0)
    comp.save_pretrained(tmp_path / "tiny-gemma3")
    loaded = load_model({"name": "tiny-gemma3", "source": "local", "path": str(tmp_path / "tiny-gemma3")})
    assert type(loaded).__name__ == "Gemma3ForCausalLM" and not is_composite(loaded.config)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids, use_cache=False).logits, want, rtol=0, atol=0)
    plain = make_tiny_model("gemma3_text")
    assert language_model(plain) is plain and get_adapter(plain).model is plain
    # the census and the planning's conformance check read a composite's default config the same way: Gemma-3's (the
    # conditional-generation model, its language model taken out) and Llama-4's (transformers' causal LM of it is
    # already the text model) are placed and pass, where before "no attention heads in its config" refused them
    from mfpipe.models.census import census_row

    for family in ("gemma3", "llama4"):
        row = census_row(family)
        assert row.accepted and row.passed == row.checks == 15, row
    assert conformance.conformance_cached({"model_type": "llama4"}, tmp_path / "conformance.json") is None


def test_latent_attention_is_placed_by_what_its_modules_do():
    """Issue 59: DeepSeek-V3's multi-head latent attention (tiny recipe: query/key heads 12 + 4 rotary wide, the
    config's head_dim the rotary 4, values 8 wide). The output projection reads H x 8; the values are kv_b_proj's, per head [k_nope (12) | v (8)], and
    kv_b_proj reads kv_a_layernorm of kv_a_proj_with_mqa's first 32 outputs (the latent, before the rotary key): the
    probe finds the chain by its tensors. No affine value weights exist (a norm between): the statistics pass sums
    the values it reads and the conformance checks them against a per-position loop instead. A description with the
    latent sliced one place off fails the value map and the block rebuild."""
    model = make_tiny_model("deepseek_v3", seed=2)
    s = describe(model)
    assert (s.value_head_dim, s.value_source, s.value_layout, s.value_chunks, s.value_offset) == (
        8, "self_attn.kv_b_proj", "chunked", 4, 12)
    assert (s.latent_proj, s.latent_offset, s.latent_width, s.latent_norm) == (
        "self_attn.kv_a_proj_with_mqa", 0, 32, "self_attn.kv_a_layernorm")
    adapter = get_adapter(model)
    assert adapter.d_head == 8 and adapter.value_weights(0) is None
    assert model.config.qk_nope_head_dim + model.config.qk_rope_head_dim != adapter.d_head
    rows = conformance.check_model(model, s)
    names = [r.name for r in rows]
    assert "statistics: value means (summed as read) vs a per-position loop" in names and not failing(rows)
    assert "block: value weights of the attention-input norm" not in names and len(rows) == 15
    bad = failing(conformance.check_model(model, dataclasses.replace(s, latent_offset=1)))
    assert {"block: value map of the residual", "block: pieces rebuild the next residual (relative)"} <= set(bad)


def test_the_rollout_of_latent_attention_is_the_forward_on_one_window():
    """Issue 59: the open-loop rollout (Alg. 1) runs on latent attention through the adapter's value map (the latent
    projection, slice, norm and kv_b_proj as the attention runs them) and its mixture-of-experts block: on a window of
    distinct types, the kernel measured by the forward's own attentions rolled out from the layer-0 residuals gives
    the forward's residuals layer by layer (HF's hidden states and the final norm's input)."""
    from mfpipe.experiments.rollout import algorithm as R

    model = make_tiny_model("deepseek_v3", seed=3)
    adapter = get_adapter(model)
    bos, n, L = model.config.bos_token_id, 7, adapter.n_layers
    types = torch.randperm(120, generator=torch.Generator().manual_seed(4))[:n] + 3
    final = []
    hook = model.model.norm.register_forward_pre_hook(lambda mod, args: final.append(args[0][0].double()))
    try:
        with torch.no_grad():
            out = model(torch.tensor([[bos, *types.tolist()]]), output_attentions=True, output_hidden_states=True,
                        use_cache=False)
    finally:
        hook.remove()
    resid = torch.stack([h[0].double() for h in out.hidden_states[:L]] + final).numpy()  # [L + 1, 1 + n, d]
    att = torch.stack([a[0].double() for a in out.attentions]).numpy()  # [L, H, 1 + n, 1 + n]
    P = np.zeros((L, adapter.n_heads, n, n + 2))
    P[..., :n], P[..., n] = att[:, :, 1:, 1:], att[:, :, 1:, 0]
    b = R.bos_residuals(adapter, bos)
    np.testing.assert_allclose(b, resid[:, 0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(R.rollout(adapter, P, b, init=resid[0, 1:]), resid[:, 1:], rtol=2e-4, atol=2e-4)
