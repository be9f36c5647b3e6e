"""MXFP4 values as float8 e4m3 elements with one power-of-two scale per row: the form in which the
Hopper backend's GEMMs take an operand (``ops.backends.hopper_fp8``), defined here for the
kernels to match bit for bit.

A row's MXFP4 values ``e2m1 * 2**e_block`` are written as ``(e2m1 * 2**(e_block - e_row + 6)) *
2**(e_row - 6)``: the e4m3 element, rounded to nearest even, and the row scale. For every block with
``e_row - 14 <= e_block <= e_row`` the element is exact (e4m3's exponents and subnormals hold 14
binades below 6 * 2**6 = 384 <= 448); a block further below is rounded (an error under 2**-15 of
``2**(e_row + 2)``, the largest magnitude the row could hold).

``e_row`` is any exponent at or above every block's. Two choices:

* ``exact_row_exponent``: the row's largest block exponent (NaN blocks left out). Finding it takes
  a pass over the transformed row before the first element can be written.
* ``bound_row_exponent``: the block exponent of ``2**(floor(L / 2) + 1) * A``, for a bound ``A``
  on the row's elements before the transform (L = log2 of the Hadamard size, 0 without one). The
  transform is orthonormal in float32 (``transforms.hadamard``): each output is at most
  ``sqrt(2**L) * max |x|`` in exact arithmetic, and the butterfly's roundings cannot exceed it
  (every partial sum of 2**s inputs is at most ``2**s * max |x|``, and rounding is monotone; the
  final factor 1/sqrt(2**L) is rounded to float32, within 2**-23 of it). The factor
  ``2**(floor(L / 2) + 1)`` is at least sqrt(2) times sqrt(2**L), so ``A`` may fall short of
  ``max |x|`` by up to that: a producer may take the maximum of its values before their rounding to
  bfloat16 (as Inductor does when it fuses the maximum into the kernel that writes them). The
  scale modes' block exponents are monotone in the block maximum, so every block's exponent is at
  most this one. ``A`` can come from the operand's producer (a row maximum of what it writes)
  instead of a first pass over the transformed row, so the quantization is one pass. The exact
  window shrinks by the bound's slack: at most ``floor(L / 2) + 1`` binades plus the gap between
  the row's largest raw value and its largest transformed block. A non-finite or overflowing bound
  gives the largest finite block exponent (the row's finite blocks far below it round to zero;
  rows with NaN or Inf elements have NaN blocks anyway).
"""

from __future__ import annotations

import torch

from adahop.formats.mxfp4 import (
    E8M0_BIAS,
    E8M0_MIN_EXP,
    E8M0_NAN,
    MXFP4Tensor,
    dequantize_mxfp4,
    pow2_f32,
    scale_exponent,
)

E4M3_TOP_POW2 = 6  # the row scale is 2**(e_row - 6): a block at e_row reaches 6 * 2**6 = 384 <= 448
FLOAT32_MAX = torch.finfo(torch.float32).max


def exact_row_exponent(q: MXFP4Tensor) -> torch.Tensor:
    """Each row's largest block exponent (int32; NaN blocks left out, -127 for a row with none) of
    a 2-D ``q`` in its quantized layout (rows = the outer dim)."""
    e = q.scale_e8m0.to(torch.int32) - E8M0_BIAS
    e = torch.where(q.scale_e8m0 == E8M0_NAN, E8M0_MIN_EXP, e)
    if e.shape[-1] == 0:
        return torch.full(e.shape[:-1], E8M0_MIN_EXP, dtype=torch.int32, device=e.device)
    return e.amax(-1)


def bound_factor_pow2(log2_hadamard: int) -> int:
    """``floor(L / 2) + 1``: 2**that is at least sqrt(2) times sqrt(2**L), the most a Hadamard
    transform of size 2**L can grow an element's magnitude (module doc)."""
    return log2_hadamard // 2 + 1


def bound_row_exponent(bound: torch.Tensor, log2_hadamard: int, scale_mode: str) -> torch.Tensor:
    """The row exponent from a bound ``A`` on each row's magnitudes (module doc) (any float tensor, one value per row)
    for an operand transformed by a Hadamard of size ``2**log2_hadamard`` (0: none) and quantized
    with ``scale_mode``: the block exponent of ``min(|A| * 2**(floor(L / 2) + 1), float32 max)``, NaN
    and Inf counted as the float32 maximum (module doc)."""
    b = bound.float().abs() * float(2 ** bound_factor_pow2(log2_hadamard))  # exact unless it overflows
    b = torch.where(b <= FLOAT32_MAX, b, FLOAT32_MAX)  # NaN and Inf fail the comparison
    return scale_exponent(b, scale_mode)


def fold_e4m3(q: MXFP4Tensor, row_exponent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(e4m3 [R, KP] float8_e4m3fn, row_scale [R] float32)`` of a 2-D ``q`` in its quantized
    layout, with each row's exponent ``row_exponent`` (int, at or above every block exponent of the
    row): the elements ``value * 2**(6 - e_row)`` rounded to e4m3 (nearest, ties to even; NaN
    blocks NaN, the byte 0x7F), the scales ``2**(e_row - 6)``."""
    values = dequantize_mxfp4(q, keep_padding=True)
    e_row = row_exponent.to(torch.int32).to(values.device)
    # 2**(6 - e_row) in two exact factors: e_row spans [-127, 127], beyond one float32 power of two.
    half = (E4M3_TOP_POW2 - e_row) // 2
    scaled = values * pow2_f32(half)[:, None] * pow2_f32(E4M3_TOP_POW2 - e_row - half)[:, None]
    e4m3 = scaled.to(torch.float8_e4m3fn)
    e4m3.view(torch.uint8)[torch.isnan(values)] = 0x7F
    return e4m3, row_scale(e_row)


def row_scale(e_row: torch.Tensor) -> torch.Tensor:
    """float32 ``2**(e_row - 6)``, exact (down to 2**-133, a subnormal)."""
    e = e_row - E4M3_TOP_POW2
    lo = torch.clamp(e, min=-126)
    return pow2_f32(lo) * pow2_f32(e - lo)
