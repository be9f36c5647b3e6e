"""Unpack a saved MXFP4 operand (packed codes + E8M0 bytes) into the Hopper GEMM form: float8
e4m3 elements and one float32 scale per row, with the fold of ``kernels.quantize``: element =
``e2m1 value * 2**(e_block - e_rowmax + 6)``, row scale ``2**(e_rowmax - 6)``; exact wherever a
block lies within 14 binades of its row's largest. Two passes per row tile: the scale bytes (to
find the row's largest exponent; 1/16 of the data), then the codes."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from adahop.formats.mxfp4 import MXFP4Tensor
from adahop.kernels.mxfp4_math import e2m1_value, pow2


@triton.jit
def _mxfp4_unpack_kernel(
    codes_ptr, scales_ptr, e4m3_ptr, e4m3_bits_ptr, rowscale_ptr, R, KP,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < R
    NB: tl.constexpr = BLOCK_K // 32
    NSB = KP // 32

    e_rowmax = tl.full((BLOCK_R,), -127, tl.int32)
    for b0 in range(0, NSB, NB):
        bidx = b0 + tl.arange(0, NB)
        m = row_ok[:, None] & (bidx[None, :] < NSB)
        sb = tl.load(scales_ptr + rows[:, None].to(tl.int64) * NSB + bidx[None, :], mask=m, other=0).to(tl.int32)
        e_rowmax = tl.maximum(e_rowmax, tl.max(tl.where(sb == 255, -127, sb - 127), axis=1))
    tl.store(rowscale_ptr + rows, pow2(e_rowmax - 6), mask=row_ok)

    for k0 in range(0, KP, BLOCK_K):
        bidx = k0 // 32 + tl.arange(0, NB)
        sm = row_ok[:, None] & (bidx[None, :] < NSB)
        sb = tl.load(scales_ptr + rows[:, None].to(tl.int64) * NSB + bidx[None, :], mask=sm, other=0).to(tl.int32)
        pcols = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        pm = row_ok[:, None] & (pcols[None, :] < KP // 2)
        p = tl.load(codes_ptr + rows[:, None].to(tl.int64) * (KP // 2) + pcols[None, :], mask=pm, other=0).to(tl.int32)
        code = tl.reshape(tl.join(p & 0xF, p >> 4), (BLOCK_R, NB, 32))
        shift = tl.maximum(sb - 127 - e_rowmax[:, None] + 6, -126)
        val = e2m1_value(code & 7) * pow2(shift)[:, :, None]
        val = (val.to(tl.int32, bitcast=True) | ((code >> 3) << 31)).to(tl.float32, bitcast=True)  # code 8: -0
        val = tl.reshape(val, (BLOCK_R, BLOCK_K)).to(tl.float8e4nv)
        fin = tl.reshape(tl.broadcast_to((sb != 255)[:, :, None], (BLOCK_R, NB, 32)), (BLOCK_R, BLOCK_K))
        cols = k0 + tl.arange(0, BLOCK_K)
        eoffs = rows[:, None].to(tl.int64) * KP + cols[None, :]
        em = row_ok[:, None] & (cols[None, :] < KP)
        tl.store(e4m3_ptr + eoffs, val, mask=em & fin)
        tl.store(e4m3_bits_ptr + eoffs, tl.full((BLOCK_R, BLOCK_K), 0x7F, tl.uint8), mask=em & (~fin))


def unpack_to_e4m3(q: MXFP4Tensor, *, block_r: int = 16, block_k: int = 256, num_warps: int = 4):
    """(e4m3 [R, KP], row_scale [R]) of a 2-D-layout MXFP4Tensor (quantization dim last)."""
    if q.block_size != 32 or q.codes.dim() != 2:
        raise ValueError("unpack_to_e4m3 takes a 2-D MXFP4Tensor with blocks of 32")
    R, KP = q.codes.shape[0], q.padded_size
    e4 = torch.empty((R, KP), dtype=torch.float8_e4m3fn, device=q.codes.device)
    rs = torch.empty((R,), dtype=torch.float32, device=q.codes.device)
    grid = (triton.cdiv(R, block_r),)
    _mxfp4_unpack_kernel[grid](
        q.codes, q.scale_e8m0, e4, e4.view(torch.uint8), rs, R, KP,
        BLOCK_R=block_r, BLOCK_K=block_k, num_warps=num_warps,
    )
    return e4, rs
