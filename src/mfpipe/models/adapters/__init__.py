"""Per-architecture adapters: the ONE place in mfpipe that knows module paths.

* ``base.py`` — :class:`Adapter`: shapes, module access and the block pieces (embed, value_map,
  out_proj_slices, post_attn_norm, mlp, final_norm ...) used by the rollout.
* ``site.py`` — the read/patch site mixed into every adapter: :meth:`Adapter.run` (one nnsight-traced
  forward that reads the selected :class:`LayerCapture` fields, replaces per-head reads at the output
  projection's input, and returns logits / loss) and :meth:`Adapter.capture` (all fields, no LM head).
* ``architectures.py`` — one subclass per supported HF ``model_type`` and :func:`get_adapter`.

Supported HF ``model_type``s: gpt2, gpt_neox, llama, qwen3, gemma2, olmo2. Anything else raises
:class:`UnsupportedArchitectureError`.
"""

from mfpipe.models.adapters.architectures import (
    SUPPORTED_MODEL_TYPES,
    UnsupportedArchitectureError,
    get_adapter,
)
from mfpipe.models.adapters.base import Adapter, NormForm
from mfpipe.models.adapters.site import CAPTURE_FIELDS, LayerCapture, RunResult, resolve_select

__all__ = [
    "CAPTURE_FIELDS",
    "SUPPORTED_MODEL_TYPES",
    "Adapter",
    "LayerCapture",
    "NormForm",
    "RunResult",
    "UnsupportedArchitectureError",
    "get_adapter",
    "resolve_select",
]
