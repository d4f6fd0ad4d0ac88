"""Blocks whose branches do not join the residual as a plain sum (issue 59 item 5).

Post-norm blocks: GPT-1, TrOCR's decoder and GIT's hand on ``ln_2(ln_1(x + a) + mlp(ln_1(x + a)))``, a norm of their sum
(``Structure.block_norm``, ``norm_carried``), composed by :meth:`mfpipe.models.adapters.base.Adapter.block_join` for
every piece that composes blocks by hand (the rollout's block update, the divergence sweeps, the conformance check).
GPT-1's attention returns its probabilities only when asked (:mod:`mfpipe.models.adapters.asked`); TrOCR's block 0
reads a norm of its scaled embedding plus a position row (from row 2); GIT's norms sit in its attention's and MLP's
output modules (BERT's: each adds the residual to its projection's output and norms the sum), its output projection
beside the attention proper, its embedding with its table and norm beside the module of its blocks.

A join of the block's own (``Structure.join == "model"``: Doge's ``b ⊙ (a ⊙ x + attn) + mlp`` with learned vectors,
MiniMax's, a closing norm of another form): the block runs it on each row as a one-position sequence with its
attention's output replaced (:func:`mfpipe.models.adapters.joins.run_block`), placed only where its output is each
position's own. Their statistics and substitution against the per-position loops and the torch-hook reference:
tests/test_stats_reference.py, tests/test_substitution.py (all three in ``PLACED_MODEL_TYPES``).

A block handed an input of each token beside the residual (Gemma-4's per-layer inputs, PLE, on in its default
config) is such a join, its rows run with their own tokens' inputs (``ids``, or a rollout setup's types:
``R.on_types``); its census row passes every conformance check (tests/test_gemma4.py)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_tiny_model

from mfpipe.experiments.rollout import algorithm as R
from mfpipe.experiments.rollout.divergence import block_stages
from mfpipe.models.adapters import UnsupportedArchitectureError, describe, get_adapter
from mfpipe.models.adapters.joins import run_block

POST_NORM = ("openai-gpt", "trocr", "git")
FAMILIES = (*POST_NORM, "doge")


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    yield


def _captured(model):
    adapter = get_adapter(model)
    ids = torch.randint(0, adapter.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(4))
    caps, final = [], []
    adapter.capture(ids, caps.append, final.append)
    return adapter, ids, caps, final[0]


@pytest.fixture(scope="module", params=FAMILIES)
def captured(request):
    """(model type, adapter, the token ids, every layer's capture, the final residual) of one forward."""
    return (request.param, *_captured(make_tiny_model(request.param, seed=3)))


def test_the_joins_are_placed_by_what_the_blocks_compute(captured):
    mt, adapter, *_ = captured
    s = adapter.structure
    assert not adapter.mlp_out_from_resid  # the block hands on no plain sum: mlp_out is read, not derived
    if mt == "doge":
        assert s.join == "model" and s.block_norm is None and s.mlp_norm == "post_attention_layernorm"
        return
    want = {"openai-gpt": ("ln_2", "ln_1"), "trocr": ("final_layer_norm", "self_attn_layer_norm"),
            "git": ("output.LayerNorm", "attention.output.LayerNorm")}[mt]
    assert s.join == "sum" and (s.block_norm, s.mlp_norm) == want and s.norm_carried and s.final_norm is None
    if mt == "trocr":
        assert s.embed_norm == "decoder.layernorm_embedding" and s.position_row_offset == 2
    if mt == "git":  # the projection beside the attention proper, the MLP's last module its output module's projection;
        # the embedding, its position table and norm in the base model's embeddings, beside the blocks' encoder
        assert (s.attn, s.out_proj, s.mlp_chain) == ("attention.self", "attention.output.dense",
                                                     ("intermediate", "output.dense")) and s.branch_at_projection
        assert (s.embed, s.position_table, s.embed_norm, s.layers) == (
            "embeddings.word_embeddings", "embeddings.position_embeddings", "embeddings.LayerNorm", "encoder.layer")


def _next(caps, final, layer):
    return caps[layer + 1].resid_in if layer + 1 < len(caps) else final


def test_each_block_is_rebuilt_from_its_branches_and_a_plain_sum_would_not(captured):
    """``block_join(resid_mid, mlp_out)`` (post-norm), ``run_block(resid_in, attn_out)`` (a join of the block's own)
    equal the residual the block hands on, to float32 rounding; the sum of branches misses it by far."""
    mt, adapter, _, caps, final = captured
    for layer, cap in enumerate(caps):
        want = _next(caps, final, layer)
        if mt in POST_NORM:
            got = adapter.block_join(layer, cap.resid_mid, cap.mlp_out)
        else:
            x = cap.resid_in.reshape(-1, adapter.d_model)
            got = run_block(adapter, layer, x, cap.attn_out.reshape(x.shape))[1].reshape(want.shape)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert float((cap.resid_mid + cap.mlp_out - want).abs().max()) > 0.01


def test_the_rollouts_block_update_at_the_models_own_reads_is_the_next_residual(captured):
    """Alg. 1's block step (mfpipe.experiments.rollout.algorithm.block_update) at every position's own residual and
    own reads: the model's next residual, position by position."""
    _, adapter, _, caps, final = captured
    for layer, cap in enumerate(caps):
        c = cap.resid_in.reshape(-1, adapter.d_model)
        reads = cap.reads.reshape(c.shape[0], adapter.n_heads, adapter.d_head)
        got = R.block_update(adapter, layer, c, reads)
        torch.testing.assert_close(got, _next(caps, final, layer).reshape(c.shape), rtol=1e-5, atol=1e-5)


def test_the_divergence_stages_end_where_the_block_update_does(captured):
    """mfpipe.experiments.rollout.divergence.block_stages on a kernel: its ``out`` equals block_update's bit for bit;
    where the block joins in its own form, ``mid`` is what the MLP's norm reads and the MLP applied to it is the
    block's MLP branch."""
    mt, adapter, _, caps, _ = captured
    gen = torch.Generator().manual_seed(5)
    N, K = 5, 7
    kernel = torch.softmax(torch.randn(adapter.n_heads, N, K, generator=gen), -1).numpy()
    x = caps[0].resid_in[0, 1:N + 1]
    b = caps[0].resid_in[0, 0]
    mid, mlp_in, out = block_stages(adapter, 0, kernel, b, x)
    reads = R.head_reads(adapter, 0, kernel, x, b)
    assert torch.equal(out, R.block_update(adapter, 0, x, reads))
    if mt == "doge":
        assert torch.equal(mid, mlp_in)
        block = adapter.block_module(0)
        a = R.attention_output(adapter, 0, reads, bias=True, at=x)
        torch.testing.assert_close(mid, block.input_residual * x + a, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out, block.post_attention_residual * mid + adapter.mlp(0, mid), rtol=1e-5,
                                   atol=1e-6)


@pytest.mark.parametrize("mt", POST_NORM)
def test_the_embedding_piece_with_a_position_row_is_block_0s_input(mt):
    """``embed(ids, offset=W_pos[p])``: the scaled embedding plus the position row, through TrOCR's embedding norm
    (GPT-1: none), is what block 0 reads at position p."""
    adapter, ids, caps, _ = _captured(make_tiny_model(mt, seed=3))
    table = adapter.position_table()
    for p in range(ids.shape[1]):
        torch.testing.assert_close(adapter.embed(ids[:, p], offset=table[p]), caps[0].resid_in[:, p], rtol=1e-5,
                                   atol=1e-5)


def test_a_closing_norm_of_another_form_is_run_by_the_block():
    """GPT-1 with each ln_2 handed half its input (a norm of neither the plain sum nor ln_1's output plus the MLP
    branch) is placed as a join of the block's own, and the rollout's block step still rebuilds every block."""
    model = make_tiny_model("openai-gpt", seed=3)
    for block in model.transformer.h:
        block.ln_2.register_forward_pre_hook(lambda m, args: (args[0] * 0.5 + 0.25,))
    adapter, _, caps, final = _captured(model)
    assert adapter.structure.join == "model" and adapter.structure.block_norm is None
    for layer, cap in enumerate(caps):
        c = cap.resid_in.reshape(-1, adapter.d_model)
        got = R.block_update(adapter, layer, c, cap.reads.reshape(c.shape[0], adapter.n_heads, adapter.d_head))
        torch.testing.assert_close(got, _next(caps, final, layer).reshape(c.shape), rtol=1e-5, atol=1e-5)


def test_a_join_of_the_blocks_own_is_refused_where_the_attentions_output_is_not_its_branch():
    """GIT's blocks with each output.LayerNorm handed half its input (a closing norm of another form, a join the block
    would run): run_block replaces the attention's output by the branch, but GIT's attention proper returns the reads
    (its projection sits beside it), so the placement refuses it, saying why, rather than run the projection twice."""
    model = make_tiny_model("git", seed=3)
    for block in model.git.encoder.layer:
        block.output.LayerNorm.register_forward_pre_hook(lambda m, args: (args[0] * 0.5 + 0.25,))
    with pytest.raises(UnsupportedArchitectureError, match="its attention's output is not its branch"):
        describe(model)


def test_a_join_that_reads_other_positions_is_refused():
    """A Doge whose MLP branch also adds the previous position's MLP input (a mixing over positions outside the
    attention, as Inkling's convolutions are) is refused: run one position at a time, its blocks would not be the
    model's."""
    model = make_tiny_model("doge", seed=3)
    for block in model.model.layers:
        block.mlp.register_forward_hook(lambda m, args, out: out + torch.roll(args[0], 1, dims=1))
    with pytest.raises(UnsupportedArchitectureError, match="depends on more than that position's residual"):
        describe(model)


def test_an_adapter_of_a_given_structure_asks_gpt1s_attention_for_its_probabilities():
    """An adapter built from a structure given (not placed on this model object: conformance's deliberate
    misplacements, a structure kept) still reads GPT-1's probabilities: the adapter asks the attention itself."""
    from mfpipe.models.adapters import Adapter

    structure = describe(make_tiny_model("openai-gpt", seed=3))  # placed on another copy: its hooks are that copy's
    adapter = Adapter(make_tiny_model("openai-gpt", seed=3), structure)
    caps = []
    adapter.capture(torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(1)), caps.append)
    assert all(torch.allclose(c.attn_probs.sum(-1), torch.ones(())) for c in caps)


