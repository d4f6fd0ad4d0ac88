"""What the read/patch site (:mod:`~mfpipe.models.adapters.site`) hands out and takes: one layer's activations
(:class:`LayerCapture`, its fields :data:`CAPTURE_FIELDS`), a run's logits and loss (:class:`RunResult`), the choice of
fields to read (:func:`resolve_select`) and the callbacks' types, and :func:`module_at`, a module (or an nnsight envoy)
by its dotted path (:func:`path_within`: such a path from a module below it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields

from torch import Tensor

__all__ = ["CAPTURE_FIELDS", "LayerCapture", "first_output", "hidden_input", "PatchOut", "PatchReads", "PatchResid", "RunResult", "Select",
           "module_at", "path_within", "resolve_select"]


@dataclass
class LayerCapture:
    """One layer's activations from :meth:`TracedSite.run` / ``capture`` (float32; do not modify in
    place: for float32 models they are views of the model's own activations).

    Shapes: B batch, T positions, H query heads, dh head width, d model width. A field that was not
    selected is ``None``. Under ``patch_reads`` / ``patch_out``, ``reads`` is what attention computed (before
    the replacement); every field downstream of the output projection (``attn_out``, ``resid_mid``,
    ``mlp_out``, later layers) reflects the patched forward.
    """

    layer: int
    resid_in: Tensor | None = None  # [B,T,d] residual stream entering block `layer`
    attn_probs: Tensor | None = None  # [B,H,T,T] attention probabilities (query, key)
    values: Tensor | None = None  # [B,H,T,dh] per-head values (head space, before the output projection), GQA expanded
    reads: Tensor | None = None  # [B,T,H,dh] per-head read = probs x values (output projection's input, over a gate)
    attn_out: Tensor | None = None  # [B,T,d] what the attention branch adds to the residual (after post-attn norm if any)
    resid_mid: Tensor | None = None  # [B,T,d] resid_in + attn_out
    mlp_out: Tensor | None = None  # [B,T,d] what the MLP branch adds to the residual (after post-ff norm if any)


CAPTURE_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(LayerCapture) if f.name != "layer")


@dataclass
class RunResult:
    """What :meth:`TracedSite.run` returns (float32 tensors; ``None`` where not asked for)."""

    logits: Tensor | None = None  # [B,T,V] (logits=True)
    loss: Tensor | None = None  # scalar: mean next-token cross entropy (nats) over the B*(T-1) predictions
    token_loss: Tensor | None = None  # [B,T-1]: cross entropy of predicting ids[:, i+1] at position i


Select = str | Iterable[str] | Callable[[str], bool] | None
PatchReads = Callable[[int, Tensor], Tensor | None]
PatchResid = Callable[[int, Tensor], Tensor | None]
PatchOut = Callable[[int, Tensor, Tensor], Tensor | None]


def resolve_select(select: Select) -> frozenset[str]:
    """``"all"`` → every field of :class:`LayerCapture`; ``None`` or ``()`` → none; an iterable of field
    names → those; a predicate ``name -> bool`` → the fields it accepts."""
    if select is None:
        return frozenset()
    if isinstance(select, str):
        if select == "all":
            return frozenset(CAPTURE_FIELDS)
        select = (select,)
    if callable(select):
        return frozenset(name for name in CAPTURE_FIELDS if select(name))
    chosen = frozenset(select)
    unknown = sorted(chosen - set(CAPTURE_FIELDS))
    if unknown:
        raise ValueError(
            f"unknown LayerCapture field(s) {unknown} in select; choose from {list(CAPTURE_FIELDS)} or 'all'"
        )
    return chosen


def module_at(root, path: str):
    """``root.a.b.c`` for ``path="a.b.c"`` (works on modules and on nnsight envoys: an envoy's child by its name, where
    the name is one of the envoy's own attributes: GIT's ``attention.output``, not the envoy's ``.output``)."""
    obj = root
    for part in path.split("."):
        kids = vars(obj).get("_child_map") if hasattr(obj, "__dict__") else None
        obj = kids[part] if isinstance(kids, dict) and part in kids else getattr(obj, part)
    return obj


def path_within(path: str, prefix: str) -> str | None:
    """``path`` from the module at ``prefix`` (paths from one root), or None where it lies outside it: an output
    projection in the attention (``self_attn.o_proj`` -> ``o_proj``) or beside it (GIT's ``attention.output.dense``
    beside ``attention.self``)."""
    return path[len(prefix) + 1:] if path.startswith(prefix + ".") else None


def first_output(out):
    """A module's main output: the first of a tuple or list (attention modules return ``(output, probabilities)``;
    GPT-1's return lists, most blocks a tuple) or the tensor itself."""
    return out[0] if isinstance(out, (tuple, list)) else out


def hidden_input(args: tuple, kwargs: dict) -> Tensor:
    """The hidden states a block or norm was called with (a forward pre-hook's ``args``, ``kwargs``): the first
    positional argument, else the ``hidden_states`` keyword."""
    if args:
        return args[0]
    if "hidden_states" in kwargs:
        return kwargs["hidden_states"]
    raise RuntimeError("a hooked module was called without its hidden-states input (no positional argument and no "
                       "hidden_states keyword)")
