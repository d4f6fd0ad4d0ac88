"""Tiny random models of the verified architectures, for tests: the recipes live in :mod:`mfpipe.models.tiny` (the
conformance command builds the same kind of model)."""

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
