"""MXFP4 x MXFP4 GEMM on MX tensor cores: ``tl.dot_scaled`` over the packed operands.

``C[M, N] = A[M, K] @ B[N, K]^T`` where A and B are ``MXFP4Tensor``s quantized along K in the
2-D layout of ``formats.mxfp4`` (codes ``[R, KP // 2]``, the even element in the low nibble;
E8M0 bytes ``[R, KP // 32]``): exactly what the quantize kernel writes and the forward saves, so
nothing is converted before the GEMM. Each program owns a ``BLOCK_M x BLOCK_N`` tile of C and
walks K in steps of ``BLOCK_K``; ``tl.dot_scaled(a, a_scale, "e2m1", b, b_scale, "e2m1", acc)``
multiplies the E2M1 elements by their block scales and accumulates in float32, so C is the
reference MXFP4 GEMM (dequantize, float32 matmul) up to float32 accumulation order.

Hardware. On GPUs with MX tensor cores that Triton 3.6 lowers it to natively (NVIDIA compute
capability 10.x, AMD gfx950) ``tl.dot_scaled`` is the native block-scaled MMA; consumer Blackwell
(12.x) is refused until checked (``ops.backends.native_mx_arch``). On Hopper it decomposes it into an
upcast to BF16 and a BF16 MMA: 108 TFLOP/s at 8192^3 on the H200, 0.15x a cuBLAS BF16 GEMM
(``benchmarks/bench_gemm.py --sections mx``): correct, and how we test this kernel on the H200,
but never chosen there (``ops.backends`` gates it; docs/kernels.md, 'The native MX GEMM').

Edges. Rows past M or N and K past KP load code 0 with scale byte 127 (the value 0), so ragged
tiles need no special case. A NaN block (scale byte 0xFF) makes its dot products NaN, as in the
reference. The CPU interpreter of Triton 3.6 has no ``dot_scaled``; with ``DOT_SCALED=False`` the
kernel decodes both tiles to float32 itself (the reference's decode) and calls ``tl.dot``, so CI
checks everything but the MMA instruction: the tiling, addressing, masks and the epilogue.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from adahop.formats.mxfp4 import MXFP4Tensor
from adahop.kernels.launch import cdiv
from adahop.kernels.mxfp4_math import pow2


@triton.jit
def _decode_e2m1(codes, scale_bytes, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """[ROWS, BLOCK_K // 2] packed codes and [ROWS, BLOCK_K // 32] E8M0 bytes -> [ROWS, BLOCK_K]
    float32, as ``formats.mxfp4.dequantize_mxfp4`` (byte 0xFF: NaN)."""
    c = tl.reshape(tl.join(codes & 0xF, codes >> 4), (ROWS, BLOCK_K // 32, 32)).to(tl.int32)
    m = c & 7
    # E2M1 magnitude from bits: m >= 2 is the float with exponent (m >> 1) - 1 and mantissa bit
    # m & 1; m = 0, 1 are 0 and 0.5.
    mag = tl.where(m >= 2, (m << 22) + 0x3F000000, m * 0x3F000000).to(tl.float32, bitcast=True)
    mag = tl.where(c >= 8, -mag, mag)
    s = scale_bytes.to(tl.int32)
    scale = tl.where(s == 255, float("nan"), pow2(s - 127))
    return tl.reshape(mag * scale[:, :, None], (ROWS, BLOCK_K))


@triton.jit
def _mxfp4_gemm_kernel(
    a_codes_ptr, a_scales_ptr, b_codes_ptr, b_scales_ptr, c_ptr, M, N, KP,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    DOT_SCALED: tl.constexpr, OUT_BF16: tl.constexpr,
):
    # Grouped program order: GROUP_M row tiles share each column tile while it is in L2.
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    a_rows = rm.to(tl.int64)[:, None]
    b_rows = rn.to(tl.int64)[:, None]
    KB = KP // 2  # bytes of codes per row
    NSB = KP // 32  # scale bytes per row
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, KP, BLOCK_K):
        kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        ks = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        kb_ok = kb < KB
        ks_ok = ks < NSB
        a = tl.load(a_codes_ptr + a_rows * KB + kb[None, :], mask=m_ok[:, None] & kb_ok[None, :], other=0)
        b = tl.load(b_codes_ptr + b_rows * KB + kb[None, :], mask=n_ok[:, None] & kb_ok[None, :], other=0)
        sa = tl.load(a_scales_ptr + a_rows * NSB + ks[None, :], mask=m_ok[:, None] & ks_ok[None, :], other=127)
        sb = tl.load(b_scales_ptr + b_rows * NSB + ks[None, :], mask=n_ok[:, None] & ks_ok[None, :], other=127)
        if DOT_SCALED:
            # rhs is [K // 2, N], packed along K: B's rows, transposed.
            acc = tl.dot_scaled(a, sa, "e2m1", tl.trans(b), sb, "e2m1", acc)
        else:
            a_f = _decode_e2m1(a, sa, BLOCK_M, BLOCK_K)
            b_f = _decode_e2m1(b, sb, BLOCK_N, BLOCK_K)
            acc = tl.dot(a_f, tl.trans(b_f), acc, input_precision="ieee")
    c_mask = m_ok[:, None] & n_ok[None, :]
    if OUT_BF16:
        # float32 -> bfloat16, round to nearest even, from the bits (Triton's interpreter
        # truncates in its cast); NaN stays a quiet NaN. c_ptr is the output viewed as int16.
        bits = acc.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        bits = tl.where(acc != acc, 0x7FC0, bits)
        tl.store(c_ptr + a_rows * N + rn[None, :], bits.to(tl.int16), mask=c_mask)
    else:
        tl.store(c_ptr + a_rows * N + rn[None, :], acc.to(c_ptr.dtype.element_ty), mask=c_mask)


def _check_operand(q, what: str) -> None:
    if not isinstance(q, MXFP4Tensor):
        raise ValueError(f"{what} must be an MXFP4Tensor, got {type(q).__name__}")
    if q.block_size != 32 or q.codes.dim() != 2:
        raise ValueError(f"{what}: the MX GEMM takes 2-D MXFP4 operands with blocks of 32, got block "
                         f"{q.block_size} and codes of shape {tuple(q.codes.shape)}")
    if q.codes.dtype != torch.uint8 or q.scale_e8m0.dtype != torch.uint8:
        raise ValueError(f"{what}: codes and scale bytes must be uint8")
    if not (q.codes.is_contiguous() and q.scale_e8m0.is_contiguous()):
        raise ValueError(f"{what}: codes and scale bytes must be contiguous")


def mxfp4_gemm_nt(
    a: MXFP4Tensor,
    b: MXFP4Tensor,
    out_dtype: torch.dtype = torch.float32,
    *,
    block_m: int = 128,
    block_n: int = 128,
    block_k: int = 128,
    group_m: int = 8,
    num_warps: int = 8,
    num_stages: int = 3,
    dot_scaled: bool | None = None,
) -> torch.Tensor:
    """``A @ B^T`` of two MXFP4 operands quantized along K (see the module doc), float32
    accumulation, written as ``out_dtype`` (float32, bfloat16 or float16).

    ``dot_scaled``: None uses ``tl.dot_scaled`` except under the CPU interpreter (which lacks it);
    False decodes in the kernel and uses ``tl.dot`` (the interpreter's path)."""
    _check_operand(a, "a")
    _check_operand(b, "b")
    if a.padded_size != b.padded_size:
        raise ValueError(f"operands disagree along K: padded {a.padded_size} vs {b.padded_size}")
    if out_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"out_dtype must be float32, bfloat16 or float16, got {out_dtype}")
    for name, v, lo in (("block_m", block_m, 16), ("block_n", block_n, 16), ("block_k", block_k, 64)):
        if v < lo or v & (v - 1):
            raise ValueError(f"{name} must be a power of two >= {lo}, got {v}")
    if a.codes.device != b.codes.device:
        raise ValueError(f"operands on different devices: {a.codes.device} and {b.codes.device}")
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if dot_scaled is None:
        dot_scaled = not interpret
    if dot_scaled and interpret:
        raise ValueError("Triton's CPU interpreter has no tl.dot_scaled: use dot_scaled=False")
    M, N, KP = a.codes.shape[0], b.codes.shape[0], a.padded_size
    c = torch.empty((M, N), dtype=out_dtype, device=a.codes.device)
    if M == 0 or N == 0:
        return c
    if KP == 0:
        return c.zero_()
    grid = (cdiv(M, block_m) * cdiv(N, block_n),)
    _mxfp4_gemm_kernel[grid](
        a.codes, a.scale_e8m0, b.codes, b.scale_e8m0,
        c.view(torch.int16) if out_dtype == torch.bfloat16 else c, M, N, KP,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m, DOT_SCALED=dot_scaled,
        OUT_BF16=out_dtype == torch.bfloat16,
        num_warps=num_warps, num_stages=num_stages,
    )
    return c
