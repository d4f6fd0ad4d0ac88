"""Rounding float sums to fewer mantissa bits (:func:`round_mantissa`): what makes a rounded statistics partial small
(``stats.partial_mantissa_bits``, :mod:`mfpipe.stats.partials`). Pure NumPy."""

from __future__ import annotations

import numpy as np

__all__ = ["round_mantissa"]


def round_mantissa(a: np.ndarray, bits: int) -> np.ndarray:
    """A copy of ``a`` (float32 or float64) with every finite value rounded to ``bits`` explicit mantissa bits, to
    nearest with ties to even (the rounding of numcodecs' ``BitRound``, done here so that a partial stays plain
    float32 / float64 that any Zarr reader opens): each normal value moves by at most 2^-(bits+1) of itself, so
    sums of one sign keep that relative bound (a subnormal moves by at most half its dropped ulp; a value within
    half an ulp of the largest float becomes inf); 0, ±inf and NaN are kept. ``bits`` at the dtype's full mantissa
    (23 / 52) returns an exact copy."""
    a = np.asarray(a)
    if a.dtype == np.float32:
        uint, full = np.uint32, 23
    elif a.dtype == np.float64:
        uint, full = np.uint64, 52
    else:
        raise TypeError(f"round_mantissa: {a.dtype} is not float32 or float64")
    if not 1 <= int(bits) <= full:
        raise ValueError(f"round_mantissa: bits={bits} is outside 1..{full} for {a.dtype}")
    out = np.array(a, copy=True)  # contiguous: the bit operations below stream over it
    drop = full - int(bits)
    if drop == 0:
        return out
    keep = ~np.isfinite(out)
    b = out.view(uint)
    t = b >> uint(drop)
    t &= uint(1)
    t += uint((1 << (drop - 1)) - 1)  # half an ulp, minus one unless the kept part is odd: ties to even
    b += t
    b &= uint(np.iinfo(uint).max ^ ((1 << drop) - 1))
    if keep.any():
        out[keep] = np.asarray(a)[keep]
    return out
