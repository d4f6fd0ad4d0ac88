"""Issue 59 item 5: a family the placement refuses is refused for what its forward computes, said precisely
(mfpipe.models.adapters.unplaced.explain, through the census), with the kind of refusal the census records: modelling
only where the heads have no probability row each (differential attention); and a family whose projections sit in a
wrapper of their own (Moshi's MoshiLinear) is placed and passes."""

from __future__ import annotations

import pytest
from tiny_models import make_tiny_model

from mfpipe.models.adapters import UnsupportedArchitectureError, describe
from mfpipe.models.adapters.unplaced import explain
from mfpipe.models.census import census_row


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    yield


# family -> (kind, what the reason must say): each a fact of the family's forward (see the module docstring of
# mfpipe.models.adapters.unplaced), not only what the placement did not find
REFUSED = {
    "diffllama": ("modelling", "differential attention: each head reads (softmax_1 - λ softmax_2) V"),
    "jetmoe": ("mfpipe", "its heads are routed per token (a mixture of attention heads: experts (JetMoeMoA)"),
    "gemma3n_text": ("mfpipe", "its blocks carry 4 residual streams (altup_num_inputs)"),
    # the composite: its vision tower needs timm, not installed; its language model, built alone, is what is refused
    "gemma3n": ("mfpipe", "4 residual streams (altup_num_inputs), mixed in every block: mfpipe reads one residual "
                          "stream of summed branches (its language model built alone, its composite not: "),
    "reformer": ("mfpipe", "2 residual streams side by side (its norm encoder.layer_norm reads 2 x 64"),
    # (its residual interpolated on the unit sphere would be run by the block: mfpipe.models.adapters.joins; a norm of
    # its heads' reads is placed where it norms the reads themselves, BitNet's: tests/test_reads_norm.py; Dory's norms
    # them times a gate)
    "dory": ("mfpipe", "a norm of all its heads' reads together (attn_sub_norm: DoryL2Norm) sits between the attention "
                       "and its output projection, and what it norms is no probability-weighted values"),
    # (its short convolutions over positions are placed, Inkling's: tests/test_convolved.py)
    "inkling2_text": ("mfpipe", "its blocks mix the residuals of earlier blocks by an attention over them (attention "
                                "residuals: a stack of earlier residual states handed beside the residual"),
}


@pytest.mark.parametrize("family", REFUSED)
def test_a_refusal_says_what_the_forward_computes(family):
    row = census_row(family)
    kind, says = REFUSED[family]
    assert not row.placed and row.kind == kind and says in row.reason, row


def test_the_explanation_is_read_off_the_tensors_not_assumed():
    """A tiny Llama whose output projections read the heads' reads halved is refused (no value layout gives them) and
    the refusal names the factor; unhooked, the same model is placed, and a refusal of another kind stays as it was."""
    model = make_tiny_model("llama")
    hooks = [layer.self_attn.o_proj.register_forward_pre_hook(lambda m, args: (args[0] * 0.5,))
             for layer in model.model.layers]
    with pytest.raises(UnsupportedArchitectureError) as e:
        describe(model)
    why = explain(e.value, model)
    assert why.kind == "mfpipe" and "(v_proj) outputs times 0.5: mfpipe's value map has no such factor" in why.reason
    for h in hooks:
        h.remove()
    describe(model)
    other = UnsupportedArchitectureError("llama", "cannot place the value projection (...): none")
    assert explain(other, model) is other  # the reads are the values weighted by the probabilities: nothing to say


def test_an_attention_that_reads_later_positions_is_refused_and_the_same_model_as_a_decoder_is_placed():
    """BERT-generation's default config leaves ``is_decoder`` off: its causal LM's attention reads later positions,
    which the probe sees in its probabilities above the diagonal, and the refusal is of the modelling kind (an
    encoder). With ``is_decoder=True``, as a checkpoint trained as a decoder has, the same layout (BERT's, GIT's: the
    norms in the output modules, the embedding beside the encoder) is placed and passes every conformance check."""
    from mfpipe.conformance import check_model
    from mfpipe.models.defaults import default_config
    from mfpipe.models.tiny import random_model, shrink_config

    config = shrink_config(default_config("bert-generation"))
    with pytest.raises(UnsupportedArchitectureError, match="its attention reads later positions") as e:
        describe(random_model(config))
    assert e.value.kind == "modelling"
    config.is_decoder = True
    model = random_model(config)
    s = describe(model)
    assert (s.out_proj, s.block_norm, s.embed, s.final_norm) == ("attention.output.dense", "output.LayerNorm",
                                                                  "embeddings.word_embeddings", None)
    rows = check_model(model, s)
    assert all(r.ok for r in rows) and len(rows) >= 15, [(r.name, r.error) for r in rows if not r.ok]


