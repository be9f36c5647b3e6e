"""Per-row unbiasing of the forward GEMM's MXFP4 product (``AdaHOPConfig.fprop_unbias``): round to
nearest shrinks the operands toward zero, and the factor that undoes it, row by row.

Rounding to the nearest grid value leaves an error e = Q(v) - v that is nearly orthogonal to
Q(v), so its component along v is about -|e|^2: the quantized operand is v shrunk by about
1 / SQNR (E2M1 blocks of 32 at 17-19 dB: 1-2%), and the GEMM's output by the sum of both
operands' shrinks (SmolLM2-135M's forward: -2.3% under naive MXFP4, -2.0% under IHT;
benchmarks/results/fprop_bias_smollm2_cpu_2026-12-07). The option scales the product back:

    C[m, n] = (Q(A) Q(B)^T)[m, n] * c_A[m] * c_B[n],   c[i] = <v_i, v_i> / <Q(v_i), v_i>

v_i a row of the operand (a token of x, an output channel of W) in the basis it is quantized in
(padded, after the Hadamard for the IHT modes), Q(v_i) its MXFP4 values: c makes the error of
c Q(v) orthogonal to v (no component along the operand). Q is the reference quantization
(``ops.operand.quantize_operand``, the bits every backend reproduces), the sums are float32 and
the scaling of C is in float32, rounded to C's dtype once. A row whose ``<Q(v), v>`` is not
positive (all zeros; NaN) keeps the factor 1. The factors cost one more quantization of each
operand in PyTorch: an experiment, not a fast path.
"""

from __future__ import annotations

import torch

from adahop.formats.mxfp4 import dequantize_mxfp4
from adahop.ops.operand import OperandSpec, quantize_operand, transform_along


def row_unbiasing(t: torch.Tensor, dim: int, spec: OperandSpec) -> torch.Tensor:
    """float32 ``c[i] = <v_i, v_i> / <Q(v_i), v_i>`` for each row ``i`` of the 2-D operand ``t``
    quantized along ``dim`` under ``spec`` (module doc); 1 where the denominator is not positive."""
    v = transform_along(t, dim, spec)
    q = dequantize_mxfp4(quantize_operand(t, dim, spec), keep_padding=True)
    num, den = v.pow(2).sum(-1), (q * v).sum(-1)
    return torch.where(den > 0, num / den, torch.ones_like(num))


def unbias_product(c: torch.Tensor, a_factors: torch.Tensor, b_factors: torch.Tensor) -> torch.Tensor:
    """``c * a_factors[:, None] * b_factors[None, :]`` in float32, rounded to c's dtype."""
    return (c.float() * a_factors[:, None] * b_factors[None, :]).to(c.dtype)
