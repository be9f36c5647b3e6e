"""Backend ``native_mx``: the packed MXFP4 operands (what the quantize kernel writes) straight into
``tl.dot_scaled`` (``kernels.mx_gemm``): the block-scaled MMA of GPUs with MX tensor cores that
Triton lowers it to natively, NVIDIA compute capability 10.x and AMD gfx950. ``auto`` takes it
first where it runs. On Hopper, Triton's ``tl.dot_scaled`` upcasts to BF16 and runs at 0.15x BF16
(measured on the H200), so ``native_mx`` is refused there, even when asked for by name.
"""

from __future__ import annotations

import torch

from adahop.formats.mxfp4 import MXFP4Tensor
from adahop.ops.backends.protocol import BackendEntry, cuda_missing, triton_missing
from adahop.ops.backends.triton import TritonBackend


def native_mx_arch(device) -> str | None:
    """The architecture name of ``device`` if ``native_mx`` runs there, else None: GPUs with MX
    (block-scaled FP4) tensor cores to which Triton lowers ``tl.dot_scaled`` natively, NVIDIA
    compute capability 10.x (data-centre Blackwell) and AMD gfx950 (CDNA4). Consumer Blackwell
    (12.x) has block-scaled MMA too, but Triton's native lowering for it came later than the
    Triton 3.6 we test with (for 12.1 in 2026), and without it ``tl.dot_scaled`` silently runs
    the BF16 emulation, so those GPUs are left to ``hopper_fp8`` until checked."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if cuda_missing(dev):
        return None
    if getattr(torch.version, "hip", None):
        arch = torch.cuda.get_device_properties(dev).gcnArchName.split(":")[0]
        return arch if arch == "gfx950" else None
    major, minor = torch.cuda.get_device_capability(dev)
    return f"sm_{major}{minor}" if major == 10 else None


class NativeMXBackend(TritonBackend):
    """``triton``'s packed operands into ``tl.dot_scaled`` (``kernels.mx_gemm``) instead of the
    reference GEMM: GPUs with MX tensor cores. ``unavailable`` refuses it on Hopper, where
    ``tl.dot_scaled`` is emulated through BF16 (0.15x cuBLAS BF16 at 8192^3 on the H200, measured;
    docs/kernels.md, 'The native MX GEMM'). The class itself runs wherever Triton does (the CPU
    interpreter with an in-kernel decode in place of the MMA), which is how it is tested."""

    name = "native_mx"

    def mm_nt(self, a: MXFP4Tensor, b: MXFP4Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        from adahop.kernels.mx_gemm import mxfp4_gemm_nt

        return mxfp4_gemm_nt(a, b, out_dtype)


def unavailable(device: torch.device) -> str | None:
    reason = triton_missing("native_mx")
    if reason is not None:
        return reason
    if cuda_missing(device):
        return f"backend 'native_mx' needs a GPU with MX tensor cores, got device {device}"
    if native_mx_arch(device) is None:
        return ("backend 'native_mx' needs MX tensor cores that Triton lowers tl.dot_scaled to "
                f"(NVIDIA compute capability 10.x, AMD gfx950); on {torch.cuda.get_device_name(device)} "
                "tl.dot_scaled would run as a BF16 emulation (0.15x BF16's speed on an H200); "
                "use 'hopper_fp8' (FP8 tensor cores) or 'auto'")
    return None


ENTRY = BackendEntry("native_mx", unavailable=unavailable, factory=NativeMXBackend, auto_rank=10)
