"""Tiny random models of the supported architectures, for tests.

``make_tiny_model(model_type, seed=0, **overrides)`` builds a seeded, float32, eager-attention
``*ForCausalLM`` from its ``transformers`` config class (2 layers, d=64, 4 heads, 2 KV heads where the
architecture has grouped-query attention, vocab 128), in eval mode, with every parameter perturbed by
small seeded noise so that biases and norm weights are non-trivial (HF initialises them to 0 / 1, which
would hide a missing bias or norm in a test). Config fields can be overridden by keyword.
"""

from __future__ import annotations

import torch
import transformers

TINY_MODEL_TYPES: tuple[str, ...] = ("gpt2", "gpt_neox", "llama", "qwen3", "gemma2", "olmo2")

VOCAB = 128
D_MODEL = 64
N_HEADS = 4
N_KV_HEADS = 2
N_LAYERS = 2
MAX_POS = 128


def _base_config(model_type: str) -> tuple[type, dict]:
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
    raise ValueError(f"no tiny model recipe for model_type {model_type!r}; known: {TINY_MODEL_TYPES}")


def make_tiny_config(model_type: str, **overrides):
    """The config `make_tiny_model` would use (eager attention), with ``overrides`` applied."""
    cls, kw = _base_config(model_type)
    kw.update(overrides)
    n_layers = kw.get("num_hidden_layers", kw.get("n_layer"))
    if model_type == "gemma2" and "layer_types" not in overrides:
        kw["layer_types"] = [("sliding_attention", "full_attention")[i % 2] for i in range(n_layers)]
    config = cls(**kw)
    config._attn_implementation = "eager"
    return config


def make_tiny_model(model_type: str, seed: int = 0, noise: float = 0.05, **overrides):
    """A seeded tiny random causal LM of ``model_type`` (float32, eager attention, eval mode).

    ``noise``: std of the seeded Gaussian perturbation added to every parameter after HF init
    (0 keeps the plain HF init).
    """
    config = make_tiny_config(model_type, **overrides)
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
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=gen)
    if bos is not None:
        ids[:, 0] = bos
    return ids
