"""Tiny random models of the verified architectures, for tests: the recipes live in :mod:`mfpipe.models.tiny` (the
conformance command builds the same kind of model); and a tiny Inkling (:func:`tiny_inkling`), its default config
shrunk, for the tests of its short convolutions."""

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
