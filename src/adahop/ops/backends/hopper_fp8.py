"""Backend ``hopper_fp8``: exact MXFP4 GEMMs on FP8 tensor cores (docs/method.md, 'MXFP4 on
Hopper's FP8 tensor cores'), on CUDA GPUs of compute capability 8.9 or more; ``auto`` takes it
there unless ``native_mx`` runs.

The quantize kernel emits each operand as float8 e4m3 elements plus one float32 scale per row,
with every MXFP4 value ``e2m1 * 2**e_block`` written as
``(e2m1 * 2**(e_block - e_row + 6)) * 2**(e_row - 6)`` (``formats.e4m3_rows``), ``e_row`` the
row's largest block exponent or, where the layer gives a bound on the row's magnitudes
(``layer.bounds``), the exponent of that bound (one pass instead of two); the e4m3 element is
exact while the block is within 14 binades of ``e_row`` (beyond, it is rounded: an error below
2**-15 of ``2**(e_row + 2)``). ``torch._scaled_mm`` with row-wise scales then computes
``sum_k a_e4m3 b_e4m3`` (products exact in fp32, fp32 accumulation with
``use_fast_accum=False``) times ``scale_a[m] * scale_b[n]`` (powers of two: exact), so the result
is the MXFP4 GEMM up to fp32 accumulation order. Row-wise ``_scaled_mm`` writes bf16, and float32
where cuBLAS runs it (sm_90; the layer's weight gradient); where torch refuses float32 with
row-wise scales, and for other output dtypes, it runs with unit scales into float32 and we apply
the two scales ourselves.

It also quantizes a tensor both ways from one kernel (``kernels.quantize_both``): the backward's
gradient (``quantize_both``) and the forward's activation (``quantize_and_pack``). Outlier
extraction as ``ops.backends.triton`` says.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from adahop.ops.backends.protocol import Backend, BackendEntry, cuda_missing, triton_missing
from adahop.ops.backends.triton import TritonBackend, cast_args, select_outer
from adahop.ops.operand import OperandSpec
from adahop.ops.outliers import outer_norms


@dataclass(frozen=True)
class E4M3Operand:
    """A GEMM operand in the Hopper form: [R, KP] e4m3 elements and [R] float32 row scales."""

    e4m3: torch.Tensor
    row_scale: torch.Tensor


def _pad_rows(t: torch.Tensor, multiple: int, value: float = 0.0) -> torch.Tensor:
    pad = -t.shape[0] % multiple
    if pad == 0:
        return t
    filler = torch.full((pad, *t.shape[1:]), value, dtype=torch.float32, device=t.device).to(t.dtype)
    return torch.cat((t, filler))


class HopperFP8Backend(Backend):
    """Exact MXFP4 GEMMs through e4m3 + row scales and ``torch._scaled_mm`` (see module doc)."""

    name = "hopper_fp8"
    select_outer = staticmethod(select_outer)
    rowwise_fp32_out = True  # row-wise scaled GEMMs may write float32 (set False where refused)
    # Row bounds (formats.e4m3_rows) let the kernels write the e4m3 form in one pass instead of
    # two; a benchmark sets this False on the class to time the layer without them.
    takes_row_bounds = True

    def __init__(self, use_fast_accum: bool = False):
        # use_fast_accum: _scaled_mm's fast accumulation, which the exactness argument (module doc)
        # does not cover; for timing it only (benchmarks/bench_gemm.py). A setting of this instance,
        # fixed when it is made: get_backend gives each set of options its own instance, so the
        # one the layers use is never switched by another caller.
        if not isinstance(use_fast_accum, bool):
            raise ValueError(f"use_fast_accum must be True or False, got {use_fast_accum!r}")
        self._use_fast_accum = use_fast_accum

    @property
    def use_fast_accum(self) -> bool:
        return self._use_fast_accum

    def quantize(self, x, dim, spec: OperandSpec, zero_outer=None, cast_to=None, row_bound=None) -> E4M3Operand:
        from adahop.kernels.quantize import quantize_operand_triton

        x, cast = cast_args(x, cast_to)
        out = quantize_operand_triton(x, dim, spec, packed=False, e4m3=True, row_bound=row_bound, **cast)
        return E4M3Operand(out["e4m3"], out["row_scale"])

    quantize_packed = TritonBackend.quantize_packed

    @staticmethod
    def _two_ways(x, spec_cols: OperandSpec, spec_rows: OperandSpec, rows_form: str, **kwargs):
        from adahop.kernels.quantize_both import quantize_both

        return quantize_both(x, spec_cols, spec_rows, rows_form=rows_form, **kwargs)

    def quantize_both(self, x, spec_cols: OperandSpec, spec_rows: OperandSpec, row_norms: bool = False,
                      bounds=None):
        """``quantize(x, 1, spec_cols)`` and ``quantize(x, 0, spec_rows)`` from the same reads of
        ``x`` (``kernels.quantize_both``): the backward's two quantizations of the gradient.
        Returns ``(a, b, norms)``: with ``row_norms``, ``norms`` are the L2 norms of x's rows (what
        dgrad's OE-left ranks), from the same reads; else None. ``bounds``: ``(row_bound,
        col_bound)`` on the magnitudes of x's rows and columns (one pass), or None."""
        a, b = self._two_ways(x, spec_cols, spec_rows, "e4m3", row_norms=row_norms, bounds=bounds)
        return E4M3Operand(a["e4m3"], a["row_scale"]), E4M3Operand(b["e4m3"], b["row_scale"]), a.get("norms")

    # x [T, K] both ways from one kernel only from this K up (docs/kernels.md, 'Both orientations in
    # one kernel (quantize_both)'). Measured on the H200 at T = 16384 (``benchmarks/bench_kernels.py
    # --sections bothx``), fused against two calls: K = 768: 0.156 / 0.130 ms, 2048: 0.160 / 0.151,
    # 4096: 0.259 / 0.273, 8192: 0.505 / 0.526, 14336: 0.871 / 0.912. Up to K = 2048 a row fits one
    # chunk of the e4m3 kernel (one read, one launch), so the two calls read x twice in two
    # launches, as the fused kernel does, and without its row-maximum reduction between them.
    # Between 2048 and 4096 nothing was measured; those sizes take the two calls too. With a row
    # bound the fused kernel is one read and wins at every K (H100, T = 32768: K = 2048 0.135 against
    # 0.164 ms for two calls with the bound, 8192 0.516 against 0.637;
    # benchmarks/results/row_bounds_h100_2026-12-07): the threshold is for the exact row maxima.
    FUSED_X_MIN_K = 4096

    def quantize_and_pack(self, x, spec_cols: OperandSpec, spec_rows: OperandSpec, col_norms: bool = False,
                          row_bound=None):
        """``quantize(x, 1, spec_cols)`` and ``quantize_packed(x, 0, spec_rows)``: the forward's
        activation, for fprop and packed for the backward. From the same reads of ``x`` (one
        kernel) when ``x`` has ``FUSED_X_MIN_K`` columns or more, else two calls (faster there);
        the same bits either way. Returns ``(a, b, norms)``: with ``col_norms``, ``norms`` are the
        L2 norms of x's columns (what wgrad's OE-right ranks; from the fused kernel's reads, or
        ``ops.outliers.outer_norms``), else None. ``row_bound``: a bound on the magnitudes of x's
        rows, for the e4m3 form (then one read of x in one kernel at every K), or None."""
        if row_bound is None and x.dim() == 2 and x.shape[1] < self.FUSED_X_MIN_K:
            norms = outer_norms(x, 1) if col_norms else None
            return self.quantize(x, 1, spec_cols), self.quantize_packed(x, 0, spec_rows), norms
        bounds = None if row_bound is None else (row_bound, None)
        a, b = self._two_ways(x, spec_cols, spec_rows, "packed", col_norms=col_norms, bounds=bounds)
        return E4M3Operand(a["e4m3"], a["row_scale"]), b["mx"], b.get("norms")

    @staticmethod
    def as_e4m3(op) -> E4M3Operand:
        if isinstance(op, E4M3Operand):
            return op
        from adahop.kernels.unpack import unpack_to_e4m3

        return E4M3Operand(*unpack_to_e4m3(op))

    def mm_nt(self, a, b, out_dtype: torch.dtype) -> torch.Tensor:
        a, b = self.as_e4m3(a), self.as_e4m3(b)
        if a.e4m3.shape[1] != b.e4m3.shape[1]:
            raise ValueError(f"operands disagree along K: {a.e4m3.shape[1]} vs {b.e4m3.shape[1]}")
        M, N = a.e4m3.shape[0], b.e4m3.shape[0]
        a_e4, b_e4, a_s, b_s = a.e4m3, b.e4m3, a.row_scale, b.row_scale
        padded = M % 16 or N % 16
        if padded:  # _scaled_mm needs outer dims that are multiples of 16 (K is a multiple of 32)
            a_e4, b_e4 = _pad_rows(a_e4, 16), _pad_rows(b_e4, 16)
            a_s, b_s = _pad_rows(a_s, 16, 1.0), _pad_rows(b_s, 16, 1.0)
        a_s, b_s = a_s.unsqueeze(1), b_s.unsqueeze(0)
        c = None
        if out_dtype == torch.bfloat16 or (out_dtype == torch.float32 and self.rowwise_fp32_out):
            try:
                c = torch._scaled_mm(a_e4, b_e4.t(), scale_a=a_s, scale_b=b_s, out_dtype=out_dtype,
                                     use_fast_accum=self.use_fast_accum)
            except RuntimeError as e:  # only torch's refusal of the output dtype; anything else is raised
                if out_dtype == torch.bfloat16 or isinstance(e, torch.OutOfMemoryError) or "supported" not in str(e):
                    raise
                # Row-wise scales with a float32 output are cuBLAS's (sm_90, CUDA >= 12.9);
                # torch's CUTLASS path (sm_89, older CUDA) refuses them: the same GEMM below,
                # with the scales applied after it (exact: powers of two).
                type(self).rowwise_fp32_out = False
        if c is None:
            one = torch.ones((), dtype=torch.float32, device=a_e4.device)
            c = torch._scaled_mm(a_e4, b_e4.t(), scale_a=one, scale_b=one, out_dtype=torch.float32,
                                 use_fast_accum=self.use_fast_accum)
            c = (c * a_s * b_s).to(out_dtype)
        return c[:M, :N] if padded else c


def unavailable(device: torch.device) -> str | None:
    reason = triton_missing("hopper_fp8")
    if reason is not None:
        return reason
    if cuda_missing(device):
        return f"backend 'hopper_fp8' needs a CUDA GPU, got device {device}"
    if torch.cuda.get_device_capability(device) < (8, 9):
        return "backend 'hopper_fp8' needs FP8 tensor cores (compute capability >= 8.9)"
    return None


ENTRY = BackendEntry("hopper_fp8", unavailable=unavailable, factory=HopperFP8Backend, auto_rank=20,
                     options=("use_fast_accum",))
