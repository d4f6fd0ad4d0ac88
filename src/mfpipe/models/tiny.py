"""Tiny random models: the recipes of the verified architectures, and a shrunk copy of any config.

``make_tiny_model(model_type, seed=0, **overrides)`` builds a seeded, float32, eager-attention
``*ForCausalLM`` from its ``transformers`` config class (2 layers, d=64, 4 heads, 2 KV heads where the
architecture has grouped-query attention, vocab 128), in eval mode, with every parameter perturbed by
small seeded noise so that biases and norm weights are non-trivial (HF initialises them to 0 / 1, which
would hide a missing bias or norm in a test). Config fields can be overridden by keyword.
:data:`VERIFIED_MODEL_TYPES` are the types with a recipe here: the test suite checks each of them against
brute-force references on every commit. :func:`shrink_config` makes the same kind of tiny copy of any
model's config (same ``model_type``, shrunk sizes; :mod:`mfpipe.models.shrink`, re-exported here): what
``mfpipe conformance`` and ``mfpipe census`` run on.
"""

from __future__ import annotations

from mfpipe.models.shrink import MAX_POS, shrink_config  # noqa: F401 (re-exported: the tiny copy of any config)


# the paper's six architectures, then the families placed by structure (issue 30)
PAPER_MODEL_TYPES: tuple[str, ...] = ("gpt2", "gpt_neox", "llama", "qwen3", "gemma2", "olmo2")
NEW_MODEL_TYPES: tuple[str, ...] = ("mistral", "qwen2", "phi3", "gptj", "gemma", "gemma3_text", "stablelm")
# the failure classes of the census placed (issue 48): blocks one level down and an MLP of three modules (OPT), a
# fused multi-query / grouped value layout (Falcon), a mixture of experts (Mixtral), a LayerNorm without a bias and a
# logit scale (Cohere), a fused projection in four shards (CodeGen); issue 59: multi-head latent attention (DeepSeek-V3),
# the residual added inside the attention and the MLP modules (BLOOM's fused dropout_add), values scaled by a constant,
# with attention layers of two kinds (MiMo-V2-Flash: mfpipe.models.adapters.layers), an attention sink applied as a
# factor of the reads that the returned probabilities leave out (Granite-SWA's, dense and a mixture of experts),
# block 0's attention norm the identity (ModernBERT-decoder); Gemma-4's values normed per head, its full layers' heads twice as wide, their keys their values (attention_k_eq_v);
# post-norm blocks, ln_2(ln_1(x + a) + mlp), with an attention that returns its probabilities only when asked (GPT-1)
# and with a norm on the embedding plus its position rows (TrOCR's decoder); branches joined in a form of the block's
# own, learned vectors times the residual (Doge: mfpipe.models.adapters.joins); BERT's post-norm, each norm inside the
# branch's output module with the residual it adds, the embedding beside the blocks' module (GIT's text decoder)
PLACED_MODEL_TYPES: tuple[str, ...] = ("opt", "falcon", "mixtral", "cohere", "codegen", "deepseek_v3", "bloom",
                                       "mimo_v2_flash", "granite_swa", "granitemoe_swa", "modernbert-decoder",
                                       "gemma4_text", "openai-gpt", "trocr", "doge", "git")
# issue 59: a multimodal composite placed through its language model (Gemma-3: the text model beside a SigLIP tower)
COMPOSITE_MODEL_TYPES: tuple[str, ...] = ("gemma3",)
VERIFIED_MODEL_TYPES: tuple[str, ...] = PAPER_MODEL_TYPES + NEW_MODEL_TYPES + PLACED_MODEL_TYPES + COMPOSITE_MODEL_TYPES
TINY_MODEL_TYPES = PAPER_MODEL_TYPES  # the six every test parametrizes over (the new ones: tests/test_families.py)

VOCAB = 128
D_MODEL = 64
N_HEADS = 4
N_KV_HEADS = 2
N_LAYERS = 2