# ------------------------------------------------------------------ an input of each token (Gemma-4's per-layer inputs)
@pytest.fixture(scope="module")
def ple():
    """A tiny Gemma-4 text model of its default config, shrunk as the census shrinks it: its blocks add a per-layer
    input of each token after the MLP (PLE, ``hidden_size_per_layer_input``), with a norm of its own, then scale."""
    from mfpipe.models.defaults import default_config
    from mfpipe.models.tiny import random_model, shrink_config

    config = shrink_config(default_config("gemma4_text"))
    assert config.hidden_size_per_layer_input and not config.num_kv_shared_layers
    return _captured(random_model(config, seed=3))


def test_a_per_token_input_is_placed_as_a_join_the_block_runs_with_each_rows_token(ple):
    """The placement finds the per-layer input's norm outside the two branches' places and lets the block run its
    join; each block, run on every position alone with its token (run_block's ids), is the model's next residual, and
    with another token's input it is not; without ids it is refused with a line that says why."""
    from mfpipe.models.adapters.calls import reads_tokens

    adapter, ids, caps, final = ple
    assert adapter.structure.join == "model" and adapter.structure.final_norm == "norm"
    blocks = [adapter.block_module(l) for l in range(adapter.n_layers)]
    assert reads_tokens(adapter.base, blocks, adapter.device)
    flat = ids.reshape(-1)
    for layer, cap in enumerate(caps):
        x = cap.resid_in.reshape(-1, adapter.d_model)
        # what the attention returns: its output projection's (cap.attn_out is past the post-attention norm)
        a = R.attention_output(adapter, layer, cap.reads.reshape(x.shape[0], adapter.n_heads, adapter.d_head))
        want = _next(caps, final, layer).reshape(x.shape)
        torch.testing.assert_close(run_block(adapter, layer, x, a, ids=flat)[1], want, rtol=1e-5, atol=1e-5)
        other = run_block(adapter, layer, x, a, ids=(flat + 1) % adapter.config.vocab_size)[1]
        assert float((other - want).abs().max()) > 1e-3
    with pytest.raises(ValueError, match="needs the rows' token ids"):
        run_block(adapter, 0, x, a)