def test_a_projection_in_a_wrapper_of_its_own_is_placed_and_passes():
    row = census_row("moshi")
    assert row.accepted and row.passed == row.checks >= 10, row


def test_a_first_block_without_the_others_attention_norm_is_placed_and_passes():
    """ModernBERT-decoder (refused for its first block's nn.Identity attention norm before): placed by a block with the
    norm (the identity read at the same path is the first block's), its embedding and the embedding's norm one level
    down (embeddings.tok_embeddings, embeddings.norm), its prediction head between the final norm and the unembedding;
    the conformance checks include the unembedding against the model's logits and statistics against loops. (Its
    statistics and substitution against the torch-hook references: PLACED_MODEL_TYPES.)"""
    row = census_row("modernbert-decoder")
    assert row.accepted and row.passed == row.checks >= 10, row
    model = make_tiny_model("modernbert-decoder")
    s = describe(model)
    assert (s.attn_norm, s.embed, s.embed_norm, s.head_transform, s.out_proj) == (
        "attn_norm", "embeddings.tok_embeddings", "embeddings.norm", "lm_head", "attn.Wo")


def test_values_scaled_by_a_constant_in_layers_of_two_kinds_are_placed_and_pass():
    """MiMo-V2-Flash (refused for its value scale before issue 59 §3): v_scale in the value form, its sliding-window
    layers' twice as many KV heads as a per-layer form (mfpipe.models.adapters.layers)."""
    row = census_row("mimo_v2_flash")
    assert row.accepted and row.passed == row.checks >= 10, row


def test_latent_layers_of_two_kinds_are_placed_each_by_its_own_form_and_pass():
    """dots.3-note (refused for its latent rescaled after its norm, then for its layers of two kinds): kv_b_proj reads
    kv_a_layernorm's output times kv_lora_scale, found by the tensors as the attention's own number; its sliding layers'
    keys are wider per head (qk_nope 12 against 8), so their values sit at offset 12 of each head's chunk of kv_b_proj,
    not 8: each kind's form (mfpipe.models.adapters.layers) holds its own offset and latent, and every conformance
    check passes (the value map of the residual, the values summed as read vs a per-position loop, own reads written
    back exact, the mean-field write-back vs a torch hook), also where the kinds' latents differ in width and scale.
    One offset for every layer fails the checks."""
    import dataclasses

    from mfpipe.conformance import check_model
    from mfpipe.models.adapters.structure import base_model
    from mfpipe.models.defaults import default_config
    from mfpipe.models.tiny import random_model, shrink_config

    row = census_row("dots3_note")  # the composite, placed through its language model
    assert row.accepted and row.passed == row.checks >= 10, row
    config = shrink_config(default_config("dots3_note_text"))
    model = random_model(config)
    s = describe(model)
    attn = base_model(model).get_submodule(f"{s.layers}.0.{s.attn}")
    assert s.latent_norm and s.output_gate and s.latent_scale == attn.kv_lora_scale != 1.0
    assert [f.value_offset for f in s.layer_forms] == [8, 8, 12, 12], s.layer_forms
    rows = check_model(model, s)
    assert len(rows) >= 10 and all(r.ok for r in rows), [r.name for r in rows if not r.ok]
    one_offset = dataclasses.replace(s, layer_forms=tuple(dataclasses.replace(f, value_offset=8)
                                                          for f in s.layer_forms))
    assert {"site: reads = probabilities x values"} <= {r.name for r in check_model(model, one_offset) if not r.ok}

    wider = config.to_dict()  # the sliding layers' latent 24 wide, as the released config's is wider than the others'
    for k in ("architectures", "transformers_version", "_name_or_path"):
        wider.pop(k, None)
    wider["per_layer_config"] = {i: {"qk_nope_head_dim": 12, "kv_lora_rank": 24} for i in ("2", "3")}
    model = random_model(type(config)(**wider))
    s = describe(model)
    assert [(f.latent.width, f.value_offset) for f in s.layer_forms] == [(16, 8), (16, 8), (24, 12), (24, 12)]
    assert s.layer_forms[2].latent.scale == base_model(model).get_submodule(f"{s.layers}.2.{s.attn}").kv_lora_scale
    rows = check_model(model, s)
    assert all(r.ok for r in rows), [r.name for r in rows if not r.ok]
