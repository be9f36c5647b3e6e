"""The one dispatch point: which implementation quantizes operands and runs the MXFP4 GEMMs.

A backend has three operations, all in the NT form of ``ops.operand``:

* ``quantize(x, dim, spec, zero_outer=None, cast_to=None)``: a 2-D operand along its
  contraction dim ``dim``, in whatever form the backend's GEMM consumes; ``zero_outer`` (int64
  indices of outer slices that outlier extraction computes in high precision) may be zeroed
  first; the reference does, which is the paper's description; a backend may skip it (see
  ``kernel_backends``); ``cast_to``: the operand is ``x.to(cast_to)`` (the layer's float32
  weight under bf16 autocast: the Triton backends round it in the kernel's loads instead of
  writing a cast copy);
* ``quantize_packed(...)``: the same as an ``MXFP4Tensor`` (packed 4-bit: what is saved for the
  backward);
* ``mm_nt(a, b, out_dtype)``: ``C[M, N] = A[M, K] @ B[N, K]^T`` with fp32 accumulation; ``a``/``b``
  are what ``quantize`` returned, or ``MXFP4Tensor``s;
* ``select_outer(t, outer_dim, k, norms=None)``: the sorted indices of the k outer slices of 2-D
  ``t`` that outlier extraction computes in high precision (``ops.outliers``: the same slices on
  every backend); ``norms``: their L2 norms, where the caller has them already;
* optionally, two quantizations of one tensor from the same reads, bit for bit those of two
  calls: ``quantize_both(x, spec_cols, spec_rows, row_norms=False)`` (the backward's gradient,
  both orientations in the GEMM form) and ``quantize_and_pack(x, spec_cols, spec_rows,
  col_norms=False)`` (the forward's activation: along dim 1 in the GEMM form, along dim 0
  packed, to save). Each returns ``(a, b, norms)``: the L2 norms of x's rows / columns when
  asked (for outlier extraction, from the same reads), else None. ``hopper_fp8`` has them; the
  layer calls two quantizations where a backend does not.

Backends: ``reference`` (pure PyTorch, CPU and any GPU), ``triton`` (the fused Triton quantize
kernel + the reference GEMM; also under ``TRITON_INTERPRET=1`` on the CPU), ``hopper_fp8``
(Triton quantize to e4m3 + row scales, ``torch._scaled_mm`` on FP8 tensor cores: CUDA GPUs of
compute capability 8.9 or more) and ``native_mx`` (the packed MXFP4 operands into
``tl.dot_scaled``: only GPUs with MX tensor cores that Triton lowers it to natively, NVIDIA
compute capability 10.x and AMD gfx950). On Hopper, Triton's ``tl.dot_scaled`` upcasts to BF16
and runs at 0.15x BF16 (measured on the H200), so ``native_mx`` is refused there, even when asked
for by name.

``auto`` picks ``native_mx`` on MX tensor cores, else ``hopper_fp8`` on FP8 tensor cores, else
``reference``. Asking for a backend that cannot run is an error naming why, never a silent
fallback.
"""

from __future__ import annotations

import os

import torch

from adahop.config import BACKEND_CHOICES, BACKEND_NAMES
from adahop.formats.mxfp4 import MXFP4Tensor, dequantize_mxfp4
from adahop.ops.operand import OperandSpec, quantize_operand
from adahop.ops.outliers import largest_k, topk_outer


class ReferenceBackend:
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


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def native_mx_arch(device) -> str | None:
    """The architecture name of ``device`` if ``native_mx`` runs there, else None: GPUs with MX
    (block-scaled FP4) tensor cores to which Triton lowers ``tl.dot_scaled`` natively, NVIDIA
    compute capability 10.x (data-centre Blackwell) and AMD gfx950 (CDNA4). Consumer Blackwell
    (12.x) has block-scaled MMA too, but Triton's native lowering for it came later than the
    Triton 3.6 we test with (for 12.1 in 2026), and without it ``tl.dot_scaled`` silently runs
    the BF16 emulation, so those GPUs are left to ``hopper_fp8`` until checked."""
    dev = _device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return None
    if getattr(torch.version, "hip", None):
        arch = torch.cuda.get_device_properties(dev).gcnArchName.split(":")[0]
        return arch if arch == "gfx950" else None
    major, minor = torch.cuda.get_device_capability(dev)
    return f"sm_{major}{minor}" if major == 10 else None


def _device(device) -> torch.device:
    return torch.device(device) if device is not None else torch.device("cpu")


def unavailable_reason(name: str, device=None) -> str | None:
    """Why backend ``name`` cannot run on ``device`` (None when it can)."""
    if name not in BACKEND_NAMES:
        return f"unknown backend {name!r}; known: {BACKEND_CHOICES}"
    dev = _device(device)
    if name in ("triton", "hopper_fp8", "native_mx") and not triton_available():
        return f"backend {name!r} needs triton (pip install triton)"
    if name == "triton" and dev.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return "backend 'triton' runs on the CPU only under TRITON_INTERPRET=1"
    if name == "hopper_fp8":
        if dev.type != "cuda" or not torch.cuda.is_available():
            return f"backend 'hopper_fp8' needs a CUDA GPU, got device {dev}"
        if torch.cuda.get_device_capability(dev) < (8, 9):
            return "backend 'hopper_fp8' needs FP8 tensor cores (compute capability >= 8.9)"
    if name == "native_mx":
        if dev.type != "cuda" or not torch.cuda.is_available():
            return f"backend 'native_mx' needs a GPU with MX tensor cores, got device {dev}"
        if native_mx_arch(dev) is None:
            return ("backend 'native_mx' needs MX tensor cores that Triton lowers tl.dot_scaled to "
                    f"(NVIDIA compute capability 10.x, AMD gfx950); on {torch.cuda.get_device_name(dev)} "
                    "tl.dot_scaled would run as a BF16 emulation (0.15x BF16's speed on an H200); "
                    "use 'hopper_fp8' (FP8 tensor cores) or 'auto'")
    return None


_INSTANCES: dict = {}  # backend name -> instance; (name, device) -> the instance it resolved to


def get_backend(name: str = "auto", device: torch.device | str | None = None):
    """The backend called ``name`` for ``device``; ``"auto"`` picks the first of ``native_mx``,
    ``hopper_fp8`` and ``reference`` that can run there. Each layer asks once per forward, so a
    resolved (name, device) is remembered: the checks query the device."""
    key = (name, str(_device(device)))
    found = _INSTANCES.get(key)
    if found is not None:
        return found
    resolved = name
    if name == "auto":
        resolved = next(n for n in ("native_mx", "hopper_fp8", "reference") if unavailable_reason(n, device) is None)
    reason = unavailable_reason(resolved, device)
    if reason is not None:
        raise ValueError(reason)
    if resolved not in _INSTANCES:
        if resolved == "reference":
            _INSTANCES[resolved] = ReferenceBackend()
        else:
            from adahop.ops import kernel_backends

            _INSTANCES[resolved] = {
                "triton": kernel_backends.TritonBackend,
                "hopper_fp8": kernel_backends.HopperFP8Backend,
                "native_mx": kernel_backends.NativeMXBackend,
            }[resolved]()
    _INSTANCES[key] = _INSTANCES[resolved]
    return _INSTANCES[key]


def available_backends(device=None) -> tuple[str, ...]:
    return tuple(n for n in BACKEND_NAMES if unavailable_reason(n, device) is None)