def test_the_rollouts_block_step_takes_each_centroids_token_from_its_setup(ple):
    """Alg. 1's block step inside R.on_types (what every rollout over a setup runs under): each row run with its
    type's token, the model's next residual at the model's own reads; the divergence stages end where it does."""
    from types import SimpleNamespace

    adapter, ids, caps, final = ple
    setup = SimpleNamespace(type_ids=ids.reshape(-1).numpy())
    for layer, cap in enumerate(caps):
        c = cap.resid_in.reshape(-1, adapter.d_model)
        reads = cap.reads.reshape(c.shape[0], adapter.n_heads, adapter.d_head)
        got = R.on_types(lambda a, s: R.block_update(a, layer, c, reads))(adapter, setup)
        torch.testing.assert_close(got, _next(caps, final, layer).reshape(c.shape), rtol=1e-5, atol=1e-5)
    kernel = torch.softmax(torch.randn(adapter.n_heads, c.shape[0], c.shape[0] + 2,
                                       generator=torch.Generator().manual_seed(5)), -1).numpy()
    x, b = caps[0].resid_in.reshape(-1, adapter.d_model), caps[0].resid_in[0, 0]
    stages = R.on_types(lambda a, s: block_stages(a, 0, kernel, b, x))(adapter, setup)
    want = R.on_types(lambda a, s: R.block_update(a, 0, x, R.head_reads(a, 0, kernel, x, b)))(adapter, setup)
    assert torch.equal(stages[2], want)
