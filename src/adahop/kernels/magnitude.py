"""Each row's and each column's largest magnitude of a 2-D tensor from one read: the row bounds of
both orientations of the backward's gradient g [T, N] (``layer.bounds``), which PyTorch takes in
two reductions, two reads of g.

A program owns ``BLOCK_R`` rows and walks their columns in chunks of ``BLOCK_C``: it keeps the
rows' running maxima and writes each chunk's column maxima of its rows as partials
``[programs, C]``, which a ``torch.amax`` over programs reduces (1/``BLOCK_R`` of g's elements,
in float32). NaN propagates, as in ``torch.linalg.vector_norm(t, inf)``: the same values, a
maximum being exact in any order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from adahop.kernels.launch import INTERPRETED, FastLauncher, cdiv

INTERPRETED_JIT: tl.constexpr = tl.constexpr(INTERPRETED)
BLOCK_R = 64  # rows per program: the partials are 1/64 of the elements
BLOCK_C = 128  # columns per chunk


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _absmax(a, axis: tl.constexpr):
    """The largest of non-negative ``a`` along ``axis``, NaN if any is NaN."""
    if INTERPRETED_JIT:  # a combine function of our own runs element by element under the interpreter
        nan = tl.max((a != a).to(tl.int32), axis) > 0
        return tl.where(nan, float("nan"), tl.max(a, axis))
    return tl.reduce(a, axis, _max_nan)


@triton.jit
def _row_col_absmax_kernel(x_ptr, stride_r, stride_c, R, C, row_ptr, colpart_ptr,
                           BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < R
    rmax = tl.zeros((BLOCK_R,), tl.float32)
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        col_ok = cols < C
        ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_r + cols[None, :].to(tl.int64) * stride_c
        a = tl.abs(tl.load(ptrs, mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32))
        rmax = _max_nan(rmax, _absmax(a, 1))
        tl.store(colpart_ptr + pid.to(tl.int64) * C + cols, _absmax(a, 0), mask=col_ok)
    tl.store(row_ptr + rows, rmax, mask=row_ok)


_ROW_COL_ABSMAX = FastLauncher(_row_col_absmax_kernel)


def row_col_absmax(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x.abs().amax(1), x.abs().amax(0))`` of a 2-D floating-point ``x``, as float32, from one
    read (NaN where a row or column holds NaN; 0 for a dim of no elements)."""
    if x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"row_col_absmax takes a 2-D floating-point tensor, got {x.dtype} {tuple(x.shape)}")
    R, C = x.shape
    rows = torch.zeros(R, dtype=torch.float32, device=x.device)
    if R == 0 or C == 0:
        return rows, torch.zeros(C, dtype=torch.float32, device=x.device)
    programs = cdiv(R, BLOCK_R)
    part = torch.empty((programs, C), dtype=torch.float32, device=x.device)
    _ROW_COL_ABSMAX[(programs,)](x, x.stride(0), x.stride(1), R, C, rows, part,
                                 BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C, num_warps=4)
    return rows, part.amax(0)
