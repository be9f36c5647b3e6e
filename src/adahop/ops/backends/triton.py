"""Backend ``triton``: the fused Triton quantize kernel (``kernels.quantize``) produces the packed
MXFP4 operand, the GEMM is the reference's (dequantize + float32 matmul). It runs wherever Triton
runs, the CPU interpreter included (``TRITON_INTERPRET=1``), which is how CI checks the kernels
inside the whole layer. ``auto`` never picks it (on a GPU a faster backend runs the same numerics).

What the backends built on the Triton kernels (this one, ``hopper_fp8``, ``native_mx``) share:

Outlier extraction: the slices are chosen by ``kernels.topk`` (one launch instead of
``torch.topk`` and a sort: the same indices) from the reference's norms, or, where
``quantize_both`` / ``quantize_and_pack`` read the tensor anyway, from norms that kernel summed
(the same L2 norms up to the order of the float additions, as the GEMMs are the reference's up
to accumulation order: a slice could only be swapped for another whose norm is equal to within
float32 rounding). The caller overwrites the output slices of the extracted rows/columns with
their high-precision result, and MXFP4 quantizes each outer slice on its own, so zeroing those
slices first (``zero_outer``) cannot change the result: these backends skip it (one pass less).
"""

from __future__ import annotations

import os

import torch

from adahop.formats.mxfp4 import MXFP4Tensor, dequantize_mxfp4
from adahop.ops.backends.protocol import Backend, BackendEntry, triton_missing
from adahop.ops.operand import OperandSpec
from adahop.ops.outliers import outer_norms


def cast_args(x: torch.Tensor, cast_to: torch.dtype | None) -> tuple[torch.Tensor, dict]:
    """The operand ``x.to(cast_to)`` as the kernel takes it: float32 to bfloat16 is rounded in
    the kernel's loads (``round_to_bf16``: no cast copy written and read again), any other cast
    is made first."""
    if cast_to is None or cast_to == x.dtype:
        return x, {}
    if x.dtype == torch.float32 and cast_to == torch.bfloat16:
        return x, {"round_to_bf16": True}
    return x.to(cast_to), {}


def select_outer(t: torch.Tensor, outer_dim: int, k: int, norms: torch.Tensor | None = None) -> torch.Tensor:
    """``ops.outliers.topk_outer`` with the selection in one Triton launch; ``norms``: the outer
    slices' L2 norms where a quantize kernel already computed them."""
    from adahop.kernels.topk import topk_indices

    return topk_indices(outer_norms(t, outer_dim) if norms is None else norms, k)


class TritonBackend(Backend):
    """Triton quantize kernel + the reference GEMM."""

    name = "triton"
    select_outer = staticmethod(select_outer)

    def quantize(self, x, dim, spec: OperandSpec, zero_outer=None, cast_to=None) -> MXFP4Tensor:
        return self.quantize_packed(x, dim, spec, zero_outer, cast_to)

    def quantize_packed(self, x, dim, spec: OperandSpec, zero_outer=None, cast_to=None) -> MXFP4Tensor:
        from adahop.kernels.quantize import quantize_operand_triton

        x, cast = cast_args(x, cast_to)
        return quantize_operand_triton(x, dim, spec, **cast)["mx"]

    def mm_nt(self, a: MXFP4Tensor, b: MXFP4Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        a_f32 = dequantize_mxfp4(a, keep_padding=True)
        b_f32 = dequantize_mxfp4(b, keep_padding=True)
        return (a_f32 @ b_f32.t()).to(out_dtype)


def unavailable(device: torch.device) -> str | None:
    reason = triton_missing("triton")
    if reason is None and device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        reason = "backend 'triton' runs on the CPU only under TRITON_INTERPRET=1"
    return reason


ENTRY = BackendEntry("triton", unavailable=unavailable, factory=TritonBackend)
