"""Unpack a saved MXFP4 operand (packed codes + E8M0 bytes) into the Hopper GEMM form: float8
e4m3 elements and one float32 scale per row, with the fold of ``kernels.quantize``: element =
``e2m1 value * 2**(e_block - e_rowmax + 6)``, row scale ``2**(e_rowmax - 6)``; exact wherever a
block lies within 14 binades of its row's largest.

Two launches: the rows' largest block exponents from the scale bytes alone (1/16 of the data),
then one program per (row group, chunk) that converts the codes: a pure bandwidth pass with a
2-D grid, so an operand with few long rows (x saved along T: R = features) still fills the GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from adahop.formats.mxfp4 import MXFP4Tensor
from adahop.kernels.launch import INTERPRETED, FastLauncher, cdiv, nan_bytes_view
from adahop.kernels.mxfp4_math import pow2


@triton.jit
def _row_exponent_kernel(scales_ptr, emax_ptr, rowscale_ptr, R, NSB, BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr):
    """Each row's largest block exponent (NaN blocks, byte 0xFF, excluded; -127 for none) and
    its row scale ``2**(e_rowmax - 6)``."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < R
    e_rowmax = tl.full((BLOCK_R,), -127, tl.int32)
    for b0 in range(0, NSB, BLOCK_B):
        bidx = b0 + tl.arange(0, BLOCK_B)
        m = row_ok[:, None] & (bidx[None, :] < NSB)
        sb = tl.load(scales_ptr + rows[:, None].to(tl.int64) * NSB + bidx[None, :], mask=m, other=0).to(tl.int32)
        e_rowmax = tl.maximum(e_rowmax, tl.max(tl.where(sb == 255, -127, sb - 127), axis=1))
    tl.store(emax_ptr + rows, e_rowmax, mask=row_ok)
    tl.store(rowscale_ptr + rows, pow2(e_rowmax - 6), mask=row_ok)


@triton.jit
def _mxfp4_unpack_kernel(
    codes_ptr, scales_ptr, emax_ptr, e4m3_ptr, e4m3_bits_ptr, R, KP,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, NAN_BY_CAST: tl.constexpr,
):
    """Program (i, c): rows [i * BLOCK_R, (i + 1) * BLOCK_R), columns [c * BLOCK_K, (c + 1) * BLOCK_K)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    k0 = tl.program_id(1) * BLOCK_K
    row_ok = rows < R
    NB: tl.constexpr = BLOCK_K // 32
    NSB = KP // 32

    bidx = k0 // 32 + tl.arange(0, NB)
    sb = tl.load(scales_ptr + rows[:, None].to(tl.int64) * NSB + bidx[None, :],
                 mask=row_ok[:, None] & (bidx[None, :] < NSB), other=0).to(tl.int32)
    e_ref = tl.load(emax_ptr + rows, mask=row_ok, other=-127)[:, None]
    pcols = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    pm = row_ok[:, None] & (pcols[None, :] < KP // 2)
    p = tl.load(codes_ptr + rows[:, None].to(tl.int64) * (KP // 2) + pcols[None, :], mask=pm, other=0).to(tl.int32)
    code = tl.reshape(tl.join(p & 0xF, p >> 4), (BLOCK_R, NB, 32))  # low nibble = even element
    # E2M1 magnitude from bits: code c >= 2 is the float with exponent (c >> 1) - 1 and mantissa
    # bit c & 1, i.e. bits (c << 22) + 0x3F000000; c = 0, 1 are 0 and 0.5 (c * 0x3F000000).
    c = code & 7
    mag = tl.where(c >= 2, (c << 22) + 0x3F000000, c * 0x3F000000).to(tl.float32, bitcast=True)
    shift = tl.maximum(sb - 127 - e_ref + 6, -126)
    val = mag * pow2(shift)[:, :, None]
    val = (val.to(tl.int32, bitcast=True) | ((code >> 3) << 31)).to(tl.float32, bitcast=True)  # code 8: -0
    cols = k0 + tl.arange(0, BLOCK_K)
    eoffs = rows[:, None].to(tl.int64) * KP + cols[None, :]
    em = row_ok[:, None] & (cols[None, :] < KP)
    finite = sb != 255
    if NAN_BY_CAST:  # one vectorizable store; the GPU's cvt turns NaN into 0x7F
        val = tl.where(finite[:, :, None], val, float("nan"))
        tl.store(e4m3_ptr + eoffs, tl.reshape(val, (BLOCK_R, BLOCK_K)).to(tl.float8e4nv), mask=em)
    else:  # the interpreter's fp8 cast gets NaN wrong: NaN blocks get 0x7F through a uint8 view
        fin = tl.reshape(tl.broadcast_to(finite[:, :, None], (BLOCK_R, NB, 32)), (BLOCK_R, BLOCK_K))
        tl.store(e4m3_ptr + eoffs, tl.reshape(val, (BLOCK_R, BLOCK_K)).to(tl.float8e4nv), mask=em & fin)
        tl.store(e4m3_bits_ptr + eoffs, tl.full((BLOCK_R, BLOCK_K), 0x7F, tl.uint8), mask=em & (~fin))


_ROW_EXPONENT = FastLauncher(_row_exponent_kernel)
_UNPACK = FastLauncher(_mxfp4_unpack_kernel)


def unpack_to_e4m3(q: MXFP4Tensor, *, block_r: int = 16, block_k: int = 256, num_warps: int = 4):
    """(e4m3 [R, KP], row_scale [R]) of a 2-D-layout MXFP4Tensor (quantization dim last)."""
    if q.block_size != 32 or q.codes.dim() != 2:
        raise ValueError("unpack_to_e4m3 takes a 2-D MXFP4Tensor with blocks of 32")
    for name, v, lo in (("block_r", block_r, 1), ("block_k", block_k, 32)):
        if v < lo or v & (v - 1):
            raise ValueError(f"{name} must be a power of two >= {lo}, got {v}")
    R, KP = q.codes.shape[0], q.padded_size
    dev = q.codes.device
    e4 = torch.empty((R, KP), dtype=torch.float8_e4m3fn, device=dev)
    rs = torch.empty((R,), dtype=torch.float32, device=dev)
    if R == 0:
        return e4, rs
    emax = torch.empty((R,), dtype=torch.int32, device=dev)
    _ROW_EXPONENT[(cdiv(R, block_r),)](q.scale_e8m0, emax, rs, R, KP // 32, BLOCK_R=block_r, BLOCK_B=64,
                                       num_warps=num_warps)
    if KP:
        _UNPACK[(cdiv(R, block_r), cdiv(KP, block_k))](
            q.codes, q.scale_e8m0, emax, e4, nan_bytes_view(e4), R, KP,
            BLOCK_R=block_r, BLOCK_K=block_k, NAN_BY_CAST=not INTERPRETED,
            num_warps=num_warps,
        )
    return e4, rs
