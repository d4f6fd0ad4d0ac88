"""Which adapter a model gets: :func:`get_adapter` places it by structure (:func:`~mfpipe.models.adapters.structure.
describe`) and builds the one :class:`~mfpipe.models.adapters.base.Adapter` class on that description.

No list of model types gates it: the types the test suite verifies on every commit are
``mfpipe.models.tiny.VERIFIED_MODEL_TYPES`` (kept out of this package, so that a job's code inputs do not include
the test recipes); for a model of another type the workflow runs ``mfpipe conformance`` on a tiny copy of it first
(docs/architectures.md).
"""

from __future__ import annotations

from torch import nn

from mfpipe.models.adapters.base import Adapter
from mfpipe.models.adapters.composite import language_model
from mfpipe.models.adapters.structure import UnsupportedArchitectureError, describe

__all__ = ["UnsupportedArchitectureError", "get_adapter"]


def get_adapter(model: nn.Module) -> Adapter:
    """The adapter for a loaded HF causal LM (``*ForCausalLM`` / ``GPT2LMHeadModel``) or its base model; for a
    multimodal composite (Gemma-3's ``Gemma3ForConditionalGeneration``), its language model's: the adapter's
    ``model`` is then the text-only causal LM built on the composite's own modules
    (:func:`~mfpipe.models.adapters.composite.language_model`).

    Raises :class:`UnsupportedArchitectureError` (a ValueError) naming what :func:`describe` could not place.
    """
    if getattr(getattr(model, "config", None), "model_type", None) is None:
        raise UnsupportedArchitectureError(None, f"{type(model).__name__} has no transformers config; pass a "
                                                 "transformers causal LM (e.g. from AutoModelForCausalLM)")
    model = language_model(model)
    return Adapter(model, describe(model))
