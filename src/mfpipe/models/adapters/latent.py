"""Latent attention (MLA: DeepSeek-V2/V3, MiniCPM-3, GLM-4-MoE-Lite, Youtu...): each head has its own probability row
and its own value vector, ``v_head_dim`` wide, decompressed by a projection (``kv_b_proj``) from a latent that is a
norm (``kv_a_layernorm``) of a slice of a projection of the attention's input (``kv_a_proj_with_mqa``, whose output
is ``[latent | shared rotary key]``, the norm's output times a constant where the attention rescales it: dots.3-note's
``kv_lora_scale``); one output projection reads the ``H x v_head_dim`` reads.

The values are then no affine map of the attention-input norm's output (a norm sits between), so

* the adapter's value map runs these modules as the attention runs them (:func:`latent_input`, then the value rows of
  the decompressing projection), and its ``value_weights`` is None: the statistics pass sums the values it reads at
  the site instead of deriving them from the norm's sums;
* the probe finds such a chain by what the modules read and write (:func:`latent_sources`): a projection of the
  attention whose input is what one of the attention's norms writes, whose input in turn is a contiguous slice of
  what a projection from the model width writes. The value layout is then searched among that projection's outputs
  as among any value source's (per head ``[k_nope | v]``: one chunk per head, the values at an offset).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, nn

from mfpipe.models.adapters.probe import is_norm, linear_shape, submodule

__all__ = ["Latent", "latent_input", "latent_sources"]


@dataclass(frozen=True)
class Latent:
    """Where a latent value source reads: ``norm(proj(h)[..., offset : offset + width]) * scale`` (names in the
    attention)."""

    proj: str
    offset: int
    width: int
    norm: str
    scale: float = 1.0


def _rescaled(ny: Tensor, reads: Tensor, attn_mod: nn.Module, same) -> float | None:
    """The constant ``c`` with ``ny * c == reads`` (a latent rescaled after its norm), or None where none is: the
    attention's own number where one of its float attributes is ``c`` (dots.3-note's ``kv_lora_scale``), so the value
    map multiplies by what the attention multiplies by."""
    if ny.shape != reads.shape:
        return None
    c = float((ny.double() * reads.double()).sum() / (ny.double() ** 2).sum().clamp_min(1e-300))
    own = [v for v in vars(attn_mod).values() if type(v) is float and abs(v - c) <= 1e-4 * abs(c)]
    c = own[0] if own else c
    return c if abs(c - 1) > 1e-6 and same(ny * c, reads) else None


def latent_sources(seen: dict, attn_mod: nn.Module, out_proj: str, d: int, same) -> dict[str, Latent]:
    """The attention's projections (not from width ``d``) that read a norm of a slice of a projection from ``d``, by
    the probe forward's tensors (``seen``: ``<src>NAME`` per projection, ``<anorm>NAME`` per norm of the attention;
    ``same``: equality up to the model dtype's rounding) -> name -> :class:`Latent`; a projection whose input more than
    one chain gives is left out (the value search then finds no layout in it)."""
    kids = dict(attn_mod.named_children())
    shapes = {n: linear_shape(m) for n, m in kids.items() if n != out_proj and f"<src>{n}" in seen}
    shapes = {n: s for n, s in shapes.items() if s}
    norms = [n for n, m in kids.items() if is_norm(m) and f"<anorm>{n}" in seen]
    found = {}
    for n, (r, _) in shapes.items():
        if r == d:
            continue
        reads = seen[f"<src>{n}"].x.reshape(-1, r)
        chains = []
        for norm in norms:
            nx, ny = seen[f"<anorm>{norm}"].x, seen[f"<anorm>{norm}"].y
            if nx.shape[-1] != r or ny.shape[-1] != r:
                continue
            ny = ny.reshape(-1, r)
            scale = 1.0 if same(ny, reads) else _rescaled(ny, reads, attn_mod, same)
            if scale is None:
                continue
            nx = nx.reshape(-1, r)
            for p, (p_in, p_out) in shapes.items():
                if p_in != d:
                    continue
                y = seen[f"<src>{p}"].y.reshape(-1, p_out)
                if y.shape[0] != nx.shape[0]:
                    continue
                chains += [Latent(p, o, r, norm, scale) for o in range(p_out - r + 1) if same(y[:, o : o + r], nx)]
        if len(chains) == 1:
            found[n] = chains[0]
    return found


def latent_input(block: nn.Module, latent: Latent | None, h: Tensor) -> Tensor:
    """What a value source reads, of the attention-input norm's output ``h [..., d]``: ``h`` itself where ``latent`` is
    None, else for latent attention the latent norm of the slice of the latent projection, times its scale, as the
    attention computes it (``latent``'s paths from the block: a layer's own, :mod:`~mfpipe.models.adapters.layers`)."""
    if latent is None:
        return h
    lat = submodule(block, latent.proj)(h)[..., latent.offset : latent.offset + latent.width]
    out = submodule(block, latent.norm)(lat)
    return out if latent.scale == 1.0 else out * latent.scale
