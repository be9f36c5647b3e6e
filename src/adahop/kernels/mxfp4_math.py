"""Triton device functions shared by the MXFP4 kernels: the same arithmetic as the reference.

Each function mirrors a piece of ``formats.mxfp4`` / ``formats.rng`` / ``transforms.hadamard``
operation for operation, so that the kernels' outputs are the reference's bits:

* ``lowbias32``: the SR/sign hash on uint32 (wrapping multiplies, as the reference's mod-2**32);
* ``fwht``: the butterfly with the reference's additions (stages h = H/2, .., 1), in place;
* ``block_exponent``: the four scale modes from amax's float32 bits (rceil's ``amax / 6`` is an
  IEEE round-to-nearest division, ``div_rn``: Triton's default fp32 ``/`` is approximate);
* ``e2m1_rne_arith``: the codes of the reference's comparison chain, by arithmetic (fewer
  instructions); ``e2m1_sr``: stochastic rounding with 16 random bits;
* ``pow2``: exact float32 powers of two built from bits (normal and subnormal).
"""

from __future__ import annotations

import triton
import triton.language as tl

SCALE_MODE_IDS = {"floor": 0, "even": 1, "ceil": 2, "rceil": 3}


@triton.jit
def lowbias32(x):
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    x = x ^ (x >> 16)
    return x


@triton.jit
def pow2(e):
    """float32 2**e for int32 e in [-149, 127], exact (subnormals below -126)."""
    normal = ((e + 127) << 23).to(tl.float32, bitcast=True)
    sub = (tl.full(e.shape, 1, tl.int32) << tl.maximum(e + 149, 0)).to(tl.float32, bitcast=True)
    return tl.where(e >= -126, normal, sub)


@triton.jit
def fwht(x, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, LOG2_H: tl.constexpr):
    """Unnormalised Walsh-Hadamard butterfly over groups of H = 2**LOG2_H along the last dim of a
    [BLOCK_R, BLOCK_K] float32 tile, in place: stage h = H/2, ..., 1 pairs x[i] with x[i + h],
    the reference's additions in its order (transforms.hadamard), so the same bits. In place
    rather than in constant geometry (every stage adding the two halves of each group and
    interleaving: the same additions): the stages with small h stay inside a thread's registers,
    where the constant-geometry form moves data at every stage (231 warp shuffles per 16 x 256
    chunk against 295; docs/kernels.md, 'The quantize kernels')."""
    for s in tl.static_range(LOG2_H):
        y = tl.reshape(x, (BLOCK_R, BLOCK_K >> (LOG2_H - s), 2, 1 << (LOG2_H - 1 - s)))
        a, b = tl.split(tl.permute(y, (0, 1, 3, 2)))
        y = tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2))
        x = tl.reshape(y, (BLOCK_R, BLOCK_K))
    return x


@triton.jit
def block_exponent(amax, SCALE_MODE: tl.constexpr):
    """Unbiased E8M0 exponent (int32, clamped to [-127, 127]) of blocks with finite amax >= 0."""
    if SCALE_MODE == 3:  # rceil: ceil(log2(fp32(amax / 6)))
        q = tl.math.div_rn(amax, tl.full(amax.shape, 6.0, tl.float32))
        bits = q.to(tl.int32, bitcast=True)
        ef = bits >> 23
        m = bits & 0x7FFFFF
        e = ef - 127 + (m != 0).to(tl.int32)
        e = tl.where(ef == 0, tl.where(m > 4194304, -126, -127), e)
    else:
        bits = amax.to(tl.int32, bitcast=True)
        if SCALE_MODE == 1:  # even: round the mantissa to 1 bit first
            bits = (bits + 2097152) & 0x7F800000
        e = (bits >> 23) - 129
        if SCALE_MODE == 2:  # ceil
            e = e + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    return tl.minimum(tl.maximum(e, -127), 127)


@triton.jit
def _grid_exponent_bits(abits):
    """float32 bits of 2**max(E, 0), E the exponent of a >= 0 (bits ``abits``): 1 below 2, then
    2 and 4. The E2M1 grid spacing at a is half that (0.5 below 2, 1 below 4, 2 up to 6). One
    AND and one max on the bits, no comparison: selects on ``a < 2`` and ``a < 4`` cost 32
    predicates per thread that Hopper (7 predicate registers) keeps in integer registers and
    unpacks one by one (``benchmarks/sass_count.py``)."""
    return tl.maximum(abits & 0x7F800000, 127 << 23)


@triton.jit
def e2m1_rne_arith(a):
    """Round |v| in [0, 6] to the E2M1 grid arithmetically: (magnitude code, rounded value).
    The grid spacing is s = 0.5, 1, 2 below 2, 4, 6, and (a + C) - C with C = 2**23 * s (the
    float whose ulp is s: 2**22, 2**23, 2**24) rounds a to a multiple of s, ties to the even
    multiple: two exact IEEE additions (no libdevice: it runs in the interpreter). C comes from
    a's exponent bits (``_grid_exponent_bits``). The code is the multiple in t = a + C's
    mantissa (t's bits minus C's) plus 0, 2, 4 for s = 0.5, 1, 2 (codes 0..4 by halves, then
    2, 3, 4 -> 4..6, then 4, 6 -> 6, 7): integer operations, no float-to-int conversion (a
    quarter or less of the FP32 rate on Hopper). The codes of the reference's comparison chain
    (``formats.mxfp4._round_rne``; checked on every boundary and its float32 neighbours), in
    fewer instructions than the chain (docs/kernels.md, 'E2M1 rounding in registers')."""
    cbits = _grid_exponent_bits(a.to(tl.int32, bitcast=True)) + (22 << 23)
    c = cbits.to(tl.float32, bitcast=True)
    t = a + c
    value = t - c
    code = (t.to(tl.int32, bitcast=True) - cbits) + ((cbits >> 22) - 298)  # C's exponent field * 2 - 298: 0, 2, 4
    return code, value


@triton.jit
def e2m1_sr(a, bits16):
    """Stochastic rounding of |v| in [0, 6] to the E2M1 grid with 16 random bits per element
    (int32 in [0, 2**16)): (magnitude code, rounded value), the reference's ``_round_sr``.

    With the grid spacing s (0.5, 1, 2 below 2, 4, 6; from a's exponent bits,
    ``_grid_exponent_bits``), y = a / s in [0, 4) is exact; Y is y to 16 fractional bits (round
    to nearest even) and the result is floor((Y + bits) / 2**16) * s: up with probability
    frac(y) to 16 bits. Done on the bits of t = y + 128 (ulp 2**-16, so the addition is the
    rounding and t's mantissa is Y): add the random bits, clear the 16 low mantissa bits
    (floor), subtract 128. The code is the multiple k (t's bits above 128's, in units of
    2**16) plus 0, 2, 4 for s = 0.5, 1, 2. Float adds and integer operations, no float-int
    conversion (a quarter or less of the FP32 rate on Hopper)."""
    sbits = _grid_exponent_bits(a.to(tl.int32, bitcast=True)) - (1 << 23)  # s
    y = a * ((254 << 23) - sbits).to(tl.float32, bitcast=True)  # a * (1 / s), exact
    t = (y + 128.0).to(tl.int32, bitcast=True)
    kbits = (t + bits16) & -65536
    value = (kbits.to(tl.float32, bitcast=True) - 128.0) * sbits.to(tl.float32, bitcast=True)
    code = ((kbits - 0x43000000) >> 16) + 2 * ((sbits >> 23) - 126)  # 128.0 = 0x43000000
    return code, value
