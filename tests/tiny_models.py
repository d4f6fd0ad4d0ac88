"""Tiny random models of the verified architectures, for tests: the recipes live in :mod:`mfpipe.models.tiny` (the
conformance command builds the same kind of model); and a tiny Inkling (:func:`tiny_inkling`), its default config
shrunk, for the tests of its short convolutions; a tiny Zaya (:func:`tiny_zaya`); a tiny Granite-4.0-H
(:func:`tiny_granite_hybrid`: a mixture of experts beside a shared MLP, summed)."""

from mfpipe.models.tiny import (  # noqa: F401
    COMPOSITE_MODEL_TYPES,
    D_MODEL,
    N_HEADS,
    N_KV_HEADS,
    N_LAYERS,
    NEW_MODEL_TYPES,
    PLACED_MODEL_TYPES,
    TINY_MODEL_TYPES,
    VERIFIED_MODEL_TYPES,
    VOCAB,
    make_tiny_config,
    make_tiny_model,
    random_ids,
)


def tiny_zaya(seed: int = 3, **overrides):
    """A tiny Zaya (issue 59): its default config shrunk (mfpipe.models.tiny.shrink_config) to two blocks, its router
    state 32 wide: the embedding enters as ``(e + b) * s`` (mfpipe.models.adapters.residual.affine_candidates), its CCA
    projection returns the values, half of its KV heads the previous position's (adapters.returned), its blocks scale
    both terms of each residual sum (a join of their own: adapters.joins) and hand the next block their router state
    (adapters.calls.with_carried); ``overrides`` set on the config."""
    from mfpipe.models.defaults import default_config
    from mfpipe.models.tiny import random_model, shrink_config

    cfg = shrink_config(default_config("zaya"))
    cfg.router_hidden_size = 32
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return random_model(cfg, seed=seed)


def tiny_jamba(seed: int = 3):
    """A tiny Jamba (issue 59, a hybrid): Mamba blocks at layers 0 and 2, attention blocks with 4 experts at 1 and 3."""
    from stats_reference import BOS, VOCAB
    from transformers import JambaConfig

    from mfpipe.models.tiny import random_model

    cfg = JambaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, attn_layer_period=2, attn_layer_offset=1,
                      expert_layer_period=2, expert_layer_offset=1, num_experts=4, num_experts_per_tok=2,
                      mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=8, max_position_embeddings=128,
                      use_mamba_kernels=False, bos_token_id=BOS, eos_token_id=None, pad_token_id=None,
                      tie_word_embeddings=False)
    cfg._attn_implementation = "eager"
    return random_model(cfg, seed=seed)


def tiny_granite_hybrid(seed: int = 3, **overrides):
    """A tiny Granite-4.0-H (GraniteMoeHybrid): Mamba blocks at layers 0 and 2, an attention block at 1 (its default
    config is Mamba throughout; its checkpoints set ``layer_types``), every block's MLP branch ``block_sparse_moe(h) +
    shared_mlp(h)`` (4 experts, 2 a token; mfpipe.models.adapters.residual.mlp_siblings), both branches times
    ``residual_multiplier`` 0.5, the embedding times 12 and the logits divided by 8 (its checkpoints' numbers, 1 in its
    default config: mfpipe.models.adapters.residual.embed_scale); ``overrides`` set on the config before it is
    built."""
    from transformers import GraniteMoeHybridConfig

    from mfpipe.models.tiny import random_model

    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, shared_intermediate_size=96, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
              layer_types=["mamba", "attention", "mamba"], mamba_n_heads=8, mamba_d_state=8, mamba_d_head=16,
              mamba_chunk_size=16, residual_multiplier=0.5, embedding_multiplier=12.0, logits_scaling=8.0,
              max_position_embeddings=128, tie_word_embeddings=False)
    cfg = GraniteMoeHybridConfig(**(kw | overrides))
    cfg._attn_implementation = "eager"
    return random_model(cfg, seed=seed)


def tiny_inkling(seed: int = 3, **overrides):
    """A tiny Inkling (issue 59: short convolutions over positions, mfpipe.models.adapters.convolved): its default
    config shrunk (mfpipe.models.tiny.shrink_config) to two blocks, a sliding-window one with a dense MLP and twice the
    KV heads (as its released config's: 16 against 8), a full one with experts; ``overrides`` set on the config."""
    from mfpipe.models.defaults import default_config
    from mfpipe.models.tiny import random_model, shrink_config

    cfg = shrink_config(default_config("inkling_text"))
    cfg.num_hidden_layers, cfg.layer_types, cfg.mlp_layer_types = 2, ["hybrid_sliding", "hybrid"], ["dense", "sparse"]
    cfg.swa_num_key_value_heads = 2 * cfg.num_key_value_heads
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return random_model(cfg, seed=seed)