def _base_config(model_type: str) -> tuple[type, dict]:
    import transformers

    common_rope = dict(
        hidden_size=D_MODEL,
        intermediate_size=4 * D_MODEL,
        num_hidden_layers=N_LAYERS,
        num_attention_heads=N_HEADS,
        vocab_size=VOCAB,
        max_position_embeddings=MAX_POS,
        initializer_range=0.1,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if model_type == "gpt2":
        return transformers.GPT2Config, dict(
            n_layer=N_LAYERS,
            n_embd=D_MODEL,
            n_head=N_HEADS,
            n_positions=MAX_POS,
            vocab_size=VOCAB,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            initializer_range=0.1,
            bos_token_id=VOCAB - 1,
            eos_token_id=VOCAB - 1,
        )
    if model_type == "gpt_neox":
        return transformers.GPTNeoXConfig, dict(
            common_rope,
            use_parallel_residual=True,
            attention_bias=True,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            tie_word_embeddings=False,
        )
    head_dim = D_MODEL // N_HEADS
    if model_type == "llama":
        return transformers.LlamaConfig, dict(common_rope, num_key_value_heads=N_KV_HEADS, head_dim=head_dim)
    if model_type == "qwen3":
        return transformers.Qwen3Config, dict(common_rope, num_key_value_heads=N_KV_HEADS, head_dim=head_dim)
    if model_type == "gemma2":
        return transformers.Gemma2Config, dict(
            common_rope,
            num_key_value_heads=N_KV_HEADS,
            head_dim=head_dim,
            query_pre_attn_scalar=head_dim,
            layer_types=["sliding_attention", "full_attention"][:N_LAYERS],
        )
    if model_type == "olmo2":
        return transformers.Olmo2Config, dict(common_rope, num_key_value_heads=N_KV_HEADS)
    gqa = dict(common_rope, num_key_value_heads=N_KV_HEADS, head_dim=head_dim)
    if model_type == "mistral":
        return transformers.MistralConfig, dict(gqa, sliding_window=None)
    if model_type == "qwen2":  # biases on q, k, v
        return transformers.Qwen2Config, {k: v for k, v in gqa.items() if k != "head_dim"}
    if model_type == "phi3":  # fused qkv_proj, fused gate_up_proj, partial rotary
        return transformers.Phi3Config, dict({k: v for k, v in gqa.items() if k != "head_dim"},
                                             partial_rotary_factor=0.5, resid_pdrop=0.0, embd_pdrop=0.0,
                                             attention_dropout=0.0, original_max_position_embeddings=MAX_POS)
    if model_type == "gptj":  # parallel attention and MLP reading one norm, partial interleaved rotary
        return transformers.GPTJConfig, dict(
            n_embd=D_MODEL, n_layer=N_LAYERS, n_head=N_HEADS, n_positions=MAX_POS, vocab_size=VOCAB, rotary_dim=8,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, initializer_range=0.1, bos_token_id=VOCAB - 1,
            eos_token_id=VOCAB - 1, tie_word_embeddings=False)
    if model_type == "gemma":  # RMS norms by 1 + weight, embedding scaled by sqrt(d)
        return transformers.GemmaConfig, gqa
    if model_type == "gemma3_text":  # + q/k norms, pre- and post-feedforward norms, local/global layers
        return transformers.Gemma3TextConfig, dict(gqa, query_pre_attn_scalar=head_dim, sliding_window=4,
                                                   layer_types=["sliding_attention", "full_attention"][:N_LAYERS])
    if model_type == "stablelm":  # LayerNorms, partial rotary; parallel residual as an option
        return transformers.StableLmConfig, dict({k: v for k, v in gqa.items() if k != "head_dim"},
                                                 partial_rotary_factor=0.25, hidden_dropout=0.0,
                                                 attention_dropout=0.0)
    placed = _placed_config(model_type, common_rope, gqa) or _join_config(model_type, gqa)
    if placed is not None:
        return placed
    raise ValueError(f"no tiny model recipe for model_type {model_type!r}; known: {VERIFIED_MODEL_TYPES}")


def _placed_config(model_type: str, common_rope: dict, gqa: dict) -> tuple[type, dict] | None:
    """The recipes of :data:`PLACED_MODEL_TYPES` and :data:`COMPOSITE_MODEL_TYPES` (their variants by override: Falcon's
    ``new_decoder_architecture=True, num_kv_heads=2`` grouped layout, ``multi_query=False`` per-head layout)."""
    import transformers

    if model_type == "opt":  # blocks in decoder.layers, position table from row 2, MLP = fc1, activation_fn, fc2
        return transformers.OPTConfig, dict(
            vocab_size=VOCAB, hidden_size=D_MODEL, num_hidden_layers=N_LAYERS, num_attention_heads=N_HEADS,
            ffn_dim=2 * D_MODEL, word_embed_proj_dim=D_MODEL, max_position_embeddings=MAX_POS, dropout=0.0,
            attention_dropout=0.0, activation_dropout=0.0, layerdrop=0.0, init_std=0.1, bos_token_id=VOCAB - 1,
            eos_token_id=VOCAB - 1, pad_token_id=0)
    if model_type == "falcon":  # fused query_key_value, multi-query [q.. | k | v]; parallel attention and MLP
        return transformers.FalconConfig, dict(
            vocab_size=VOCAB, hidden_size=D_MODEL, num_hidden_layers=N_LAYERS, num_attention_heads=N_HEADS,
            max_position_embeddings=MAX_POS, hidden_dropout=0.0, attention_dropout=0.0, initializer_range=0.1,
            bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1)
    if model_type == "mixtral":  # a mixture of 4 experts, 2 per token
        return transformers.MixtralConfig, dict({k: v for k, v in gqa.items() if k != "head_dim"},
                                                intermediate_size=2 * D_MODEL, num_local_experts=4,
                                                num_experts_per_tok=2, sliding_window=None)
    if model_type == "cohere":  # LayerNorm without bias, parallel attention and MLP, logits scaled
        return transformers.CohereConfig, dict({k: v for k, v in gqa.items() if k != "head_dim"},
                                               intermediate_size=2 * D_MODEL, logit_scale=0.125)
    if model_type == "codegen":  # fused qkv_proj in four shards [q | v | k], partial rotary
        return transformers.CodeGenConfig, dict(
            vocab_size=VOCAB, n_embd=D_MODEL, n_layer=N_LAYERS, n_head=N_HEADS, n_positions=MAX_POS, n_ctx=MAX_POS,
            rotary_dim=8, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, initializer_range=0.1,
            bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1, tie_word_embeddings=False)
    if model_type == "deepseek_v3":  # latent attention: values decompressed by kv_b_proj from a normed latent, 8 wide
        # per head (the query/key heads 12 + 4 rotary; the config's head_dim is the rotary 4); a dense first block, then
        # 4 routed experts (2 per token) and a shared one; biases on the latent projections and the output projection
        return transformers.DeepseekV3Config, dict(
            common_rope, intermediate_size=2 * D_MODEL, moe_intermediate_size=D_MODEL // 2,
            num_key_value_heads=N_HEADS, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=12, qk_rope_head_dim=4,
            v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
            first_k_dense_replace=1, attention_bias=True)
    if model_type == "bloom":  # attention and MLP return their branch plus the residual; ALiBi; a norm on the embedding
        return transformers.BloomConfig, dict(
            vocab_size=VOCAB, hidden_size=D_MODEL, n_layer=N_LAYERS, n_head=N_HEADS, hidden_dropout=0.0,
            attention_dropout=0.0, initializer_range=0.1, bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1, pad_token_id=0)
    if model_type == "mimo_v2_flash":  # values times v_scale (0.6); layer 0 full attention, layer 1 a sliding window
        # of 4 with twice the KV heads and sinks; queries/keys 24 wide per head (a third rotary), values 16; a dense
        # first block, then 4 routed experts (2 per token)
        return transformers.MiMoV2FlashConfig, dict(
            gqa, head_dim=24, v_head_dim=16, sliding_window=4, attention_value_scale=0.6, intermediate_size=2 * D_MODEL,
            moe_intermediate_size=D_MODEL // 2, n_routed_experts=4, num_experts_per_tok=2)
    if model_type in ("granite_swa", "granitemoe_swa"):  # reads times sigmoid(logsumexp(scores) - sink); full and
        # sliding layers; the MoE one with 4 experts, 2 per token
        swa = dict({k: v for k, v in gqa.items() if k != "head_dim"}, sliding_window=4, attention_multiplier=0.25)
        if model_type == "granite_swa":
            return transformers.GraniteSWAConfig, swa
        return transformers.GraniteMoeSWAConfig, dict(swa, intermediate_size=2 * D_MODEL, num_local_experts=4,
                                                      num_experts_per_tok=2)
    if model_type == "modernbert-decoder":  # block 0's attention norm the identity (block 1's a LayerNorm); the
        # embedding and its norm in a module of their own; a prediction head (dense, GELU, norm) before the
        # unembedding; layer 0 full attention, layer 1 a window of 4 (local_attention / 2)
        return transformers.ModernBertDecoderConfig, dict(
            vocab_size=VOCAB, hidden_size=D_MODEL, intermediate_size=2 * D_MODEL, num_hidden_layers=N_LAYERS,
            num_attention_heads=N_HEADS, max_position_embeddings=MAX_POS, local_attention=8, initializer_range=0.1,
            bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1, pad_token_id=0, cls_token_id=VOCAB - 1,
            sep_token_id=VOCAB - 1)
    if model_type == "gemma4_text":  # values v_norm (a scale-less RMS norm per head) of v_proj; layer 1 full attention
        # with heads 32 wide, one KV head and its keys' projection its values' (attention_k_eq_v); no per-layer input
        return transformers.Gemma4TextConfig, dict(
            gqa, global_head_dim=2 * gqa["head_dim"], attention_k_eq_v=True, num_global_key_value_heads=1,
            layer_types=["sliding_attention", "full_attention"], sliding_window=4, hidden_size_per_layer_input=0,
            intermediate_size=2 * D_MODEL)
    if model_type == "gemma3":  # the composite: a tiny Gemma-3 text model and a one-layer SigLIP tower (never run)
        return transformers.Gemma3Config, dict(
            text_config=make_tiny_config("gemma3_text").to_dict(), mm_tokens_per_image=4,
            vision_config=dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64,
                               num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14))
    return None


def make_tiny_config(model_type: str, **overrides):
    """The config `make_tiny_model` would use (eager attention), with ``overrides`` applied."""
    cls, kw = _base_config(model_type)
    kw.update(overrides)
    n_layers = kw.get("num_hidden_layers", kw.get("n_layer"))
    if model_type in ("gemma2", "gemma3_text") and "layer_types" not in overrides:
        kw["layer_types"] = [("sliding_attention", "full_attention")[i % 2] for i in range(n_layers)]
    config = cls(**kw)
    config._attn_implementation = "eager"
    return config


def make_tiny_model(model_type: str, seed: int = 0, noise: float = 0.05, **overrides):
    """A seeded tiny random causal LM of ``model_type`` (float32, eager attention, eval mode).

    ``noise``: std of the seeded Gaussian perturbation added to every parameter after HF init
    (0 keeps the plain HF init).
    """
    return random_model(make_tiny_config(model_type, **overrides), seed=seed, noise=noise)


# 4 GB in float32: the verified recipes are ~0.1 M; since issue 59 shrink_config's copies of every family's default
# config are below 12 M (the largest: Phi-4-multimodal's towers); a config with size fields it does not know could be
# far larger (before issue 59, MPT's and LongCat's: 1.2 G and 7.8 G)
MAX_TINY_PARAMETERS = 1_000_000_000


def meta_parameter_count(config) -> int:
    """The parameter count of the causal LM ``config`` builds, counted on the meta device (no memory, no time): a
    config whose size fields :func:`shrink_config` does not know stays large, and building it for real could
    exhaust the machine's memory (``mfpipe census`` and the planning's conformance check refuse it)."""
    import torch
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    return sum(p.numel() for p in model.parameters())


def random_model(config, seed: int = 0, noise: float = 0.05):
    """A seeded random causal LM of ``config`` (float32, eager attention, eval mode; see :func:`make_tiny_model`)."""
    import torch
    import transformers

    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager", dtype=torch.float32
    )
    if noise:
        gen = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(noise * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    model.eval()
    return model


def random_ids(batch: int = 2, seq: int = 16, vocab: int = VOCAB, seed: int = 0, bos: int | None = None):
    """Seeded random token ids ``[batch, seq]``; position 0 set to ``bos`` when given."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=gen)
    if bos is not None:
        ids[:, 0] = bos
    return ids


def _join_config(model_type: str, gqa: dict) -> tuple[type, dict] | None:
    """The recipes of the families of :data:`PLACED_MODEL_TYPES` whose blocks join their branches otherwise than by a
    sum: post-norm (GPT-1, TrOCR's decoder, GIT's), the block's own form (Doge)."""
    import transformers

    if model_type == "openai-gpt":  # post-norm blocks; Conv1D c_attn; a learned position table; no final norm
        return transformers.OpenAIGPTConfig, dict(
            vocab_size=VOCAB, n_positions=MAX_POS, n_embd=D_MODEL, n_layer=N_LAYERS, n_head=N_HEADS, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0, initializer_range=0.1, bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1)
    if model_type == "trocr":  # post-norm blocks; the embedding scaled by sqrt(d), plus position rows from row 2,
        # through layernorm_embedding; no final norm (the image encoder's cross-attention idle on text alone)
        return transformers.TrOCRConfig, dict(
            vocab_size=VOCAB, d_model=D_MODEL, decoder_layers=N_LAYERS, decoder_attention_heads=N_HEADS,
            decoder_ffn_dim=2 * D_MODEL, max_position_embeddings=MAX_POS, dropout=0.0, attention_dropout=0.0,
            activation_dropout=0.0, decoder_layerdrop=0.0, init_std=0.1, scale_embedding=True,
            layernorm_embedding=True, use_learned_position_embeddings=True, bos_token_id=VOCAB - 1,
            eos_token_id=VOCAB - 1, pad_token_id=0, decoder_start_token_id=VOCAB - 1)
    if model_type == "git":  # BERT's post-norm: the residual added and normed inside the attention's and the MLP's
        # output modules, the projection beside the attention proper; the embedding with its position table and norm
        # beside the blocks' module (a tiny image tower, idle on text alone); no final norm
        return transformers.GitConfig, dict(
            vocab_size=VOCAB, hidden_size=D_MODEL, num_hidden_layers=N_LAYERS, num_attention_heads=N_HEADS,
            intermediate_size=2 * D_MODEL, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
            max_position_embeddings=MAX_POS, initializer_range=0.1, bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1,
            pad_token_id=0, vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                               num_attention_heads=2, image_size=16, patch_size=8))
    if model_type == "doge":  # mid = input_residual ⊙ x + attn, out = post_attention_residual ⊙ mid + mlp (their
        # vectors drawn at random by random_model, not the ones Doge starts from); a dynamic mask keeps 8 keys
        return transformers.DogeConfig, dict({k: v for k, v in gqa.items() if k != "head_dim"},
                                             intermediate_size=2 * D_MODEL, keep_window_size=8, hidden_dropout=0.0)
    return None
