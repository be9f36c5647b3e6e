"""Backend ``reference``: pure PyTorch, on the CPU and any GPU. Its numerics are the ones every
other backend reproduces (docs/method.md); ``auto`` takes it where nothing faster runs."""

from __future__ import annotations

import torch

from adahop.formats.mxfp4 import MXFP4Tensor, dequantize_mxfp4
from adahop.ops.backends.protocol import Backend, BackendEntry
from adahop.ops.operand import OperandSpec, quantize_operand
from adahop.ops.outliers import largest_k, topk_outer


class ReferenceBackend(Backend):
    """Pure-PyTorch reference: the numerics every other backend must reproduce."""

    name = "reference"

    def quantize(
        self,
        x: torch.Tensor,
        dim: int,
        spec: OperandSpec,
        zero_outer: torch.Tensor | None = None,
        cast_to: torch.dtype | None = None,
    ) -> MXFP4Tensor:
        if x.dim() != 2:
            raise ValueError(f"GEMM operands are 2-D, got shape {tuple(x.shape)}")
        if cast_to is not None:
            x = x.to(cast_to)
        if zero_outer is not None and zero_outer.numel():
            x = x.index_fill(1 - dim % 2, zero_outer, 0)
        return quantize_operand(x, dim, spec)

    quantize_packed = quantize

    @staticmethod
    def select_outer(t: torch.Tensor, outer_dim: int, k: int, norms: torch.Tensor | None = None) -> torch.Tensor:
        return topk_outer(t, outer_dim, k) if norms is None else largest_k(norms, k)

    def mm_nt(self, a: MXFP4Tensor, b: MXFP4Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        if a.padded_size != b.padded_size or a.block_size != b.block_size:
            raise ValueError(
                f"operands disagree along K: padded {a.padded_size} vs {b.padded_size}, "
                f"block {a.block_size} vs {b.block_size}"
            )
        a_f32 = dequantize_mxfp4(a, keep_padding=True)
        b_f32 = dequantize_mxfp4(b, keep_padding=True)
        return (a_f32 @ b_f32.t()).to(out_dtype)


ENTRY = BackendEntry("reference", unavailable=lambda device: None, factory=ReferenceBackend, auto_rank=30)
