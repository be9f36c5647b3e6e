"""Fused [random signs +] block Hadamard + MXFP4 quantization of a GEMM operand, in one kernel.

The operand is a logical ``[R, K]`` view of a 2-D tensor: R = the outer dim, K = the contraction
dim, given by strides, so one kernel quantizes ``x_TK`` along K (strides (K, 1)) and along T
(the view ``x.t()``, strides (1, K)) without a transpose copy. Each program owns ``BLOCK_R`` rows
and a range of K (all of it, unless the operand has too few rows to fill the GPU: then K is
split over several programs), walked in chunks of ``BLOCK_K``; per chunk it loads, signs,
transforms, takes block maxima, and rounds, exactly as the reference (``kernels.mxfp4_math``). The
numerics are the operand's ``OperandSpec`` (``transforms.operand_spec``, checked when it was made);
the kernels implement MX blocks of 32 only. Outputs (all row-major, K padded to ``KP``,
``spec.padded(K)``):

* packed codes ``[R, KP/2]`` uint8 and scale bytes ``[R, KP/32]`` uint8: ``MXFP4Tensor``'s layout,
  bit-identical to ``ops.operand.quantize_operand`` (what is saved for the backward);
* for the Hopper FP8 GEMM, ``[R, KP]`` float8_e4m3fn plus one float32 scale per row: element =
  ``e2m1 value * 2**(e_block - e_rowmax + 6)``, row scale = ``2**(e_rowmax - 6)``. The product is
  exactly the MXFP4 value wherever ``e_block >= e_rowmax - 14`` (e4m3's 4 exponent bits and its
  subnormals hold 14 binades below 6 * 2**6 = 384 <= 448); a block further below its row's
  largest is rounded to e4m3 (an error under 2**-15 of the row maximum).

The e4m3 form needs each row's largest block exponent before it writes the first element, so it
takes two passes over K, in two launches: the first (PHASE 1) writes each K range's largest
block exponent, the second (PHASE 2) recomputes the chunk and writes the elements. A row that
fits one chunk (``single_chunk_max``) is read once, in one launch. Given a bound on each row's
magnitude (``row_bound``, from the operand's producer), the row exponent comes from it instead
(``formats.e4m3_rows``, where the e4m3 form is defined): one pass, one launch, whatever the row's
length.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from adahop.formats.e4m3_rows import bound_row_exponent as bound_row_exponent_ref
from adahop.formats.e4m3_rows import row_scale as row_scale_of
from adahop.formats.mxfp4 import MXFP4Tensor
from adahop.formats.rng import SRStream, _lowbias32_int
from adahop.kernels.launch import (
    INTERPRETED,
    FastLauncher,
    cdiv,
    dummy_pointer,
    nan_bytes_view,
    next_power_of_2,
)
from adahop.kernels.mxfp4_math import (
    SCALE_MODE_IDS,
    block_exponent,
    e2m1_rne_arith,
    e2m1_sr,
    fwht,
    lowbias32,
    pow2,
)
from adahop.transforms.operand_spec import OperandSpec

INTERPRETED_JIT: tl.constexpr = tl.constexpr(INTERPRETED)


@triton.jit
def _round_to_bf16(x, BY_CAST: tl.constexpr):
    """float32 ``x`` rounded to bfloat16 (round to nearest, ties to even; NaN stays NaN; past
    bfloat16's largest value, Inf), as float32: torch's ``x.to(torch.bfloat16)``. Compiled, one
    ``cvt.rn`` per pair; the interpreter truncates in its casts (Triton 3.6 ignores
    ``fp_downcast_rounding`` there), so it takes the same rounding on the bits: add half an ulp
    of bfloat16 (less one, plus the kept lowest bit: ties go to even) and clear the 16 low
    bits. A carry into the exponent is the correct rounding up, to Inf at the top."""
    if BY_CAST:
        return x.to(tl.bfloat16, fp_downcast_rounding="rtne").to(tl.float32)
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return tl.where(x != x, x, rounded.to(tl.float32, bitcast=True))


@triton.jit
def _load_transform(
    x_ptr, stride_r, stride_k, rows, k0, R, K, sign_key, norm,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, LOG2_H: tl.constexpr, HAS_SIGNS: tl.constexpr,
    NORMED: tl.constexpr = True, ROUND_BF16: tl.constexpr = False,
):
    """Load a ``[BLOCK_R, BLOCK_K]`` chunk as float32 and transform it. ``ROUND_BF16``: x is
    float32 and the operand is ``x.to(torch.bfloat16)``: each value is rounded to bfloat16 as it
    is loaded (round to nearest even, as torch's cast; NaN stays NaN, values past bfloat16's range
    become Inf), so a float32 master weight is quantized without a cast kernel writing and this
    kernel reading a bfloat16 copy."""
    cols = k0 + tl.arange(0, BLOCK_K)
    mask = (rows[:, None] < R) & (cols[None, :] < K)
    ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_r + cols[None, :].to(tl.int64) * stride_k
    x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    if ROUND_BF16:
        x = _round_to_bf16(x, not INTERPRETED_JIT)
    return _transform(x, cols, sign_key, norm, BLOCK_R, BLOCK_K, LOG2_H, HAS_SIGNS, NORMED)


@triton.jit
def _transform(
    x, cols, sign_key, norm,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, LOG2_H: tl.constexpr, HAS_SIGNS: tl.constexpr,
    NORMED: tl.constexpr = True,
):
    """Random signs (by column index ``cols``) and the block Hadamard along the last dim of a
    float32 ``[BLOCK_R, BLOCK_K]`` tile, as ``transforms.hadamard``. ``NORMED=False`` leaves out
    the final multiplication by ``norm``: for a pass that only needs the block exponents, which
    ``_blocks`` then takes with ``amax_scale=norm`` (the same bits, one multiplication per block
    instead of one per element)."""
    if HAS_SIGNS:
        bit = lowbias32(cols.to(tl.uint32) ^ sign_key.to(tl.uint32)) >> 31
        x = x * (1.0 - 2.0 * bit.to(tl.float32))[None, :]
    if LOG2_H > 0:
        x = fwht(x, BLOCK_R, BLOCK_K, LOG2_H)
        if NORMED:
            x = x * norm
    return x


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _blocks(x, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_MODE: tl.constexpr, amax_scale=1.0):
    """Per 32-block: exponent (NaN blocks: -127) and finiteness, as [BLOCK_R, BLOCK_K/32].

    ``amax_scale``: the blocks are those of ``x * amax_scale`` (x: a butterfly not yet times its
    norm, ``_transform(NORMED=False)``). Rounding is monotone, so the largest of the rounded
    products |x_i| * s is the rounded product of the largest |x_i|: amax(|x|) * s per block is
    the block maximum of the normed values, bit for bit (NaN and Inf stay NaN and Inf; s <= 1)."""
    xb = tl.reshape(x, (BLOCK_R, BLOCK_K // 32, 32))
    # A maximum that propagates NaN (tl.max ignores it): NaN and Inf blocks both fail amax < inf.
    if INTERPRETED_JIT:
        # The portable twin, the same values: under the interpreter a combine function of our own
        # runs in Python, element by element (about 0.2 s per quantize launch, most of the CPU
        # tests' time), while tl.max is one numpy reduction. tl.max ignores NaN there too, so
        # NaN blocks are found by a second one.
        ax = tl.abs(xb)
        has_nan = tl.max((ax != ax).to(tl.int32), 2) > 0
        amax = tl.where(has_nan, float("nan"), tl.max(ax, 2)) * amax_scale
    else:
        amax = tl.reduce(tl.abs(xb), 2, _max_nan) * amax_scale
    finite = amax < float("inf")
    e = block_exponent(tl.where(finite, amax, 0.0), SCALE_MODE)
    return e, finite


@triton.jit
def _store_per_block(ptrs, values, mask, BLOCK_R: tl.constexpr, NB: tl.constexpr):
    """Store one value per 32-block (``[BLOCK_R, NB]`` pointers, values, mask), each by the
    thread that holds the block's element 0 in the ``[BLOCK_R, NB, 32]`` block tile.

    Stored as a ``[BLOCK_R, NB]`` tensor, the values would pull the whole chunk (the butterfly
    included) into that store's layout, as a per-row value does (``_store_row_exponent``): 226
    warp shuffles per 16 x 256 chunk. Broadcast back over the block (each thread already holds
    its block's reduced value) and stored under ``j == 0``, they need no shuffles: the packed
    quantize takes 1,336 SASS instructions instead of 1,848 (``benchmarks/sass_count.py``;
    ``j == 0`` is false at compile time for all but one register of a thread, so one predicated
    store remains per block), 1.5-1.8x faster on the H200 for [16384, 4096] and [16384, 14336]
    operands. The codes store must take the same thread mapping (the packed codes as
    ``[rows, blocks, 16, 2]``), or Triton computes the chunk's butterfly a second time for it
    (docs/kernels.md, 'Layout rules for Triton')."""
    j = tl.arange(0, 32)[None, None, :]
    v = tl.broadcast_to(values[:, :, None], (BLOCK_R, NB, 32))
    tl.store(ptrs[:, :, None] + 0 * j, v, mask=mask[:, :, None] & (j == 0))


@triton.jit
def _emit_chunk(
    x, e, finite, e_rowmax, rows, row_ok, k0, KP, sr_key,
    codes_ptr, scales_ptr, e4m3_ptr, e4m3_bits_ptr,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, SR: tl.constexpr,
    WRITE_PACKED: tl.constexpr, WRITE_E4M3: tl.constexpr, NAN_BY_CAST: tl.constexpr,
):
    """Round one transformed chunk and write its scale bytes, packed codes and/or e4m3 form.

    The e4m3 form folds each block's scale into its elements relative to the row's largest
    block exponent ``e_rowmax`` (the row scale is ``2**(e_rowmax - 6)``)."""
    NB: tl.constexpr = BLOCK_K // 32
    if WRITE_PACKED:
        bidx = k0 // 32 + tl.arange(0, NB)
        smask = row_ok[:, None] & (bidx[None, :] < KP // 32)
        sbyte = tl.where(finite, e + 127, 255).to(tl.uint8)
        _store_per_block(scales_ptr + rows[:, None].to(tl.int64) * (KP // 32) + bidx[None, :], sbyte, smask,
                         BLOCK_R, NB)

    # Scale by 2**-e (a normal float32 for e in [-127, 126]), clamp |v| to 6, round. Non-finite
    # blocks: zero codes in the packed form; the e4m3 form overwrites them with NaN below.
    xb = tl.reshape(x, (BLOCK_R, NB, 32))
    v = xb * pow2(-e)[:, :, None]
    if WRITE_PACKED:
        v = tl.where(finite[:, :, None], v, 0.0)
    a = tl.minimum(tl.abs(v), 6.0)
    if SR:  # one 32-bit hash per pair of elements, 16 bits each (formats.rng.sr_bits)
        # pairs < 2**31
        pairs = ((rows.to(tl.uint32) * KP.to(tl.uint32) + k0) >> 1)[:, None] + tl.arange(0, BLOCK_K // 2)[None, :]
        r = lowbias32(pairs ^ sr_key.to(tl.uint32))
        bits = tl.reshape(tl.join(r & 0xFFFF, r >> 16), (BLOCK_R, NB, 32)).to(tl.int32)
        c, mag = e2m1_sr(a, bits)
    else:
        c, mag = e2m1_rne_arith(a)
    vbits = v.to(tl.int32, bitcast=True)
    if WRITE_PACKED:
        code = tl.reshape(c | ((vbits >> 28) & 8), (BLOCK_R, NB, 16, 2))  # sign -> bit 3
        lo, hi = tl.split(code)
        packed = tl.reshape((lo | (hi << 4)).to(tl.uint8), (BLOCK_R, BLOCK_K // 2))
        # KP and k0 are multiples of 32 (k0 of the chunk), so a block's 16 bytes are 16-aligned
        # (k0 must be a tensor, not a literal, for tl.multiple_of)
        prow = tl.multiple_of(KP // 2, 16)
        pcols = tl.multiple_of(k0 // 2, 16) + tl.arange(0, BLOCK_K // 2)
        pmask = row_ok[:, None] & (pcols[None, :] < prow)
        tl.store(codes_ptr + rows[:, None].to(tl.int64) * prow + pcols[None, :], packed, mask=pmask)
    if WRITE_E4M3:
        e_ref = e_rowmax[:, None]
        shift = tl.maximum(e - e_ref + 6, -126)  # below that it is 0 in e4m3 anyway
        # v's sign bit on the magnitude (a zero keeps it: -0 gives the e4m3 byte 0x80, as the
        # reference), then the power of two: the same value as signing the product.
        m = (mag.to(tl.int32, bitcast=True) | (vbits & -2147483648)).to(tl.float32, bitcast=True)
        scale = pow2(shift)
        if NAN_BY_CAST:
            # Non-finite blocks: NaN by their factor, one select per block instead of one per
            # element. The GPU's multiply returns its canonical NaN (positive) and its cvt to
            # e4m3 makes that the NaN byte 0x7F.
            scale = tl.where(finite, scale, float("nan"))
        val = m * scale[:, :, None]
        cols = k0 + tl.arange(0, BLOCK_K)
        eoffs = rows[:, None].to(tl.int64) * KP + cols[None, :]
        emask = row_ok[:, None] & (cols[None, :] < KP)
        if NAN_BY_CAST:
            # One store whose mask does not depend on the data, so it vectorizes (16 B per
            # thread).
            tl.store(e4m3_ptr + eoffs, tl.reshape(val, (BLOCK_R, BLOCK_K)).to(tl.float8e4nv), mask=emask)
        else:
            # Portable twin for the interpreter, whose fp8 cast gets NaN wrong: non-finite blocks
            # get 0x7F through a uint8 view of the same buffer.
            val = tl.reshape(val, (BLOCK_R, BLOCK_K)).to(tl.float8e4nv)
            fin = tl.reshape(tl.broadcast_to(finite[:, :, None], (BLOCK_R, NB, 32)), (BLOCK_R, BLOCK_K))
            tl.store(e4m3_ptr + eoffs, val, mask=emask & fin)
            nan_bits = tl.full((BLOCK_R, BLOCK_K), 0x7F, tl.uint8)
            tl.store(e4m3_bits_ptr + eoffs, nan_bits, mask=emask & (~fin))


@triton.jit
def _store_row_exponent(epart_ptr, e_rowmax, e, rows, row_ok, last, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """Store each row's largest block exponent (biased, as a uint8 like an E8M0 byte) as the 16
    bytes ``epart[row, 0:16]``, written only when ``last``.

    Why 16 copies through a full tile: Triton gives a tile the layout of the stores it flows
    into. A per-row value stored as such pulls the whole chunk (the Hadamard butterfly
    included) into one element per lane, which costs ~220 warp shuffles per chunk; routed back
    through the ``[BLOCK_R, BLOCK_K / 32, 32]`` block tile and stored as 16 contiguous bytes, it
    keeps the layout of the emit pass (a block over two lanes): 544 SASS instructions for the
    first pass instead of 1,256 (``benchmarks/sass_count.py``), and 0.165 ms instead of 0.236 for
    the e4m3 quantize of x [16384, 4096] on the H200 (docs/kernels.md, 'Layout rules for
    Triton')."""
    NB: tl.constexpr = BLOCK_K // 32
    t = tl.broadcast_to((e_rowmax[:, None] + 127 + 0 * e)[:, :, None], (BLOCK_R, NB, 32))
    t = tl.reshape(t, (BLOCK_R, BLOCK_K)).to(tl.uint8)
    cols = tl.arange(0, BLOCK_K)
    tl.store(epart_ptr + rows[:, None].to(tl.int64) * 16 + cols[None, :], t,
             mask=row_ok[:, None] & (cols[None, :] < 16) & last)


@triton.jit
def _load_row_exponent(epart_ptr, rows, row_ok):
    return tl.load(epart_ptr + rows.to(tl.int64) * 16, mask=row_ok, other=0).to(tl.int32) - 127


@triton.jit
def bound_row_exponent(bound_ptr, rows, row_ok, LOG2_H: tl.constexpr, SCALE_MODE: tl.constexpr):
    """Each row's exponent from a bound ``A`` on its elements (float32 [R]): the block exponent of
    ``min(|A| * 2**(floor(LOG2_H / 2) + 1), float32 max)``, NaN and Inf as the maximum;
    ``formats.e4m3_rows.bound_row_exponent``, whose doc says why every block lies at or below it."""
    a = tl.load(bound_ptr + rows, mask=row_ok, other=0.0)
    b = tl.abs(a) * (1 << (LOG2_H // 2 + 1))  # a power of two: exact unless it overflows
    b = tl.where(b <= 3.4028234663852886e38, b, 3.4028234663852886e38)  # NaN and Inf fail the comparison
    return block_exponent(b, SCALE_MODE)


@triton.jit
def _sr_key_from_state(state_ptr, stream):
    """The SR key of ``formats.rng.SRStream``: the seed ``mix_seeds_from(prefix, call, gemm,
    operand)`` from ``state = [prefix, call]`` (int64, on the device) and ``stream = 2 * gemm +
    operand``, then ``sr_key`` of it; the host's chain (``formats.rng``), word for word, so the
    bits are those of the int seed."""
    prefix = tl.load(state_ptr).to(tl.uint32)
    call = tl.load(state_ptr + 1)
    hi = (call >> 32).to(tl.uint32)
    h = lowbias32(prefix ^ call.to(tl.uint32))
    h = tl.where(hi == 0, lowbias32(h ^ 1), lowbias32(lowbias32(h ^ hi) ^ 2))  # the call: 1 or 2 words
    h = lowbias32(lowbias32(h ^ (stream >> 1).to(tl.uint32)) ^ 1)
    h = lowbias32(lowbias32(h ^ (stream & 1).to(tl.uint32)) ^ 1)
    return lowbias32(h)  # sr_key(seed) = lowbias32(lowbias32(0) ^ seed), lowbias32(0) = 0


@triton.jit(do_not_specialize=["sr_key", "sign_key"])
def _mxfp4_quantize_kernel(
    x_ptr, stride_r, stride_k,
    codes_ptr, scales_ptr, e4m3_ptr, e4m3_bits_ptr, rowscale_ptr, epart_ptr, bound_ptr,
    R, K, KP, SPLIT_K, n_splits, sr_key, sr_state_ptr, sign_key, norm,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, LOG2_H: tl.constexpr, HAS_SIGNS: tl.constexpr,
    SCALE_MODE: tl.constexpr, SR: tl.constexpr, SR_FROM_STATE: tl.constexpr, SINGLE_CHUNK: tl.constexpr,
    WRITE_PACKED: tl.constexpr, WRITE_E4M3: tl.constexpr, NAN_BY_CAST: tl.constexpr,
    PHASE: tl.constexpr, ROUND_BF16: tl.constexpr, GIVEN_BOUND: tl.constexpr,
):
    """Program (i, s) owns rows [i * BLOCK_R, (i + 1) * BLOCK_R) and the K range
    [s * SPLIT_K, (s + 1) * SPLIT_K) (SPLIT_K = KP: one range per row). PHASE 0 does everything
    (one chunk per row, or no e4m3 form); for the e4m3 form over several chunks, PHASE 1 writes
    each range's largest block exponent to ``epart`` [n_splits, R, 16] (uint8, biased) and
    PHASE 2 takes the row maximum of those and emits. ``GIVEN_BOUND``: the e4m3 form's row
    exponent comes from a bound on each row's elements (``bound_ptr``, float32 [R]:
    ``bound_row_exponent``), so one pass emits it (PHASE 0 over several chunks).

    SR: ``sr_key`` is the key, or with ``SR_FROM_STATE`` the stream ``2 * gemm + operand`` whose
    key comes from the int64 ``[prefix, call]`` at ``sr_state_ptr`` (``_sr_key_from_state``)."""
    if SR_FROM_STATE:
        sr_key = _sr_key_from_state(sr_state_ptr, sr_key)
    pid = tl.program_id(0)
    sid = tl.program_id(1)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < R
    k_lo = sid * SPLIT_K
    k_hi = tl.minimum(k_lo + SPLIT_K, KP)

    if SINGLE_CHUNK:  # the whole (padded) row fits one chunk: one read, one transform
        x = _load_transform(x_ptr, stride_r, stride_k, rows, 0, R, K, sign_key, norm,
                            BLOCK_R, BLOCK_K, LOG2_H, HAS_SIGNS, True, ROUND_BF16)
        e, finite = _blocks(x, BLOCK_R, BLOCK_K, SCALE_MODE)
        if GIVEN_BOUND:
            e_rowmax = bound_row_exponent(bound_ptr, rows, row_ok, LOG2_H, SCALE_MODE)
        else:
            e_rowmax = tl.max(tl.where(finite, e, -127), axis=1)
        if WRITE_E4M3:
            tl.store(rowscale_ptr + rows, pow2(e_rowmax - 6), mask=row_ok)
        # k0 = k_lo (0 here) as a tensor: _emit_chunk states its divisibility (tl.multiple_of)
        _emit_chunk(x, e, finite, e_rowmax, rows, row_ok, k_lo, KP, sr_key,
                    codes_ptr, scales_ptr, e4m3_ptr, e4m3_bits_ptr,
                    BLOCK_R, BLOCK_K, SR, WRITE_PACKED, WRITE_E4M3, NAN_BY_CAST)
    elif PHASE == 1:  # largest block exponent of this K range, for PHASE 2
        e_part = tl.full((BLOCK_R,), -127, tl.int32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            x = _load_transform(x_ptr, stride_r, stride_k, rows, k0, R, K, sign_key, norm,
                                BLOCK_R, BLOCK_K, LOG2_H, HAS_SIGNS, False, ROUND_BF16)
            e, finite = _blocks(x, BLOCK_R, BLOCK_K, SCALE_MODE, norm)
            e_part = tl.maximum(e_part, tl.max(tl.where(finite, e, -127), axis=1))
            _store_row_exponent(epart_ptr + sid * R * 16, e_part, e, rows, row_ok, k0 + BLOCK_K >= k_hi,
                                BLOCK_R, BLOCK_K)
    else:
        e_rowmax = tl.full((BLOCK_R,), -127, tl.int32)
        if WRITE_E4M3 and GIVEN_BOUND:
            e_rowmax = bound_row_exponent(bound_ptr, rows, row_ok, LOG2_H, SCALE_MODE)
            tl.store(rowscale_ptr + rows, pow2(e_rowmax - 6), mask=row_ok & (sid == 0))
        elif WRITE_E4M3:  # (then PHASE 2) the row maximum of PHASE 1's partial maxima
            for sp in range(0, n_splits):
                e_rowmax = tl.maximum(e_rowmax, _load_row_exponent(epart_ptr + sp * R * 16, rows, row_ok))
            tl.store(rowscale_ptr + rows, pow2(e_rowmax - 6), mask=row_ok & (sid == 0))
        for k0 in range(k_lo, k_hi, BLOCK_K):
            x = _load_transform(x_ptr, stride_r, stride_k, rows, k0, R, K, sign_key, norm,
                                BLOCK_R, BLOCK_K, LOG2_H, HAS_SIGNS, True, ROUND_BF16)
            e, finite = _blocks(x, BLOCK_R, BLOCK_K, SCALE_MODE)
            _emit_chunk(x, e, finite, e_rowmax, rows, row_ok, k0, KP, sr_key,
                        codes_ptr, scales_ptr, e4m3_ptr, e4m3_bits_ptr,
                        BLOCK_R, BLOCK_K, SR, WRITE_PACKED, WRITE_E4M3, NAN_BY_CAST)


_QUANTIZE = FastLauncher(_mxfp4_quantize_kernel)

# Launch configurations by (quantization dim of the 2-D operand, e4m3 output?): block_r rows per
# program, block_k columns per chunk, warps, the longest padded row handled in one chunk (one
# read and one launch instead of two for the e4m3 form). Measured on the H200 with x [16384, 4096]
# bf16 (docs/kernels.md, 'The quantize kernels'): 16 x 256 with 4 warps is the fastest for 4 of the
# 5 variants. One chunk per row: slower for every operand of the (14336, 4096) layer (rows of
# 4,096-16,384), faster for rows of 768-2,048 at (2048, 768) (0.062-0.103 ms against 0.112-0.144 ms
# for the two passes, with 8,192 elements per program), hence up to 2,048.
DEFAULT_LAUNCH = dict(block_r=16, block_k=256, num_warps=4, single_chunk_max=2048)
SINGLE_CHUNK_ELEMENTS = 8192  # per program, when a row is one chunk


# Programs a launch should have to fill the GPU (a few per SM): operands with few rows (x or g
# along T, R = features) get their K range split over that many programs.
PROGRAMS_PER_SM = 4
_SM_COUNT: dict = {}


def auto_k_splits(row_programs: int, n_chunks: int, device: torch.device) -> int:
    """How many K ranges per row group: 1 on the CPU or when the row groups alone fill the GPU,
    else enough for ``PROGRAMS_PER_SM`` programs per SM (at most one per chunk)."""
    if device.type != "cuda" or row_programs == 0:
        return 1
    if device not in _SM_COUNT:
        _SM_COUNT[device] = torch.cuda.get_device_properties(device).multi_processor_count
    target = PROGRAMS_PER_SM * _SM_COUNT[device]
    if row_programs >= target:
        return 1
    return max(1, min(n_chunks, -(-target // row_programs)))


def as_int32(key: int) -> int:
    """A 32-bit hash key as the signed int32 with the same bits. Triton types a Python int by
    its value (i32 below 2**31, i64 above) and specializes on divisibility by 16 and on 1, so
    random keys passed as they are would compile each kernel up to five times, once per kind of
    key met (seconds each, in the middle of training). As int32, and with the key arguments
    marked ``do_not_specialize``, every key takes the same compiled kernel; the kernels read it
    back as uint32, the same bits."""
    return key - (1 << 32) if key >= 1 << 31 else key


def check_row_bound(row_bound: torch.Tensor, rows: int, device: torch.device) -> None:
    """A row bound is float32 [rows] on the operand's device (module doc of ``formats.e4m3_rows``)."""
    if not (isinstance(row_bound, torch.Tensor) and row_bound.dtype == torch.float32
            and tuple(row_bound.shape) == (rows,) and row_bound.device == device):
        got = (f"{row_bound.dtype} {tuple(row_bound.shape)} on {row_bound.device}"
               if isinstance(row_bound, torch.Tensor) else type(row_bound).__name__)
        raise ValueError(f"a row bound must be float32 of shape ({rows},) on {device}, got {got}")
    if not row_bound.is_contiguous():
        raise ValueError("a row bound must be contiguous")


def sr_key(seed: int) -> int:
    """Per-element key of the SR hash for counters below 2**32 (formats.rng: counter >> 32 = 0)."""
    return _lowbias32_int(_lowbias32_int(0) ^ seed)


def check_spec(spec: OperandSpec) -> None:
    """The kernels' own limit on an operand's numerics (the spec checked the rest when it was made)."""
    if not isinstance(spec, OperandSpec):
        raise ValueError(f"the Triton kernels take an OperandSpec, got {type(spec).__name__}")
    if spec.block_size != 32:
        raise ValueError(f"the Triton kernels implement MX blocks of 32, got block_size={spec.block_size}")


def sign_key(spec: OperandSpec) -> int:
    """The key the kernels hash column indices with for the random signs (int32), 0 without signs."""
    return as_int32(_lowbias32_int(spec.signs_seed)) if spec.signs_seed is not None else 0


def sr_args(spec: OperandSpec) -> tuple[int, torch.Tensor | None]:
    """The kernels' SR arguments ``(key, state)``: an int seed gives its key (int32) and no state;
    an ``SRStream`` its stream ``2 * gemm + operand`` and its state tensor, from which the kernel
    derives the key (``_sr_key_from_state``); RNE ``(0, None)``."""
    if not spec.stochastic:
        return 0, None
    if isinstance(spec.sr_seed, SRStream):
        return 2 * spec.sr_seed.gemm + spec.sr_seed.operand, spec.sr_seed.state
    return as_int32(sr_key(spec.sr_seed)), None


def quantize_operand_triton(
    x: torch.Tensor,
    dim: int,
    spec: OperandSpec,
    *,
    packed: bool = True,
    e4m3: bool = False,
    block_r: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    single_chunk_max: int | None = None,
    k_splits: int | None = None,
    round_to_bf16: bool = False,
    row_bound: torch.Tensor | None = None,
):
    """Quantize 2-D ``x`` along ``dim`` as ``spec`` says, with the fused kernel. Returns a dict
    with, as asked, ``"mx"`` (MXFP4Tensor), ``"e4m3"`` ([R, KP] float8_e4m3fn) and
    ``"row_scale"`` ([R] float32); R = the other dim.

    ``round_to_bf16``: quantize ``x.to(torch.bfloat16)`` for a float32 ``x``, rounding in the
    kernel's loads (the same bits as the cast, without its pass over x).

    ``row_bound``: float32 [R], a bound on each row's largest magnitude (of ``x`` as quantized:
    after the cast of ``round_to_bf16``, before the transform); the e4m3 form then takes its row
    exponent from it (``formats.e4m3_rows.bound_row_exponent``) and is written in one pass. Without
    it, the row's largest block exponent (two passes where a row spans several chunks). The
    packed form does not depend on it.

    ``k_splits``: programs per row group along K (None: enough to fill the GPU, see
    ``auto_k_splits``; 1 on the CPU). Splitting changes nothing in the result."""
    if x.dim() != 2:
        raise ValueError(f"quantize_operand_triton takes a 2-D operand, got shape {tuple(x.shape)}")
    if round_to_bf16 and x.dtype != torch.float32:
        raise ValueError(f"round_to_bf16 takes a float32 operand, got {x.dtype}")
    check_spec(spec)
    dim = dim % 2
    cfg = DEFAULT_LAUNCH  # every form: within 6% of the best shape for each (docs/kernels.md)
    block_r = cfg["block_r"] if block_r is None else block_r
    block_k = cfg["block_k"] if block_k is None else block_k
    num_warps = cfg["num_warps"] if num_warps is None else num_warps
    single_chunk_max = cfg["single_chunk_max"] if single_chunk_max is None else single_chunk_max
    view = x if dim == 1 else x.t()  # logical [R, K]: K = contraction dim
    R, K = view.shape
    if row_bound is not None:
        check_row_bound(row_bound, R, x.device)
    KP, align = spec.padded(K), spec.alignment
    if R * KP >= 2**32:
        raise ValueError(f"operand too large for 32-bit SR counters: {R} x {KP}")
    block_k = max(block_k, align)
    while block_k > align and (-KP % block_k) * 8 > KP:  # more than 1/8 of the chunks' work masked
        block_k //= 2  # (K = 384: two chunks of 256 would waste a quarter; three of 128 none)
    single = 0 < KP <= single_chunk_max  # one chunk per row: one read instead of two for e4m3
    if single:
        block_k = max(next_power_of_2(KP), align)
        block_r = max(1, min(block_r, SINGLE_CHUNK_ELEMENTS // block_k))
    n_chunks = cdiv(KP, block_k)
    row_programs = cdiv(R, block_r)
    if k_splits is None:
        k_splits = auto_k_splits(row_programs, n_chunks, x.device)
    if isinstance(k_splits, bool) or not isinstance(k_splits, int) or k_splits < 1:
        raise ValueError(f"k_splits must be a positive int, got {k_splits!r}")
    chunks_per_split = cdiv(n_chunks, min(k_splits, n_chunks)) if n_chunks else 1
    k_splits = max(1, cdiv(n_chunks, chunks_per_split))  # no empty range
    split_k = chunks_per_split * block_k  # a multiple of the chunk: no block or group straddles two
    dev = x.device
    codes = torch.empty((R, KP // 2), dtype=torch.uint8, device=dev) if packed else None
    scales = torch.empty((R, KP // 32), dtype=torch.uint8, device=dev) if packed else None
    e4 = torch.empty((R, KP), dtype=torch.float8_e4m3fn, device=dev) if e4m3 else None
    rs = torch.empty((R,), dtype=torch.float32, device=dev) if e4m3 else None
    given = e4m3 and row_bound is not None
    two_phase = e4m3 and not single and not given  # the row maximum first (PHASE 1), then the emit (PHASE 2)
    epart = torch.empty((k_splits, R, 16), dtype=torch.uint8, device=dev) if two_phase else None
    dummy = dummy_pointer(dev)
    key, state = sr_args(spec)
    grid = (row_programs, k_splits)
    args = (
        view, view.stride(0), view.stride(1),
        codes if packed else dummy, scales if packed else dummy,
        e4 if e4m3 else dummy, nan_bytes_view(e4) if e4m3 else dummy,
        rs if e4m3 else dummy, epart if two_phase else dummy, row_bound if given else dummy,
        R, K, KP, split_k, k_splits, key, dummy if state is None else state, sign_key(spec), spec.hadamard_norm,
    )
    meta = dict(
        BLOCK_R=block_r, BLOCK_K=block_k, LOG2_H=spec.log2_hadamard, HAS_SIGNS=spec.signs_seed is not None,
        SCALE_MODE=SCALE_MODE_IDS[spec.scale_mode], SR=spec.stochastic, SR_FROM_STATE=state is not None,
        SINGLE_CHUNK=single,
        WRITE_PACKED=packed, WRITE_E4M3=e4m3,
        NAN_BY_CAST=not INTERPRETED,
        ROUND_BF16=round_to_bf16, GIVEN_BOUND=given,
        num_warps=num_warps,
    )
    if KP == 0:  # no blocks, nothing to launch: an empty row's largest exponent is -127
        if e4m3:
            if given:
                rs.copy_(row_scale_of(bound_row_exponent_ref(row_bound, spec.log2_hadamard, spec.scale_mode)))
            else:
                rs.fill_(2.0**-133)
    else:
        if two_phase:
            _QUANTIZE[grid](*args, PHASE=1, **meta)
        _QUANTIZE[grid](*args, PHASE=2 if two_phase else 0, **meta)
    out = {}
    if packed:
        out["mx"] = MXFP4Tensor(codes, scales, x.shape, dim, 32)
    if e4m3:
        out["e4m3"] = e4
        out["row_scale"] = rs
    return out

