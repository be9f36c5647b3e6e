"""What one GEMM operand goes through before the MXFP4 GEMM: pad, [signs +] Hadamard, quantize.

Every GEMM in this library is written in "NT" form, ``C[M, N] = A[M, K] @ B[N, K]^T``: both
operands carry the contraction dim K *last* in their quantized layout (the layout of
``MXFP4Tensor``, and the one ``torch._scaled_mm`` wants: A row-major, B column-major). The three
GEMMs of a linear layer (x_TK activation, w_NK weight, g_TN output gradient):

    fprop  y_TN  = x_TK  . w_NK^T    A = x quantized along K (dim 1), B = w along K (dim 1)
    dgrad  dx_TK = g_TN  . w_NK      A = g along N (dim 1),           B = w along N (dim 0)
    wgrad  dw_NK = g_TN^T . x_TK     A = g along T (dim 0),           B = x along T (dim 0)

(``gemm_geometry.GEOMETRY`` holds this table for the code.)

``OperandSpec`` (``transforms.operand_spec``, re-exported here) says how an operand is quantized;
both operands of a GEMM must use the same padding, Hadamard size and signs along K, or the
transform would not cancel.

Padding: K is zero-padded to a multiple of ``max(block_size, hadamard_size)`` (both powers of
two) before the transform; zeros in both operands add nothing to the product.
"""

from __future__ import annotations

import torch

from adahop.formats.mxfp4 import MXFP4Tensor, pad_to_multiple, quantize_mxfp4
from adahop.formats.rng import SRStream
from adahop.transforms.hadamard import block_hadamard, random_signs
from adahop.transforms.operand_spec import OperandSpec  # public here too (and as adahop.ops.OperandSpec)


def transform_along(x: torch.Tensor, dim: int, spec: OperandSpec) -> torch.Tensor:
    """Pad ``x`` along ``dim`` to the spec's alignment and apply [signs +] block Hadamard there.
    Returns float32 with the (padded) dim moved last, contiguous."""
    x_last = pad_to_multiple(x.movedim(dim, -1).to(torch.float32), spec.alignment)
    if spec.hadamard_size is not None:
        signs = None
        if spec.signs_seed is not None:
            signs = random_signs(x_last.shape[-1], spec.signs_seed, device=x.device)
        x_last = block_hadamard(x_last, dim=-1, size=spec.hadamard_size, signs=signs)
    return x_last.contiguous()


def quantize_operand(x: torch.Tensor, dim: int, spec: OperandSpec) -> MXFP4Tensor:
    """Quantize a 2-D GEMM operand along its contraction dim ``dim`` (reference numerics)."""
    x_last = transform_along(x, dim, spec)
    q = quantize_mxfp4(
        x_last,
        dim=-1,
        block_size=spec.block_size,
        scale_mode=spec.scale_mode,
        rounding=spec.rounding,
        seed=spec.sr_seed.seed() if isinstance(spec.sr_seed, SRStream) else spec.sr_seed,
    )
    # Record the caller's orientation: codes are [outer, K_padded/2] either way.
    shape = x.shape
    return MXFP4Tensor(q.codes, q.scale_e8m0, shape, dim % x.dim(), q.block_size)
