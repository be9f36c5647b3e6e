"""The one dispatch point: which implementation quantizes operands and runs the MXFP4 GEMMs.

A backend has two operations, both in the NT form of ``ops.operand``:

* ``quantize(x, dim, spec, zero_outer=None) -> MXFP4Tensor``: a 2-D operand along its
  contraction dim ``dim``; ``zero_outer`` (int64 indices of outer-dim slices) are zeroed first,
  which is where outlier extraction removes what it computes in high precision (a kernel can
  fuse that into its one pass over the tensor);
* ``mm_nt(a, b, out_dtype) -> Tensor``: ``C[M, N] = A[M, K] @ B[N, K]^T`` with fp32 accumulation.

``reference`` (dequantize to float32, then a float32 matmul: every product of two MXFP4 values is
exact in float32, so the only rounding is the accumulation) runs on the CPU and on any GPU. The
Triton, Hopper FP8 and native-MX backends register here when they land; the layers above only
ever call ``get_backend``. Asking for a backend that is not available is an error, never a silent
fallback.
"""

from __future__ import annotations

import torch

from adahop.formats.mxfp4 import MXFP4Tensor, dequantize_mxfp4
from adahop.ops.operand import OperandSpec, quantize_operand


class ReferenceBackend:
    """Pure-PyTorch reference: the numerics every other backend must reproduce."""

    name = "reference"

    def quantize(
        self,
        x: torch.Tensor,
        dim: int,
        spec: OperandSpec,
        zero_outer: torch.Tensor | None = None,
    ) -> MXFP4Tensor:
        if x.dim() != 2:
            raise ValueError(f"GEMM operands are 2-D, got shape {tuple(x.shape)}")
        if zero_outer is not None and zero_outer.numel():
            x = x.index_fill(1 - dim % 2, zero_outer, 0)
        return quantize_operand(x, dim, spec)

    def mm_nt(self, a: MXFP4Tensor, b: MXFP4Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        if a.padded_size != b.padded_size or a.block_size != b.block_size:
            raise ValueError(
                f"operands disagree along K: padded {a.padded_size} vs {b.padded_size}, "
                f"block {a.block_size} vs {b.block_size}"
            )
        a_f32 = dequantize_mxfp4(a, keep_padding=True)
        b_f32 = dequantize_mxfp4(b, keep_padding=True)
        return (a_f32 @ b_f32.t()).to(out_dtype)


_BACKENDS = {"reference": ReferenceBackend()}


def available_backends() -> tuple[str, ...]:
    return tuple(_BACKENDS)


def get_backend(name: str = "auto", device: torch.device | str | None = None):
    """The backend called ``name``; ``"auto"`` picks the fastest exact one for ``device``
    (today: ``reference`` everywhere)."""
    if name == "auto":
        return _BACKENDS["reference"]
    if name not in _BACKENDS:
        raise ValueError(f"backend {name!r} is not available; available: {('auto',) + available_backends()}")
    return _BACKENDS[name]
