"""Latent attention (MLA: DeepSeek-V2/V3, MiniCPM-3, GLM-4-MoE-Lite, Youtu...): each head has its own probability row
and its own value vector, ``v_head_dim`` wide, decompressed by a projection (``kv_b_proj``) from a latent that is a
norm (``kv_a_layernorm``) of a slice of a projection of the attention's input (``kv_a_proj_with_mqa``, whose output
is ``[latent | shared rotary key]``); one output projection reads the ``H x v_head_dim`` reads.

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
    """Where a latent value source reads: ``norm(proj(h)[..., offset : offset + width])`` (names in the attention)."""

    proj: str
    offset: int
    width: int
    norm: str


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
            if nx.shape[-1] != r or ny.shape[-1] != r or not same(ny.reshape(-1, r), reads):
                continue
            nx = nx.reshape(-1, r)
            for p, (p_in, p_out) in shapes.items():
                if p_in != d:
                    continue
                y = seen[f"<src>{p}"].y.reshape(-1, p_out)
                if y.shape[0] != nx.shape[0]:
                    continue
                chains += [Latent(p, o, r, norm) for o in range(p_out - r + 1) if same(y[:, o : o + r], nx)]
        if len(chains) == 1:
            found[n] = chains[0]
    return found


def latent_input(block: nn.Module, structure, h: Tensor) -> Tensor:
    """What the value source of ``structure`` reads, of the attention-input norm's output ``h [..., d]``: ``h`` itself,
    or for latent attention the latent norm of the slice of the latent projection (as the attention computes it)."""
    if structure.latent_proj is None:
        return h
    lo = structure.latent_offset
    lat = submodule(block, structure.latent_proj)(h)[..., lo : lo + structure.latent_width]
    return submodule(block, structure.latent_norm)(lat)
