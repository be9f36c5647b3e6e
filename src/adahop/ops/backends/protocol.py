"""What a backend is, and the record by which the registry (``ops.backends``) knows one.

A backend (a subclass of ``Backend``) has four operations, all in the NT form of ``ops.operand``:

* ``quantize(x, dim, spec, zero_outer=None, cast_to=None)``: a 2-D operand along its
  contraction dim ``dim``, in whatever form the backend's GEMM consumes; ``zero_outer`` (int64
  indices of outer slices that outlier extraction computes in high precision) may be zeroed
  first; the reference does, which is the paper's description; a backend may skip it (see
  ``ops.backends.triton``); ``cast_to``: the operand is ``x.to(cast_to)`` (the layer's float32
  weight under bf16 autocast: the Triton backends round it in the kernel's loads instead of
  writing a cast copy);
* ``quantize_packed(...)``: the same as an ``MXFP4Tensor`` (packed 4-bit: what is saved for the
  backward);
* ``mm_nt(a, b, out_dtype)``: ``C[M, N] = A[M, K] @ B[N, K]^T`` with fp32 accumulation; ``a``/``b``
  are what ``quantize`` returned, or ``MXFP4Tensor``s;
* ``select_outer(t, outer_dim, k, norms=None)``: the sorted indices of the k outer slices of 2-D
  ``t`` that outlier extraction computes in high precision (``ops.outliers``: the same slices on
  every backend); ``norms``: their L2 norms, where the caller has them already.

And two optional ones, None where a backend has none (the layer then makes two calls): two
quantizations of one tensor from the same reads, bit for bit those of two calls.
``quantize_both(x, spec_cols, spec_rows, row_norms=False)`` (the backward's gradient, both
orientations in the GEMM form) and ``quantize_and_pack(x, spec_cols, spec_rows, col_norms=False)``
(the forward's activation: along dim 1 in the GEMM form, along dim 0 packed, to save). Each
returns ``(a, b, norms)``: the L2 norms of x's rows / columns when asked (for outlier extraction,
from the same reads), else None. The layer asks ``has_quantize_both`` / ``has_quantize_and_pack``.

A backend whose GEMM form needs each row's scale first (``hopper_fp8``) sets ``takes_row_bounds``:
its ``quantize`` then takes ``row_bound`` (float32, one bound on each row's magnitudes:
``formats.e4m3_rows``), ``quantize_both`` ``bounds=(row_bound, col_bound)`` and
``quantize_and_pack`` ``row_bound``, and writes the operand in one pass. The layer gives them
(``layer.bounds``); other backends get none.

A ``BackendEntry`` registers a backend by name: why it cannot run on a device (a reason, or None),
how to make one, whether ``auto`` may pick it and before which others, and the options its
constructor takes (``get_backend(name, device, **options)``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


class Backend:
    """The protocol of a backend (see the module doc); subclasses define the operations."""

    name: str = ""
    quantize_both = None  # optional: (x, spec_cols, spec_rows, row_norms=False) -> (a, b, norms)
    quantize_and_pack = None  # optional: (x, spec_cols, spec_rows, col_norms=False) -> (a, b, norms)
    takes_row_bounds = False  # whether quantize, quantize_both and quantize_and_pack take row bounds

    @property
    def has_quantize_both(self) -> bool:
        """Whether the gradient's two quantizations of the backward come from one call."""
        return self.quantize_both is not None

    @property
    def has_quantize_and_pack(self) -> bool:
        """Whether the activation's two quantizations of the forward come from one call."""
        return self.quantize_and_pack is not None


@dataclass(frozen=True)
class BackendEntry:
    """A backend in the registry.

    ``unavailable(device)``: why it cannot run on ``device`` (a ``torch.device``), or None where it
    can. ``factory(**options)``: a new instance. ``auto_rank``: ``auto`` tries the backends with a
    rank, lowest first, and takes the first that can run (None: only by name). ``options``: the
    keyword arguments ``factory`` takes, each a setting of the instance."""

    name: str
    unavailable: Callable[[torch.device], str | None]
    factory: Callable[..., Backend]
    auto_rank: int | None = None
    options: tuple[str, ...] = ()


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def triton_missing(name: str) -> str | None:
    """Why backend ``name``, built on the Triton kernels, cannot run here: Triton is missing (else None)."""
    return None if triton_available() else f"backend {name!r} needs triton (pip install triton)"


def cuda_missing(device: torch.device) -> bool:
    """Whether ``device`` is no CUDA (or ROCm) GPU that torch can use."""
    return device.type != "cuda" or not torch.cuda.is_available()
