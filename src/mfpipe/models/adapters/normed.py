"""A norm of all heads' reads together between the attention and its output projection (BitNet's ``attn_sub_norm``):
the output projection reads ``norm(z)``, ``z [..., H * dh]`` every head's read at a position laid side by side.

The norm is placed where it is of the form ``norm(z) = c(z) * (w ⊙ z)``: one factor ``c`` per position, computed of
every head's read there (an RMS norm's ``1 / rms(z)``), times a fixed weight per coordinate (its ``weight``; ones
where it has none). How mfpipe reads it, so that the paper's definitions hold as written:

* a head's read stays probabilities x values (its P, mu_t and zbar are the attention proper's): the site reads and
  replaces it at the norm's input (:meth:`~mfpipe.models.adapters.site.TracedSite.run`), so a replaced read passes
  through the model's own norm, computed again of the reads as replaced: the substitution runs what the model runs,
  and writing back a head's own read leaves the logits as they were;
* a head's write to the residual at a position is its read times the factor of that position's reads,
  ``g = c(z) w`` (:func:`reads_factor`), then its slice O_h of the output projection; the heads' writes sum to the
  projection's output (less its bias) exactly. The factor is an output gate computed of the reads rather than of the
  residual (:meth:`~mfpipe.models.adapters.gate.OutputGate.read_gate` with the reads): the J-lens agreement, the
  function vectors, the context lens and the deviation meters take the factor of each position's own reads, as the
  model does; a centroid's mean-field reads (the rollout, the statistics' ``zhat`` mapped through O_h) the factor of
  those reads, every head's together, as the model would compute it of them;
* the probe finds the norm (:func:`normed_layout`) where no value layout (gated or not) gives the output
  projection's input: the one norm of the attention whose output is that input and whose input a layout gives, of the
  form above on the probe's tensors. Nothing is named by family.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["normed_layout", "reads_factor"]


def _weight(norm: nn.Module, width: int) -> Tensor | None:
    w = getattr(norm, "weight", None)
    return w.detach() if isinstance(w, Tensor) and w.ndim == 1 and w.numel() == width else None


def reads_factor(norm: nn.Module, z: Tensor) -> Tensor:
    """The factor ``g [..., W]`` (float32) with ``norm(z) = g ⊙ z`` of the reads ``z [..., W]`` laid side by side:
    ``c(z) w``, ``c`` per row by least squares against the norm's own output (exact for a norm of the form
    ``c(z) (w ⊙ z)``, which the probe checks; 0 where every weighted read is 0)."""
    p = next(norm.parameters(), None)
    y = norm(z if p is None else z.to(p.dtype)).double()
    w = _weight(norm, z.shape[-1])
    w = torch.ones(z.shape[-1], dtype=torch.float64, device=z.device) if w is None else w.double().to(z.device)
    wz = w * z.double()
    c = (y * wz).sum(-1, keepdim=True) / (wz * wz).sum(-1, keepdim=True).clamp_min(1e-300)
    return (c * w).float()


def _of_the_form(norm: nn.Module, x: Tensor, y: Tensor, same) -> bool:
    """Whether ``y = norm(x)`` is ``c(x) (w ⊙ x)`` row by row, to the model's rounding."""
    return same(reads_factor(norm, x) * x.float(), y.float())


def normed_layout(seen: dict, attn_mod: nn.Module, same, layout) -> dict:
    """``layout(seen)`` and ``reads_norm`` None where it places the values (gated or not); else ``layout`` of the probe's
    tensors with the output projection's input taken as the input of the one norm of the attention (``<anorm>NAME``)
    whose output is that input and which is of the form ``c(z) (w ⊙ z)`` (:func:`reads_factor`), and ``reads_norm`` its
    name. Without one, the refusal of ``layout(seen)``."""
    try:
        return dict(layout(seen), reads_norm=None)
    except ValueError as e:  # UnsupportedArchitectureError (the probe imports this module: caught by its base)
        refusal = e
    o = seen["<out_proj>"]
    found = []
    for name in (n[len("<anorm>"):] for n in seen if n.startswith("<anorm>")):
        norm = seen[f"<anorm>{name}"]
        if norm.y.shape != o.x.shape or not (norm.y_obj is o.x_obj or same(norm.y, o.x)):
            continue
        if not _of_the_form(getattr(attn_mod, name), norm.x_obj.detach(), norm.y, same):
            continue
        try:
            out = layout({**seen, "<out_proj>": o._replace(x=norm.x, x_obj=norm.x_obj)})
        except ValueError:
            continue
        if out.get("gate") is None:  # a gate before the norm as well (Dory's): the norm's input would be no reads
            found.append((name, out))
    if len(found) != 1:
        raise refusal
    name, out = found[0]
    return dict(out, reads_norm=name)
