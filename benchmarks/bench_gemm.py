"""The MXFP4 GEMMs against cuBLAS BF16 on a CUDA GPU, TFLOP/s.

    python benchmarks/bench_gemm.py [--sections gemm,mx] [--shapes all] [--out FILE]

Sections:
  gemm: the hopper_fp8 GEMM (``torch._scaled_mm`` on e4m3 operands with row-wise scales: MXFP4
        exact, docs/method.md, 'MXFP4 on Hopper's FP8 tensor cores') against ``a @ b.t()`` in BF16,
        at 8192^3 and T = 16384 tokens times each --shapes layer; also with fast accumulation.
  mx:   the native_mx GEMM (``tl.dot_scaled`` on packed MXFP4, ``kernels.mx_gemm``) checked
        against the reference GEMM, and timed next to BF16 and hopper_fp8. On Hopper Triton
        emulates it through BF16, which is why the backend is refused there (docs/kernels.md,
        'The native MX GEMM'); on GPUs with MX tensor cores it is the native MMA.

The operands are quantized once; only the GEMM is timed (``triton.testing.do_bench`` medians).
Rows go to --out (JSONL, default runs/bench/bench_gemm.jsonl), each with the environment.
"""

from __future__ import annotations

import sys

import torch
from common import (
    SHAPES_HELP,
    Results,
    T,
    activation,
    add_out_arg,
    bench,
    parse_sections_and_shapes,
    rel,
    run_sections,
    script_parser,
    start,
)

from adahop.formats.mxfp4 import dequantize_mxfp4
from adahop.ops import OperandSpec, get_backend

SECTIONS = ("gemm", "mx")
SQUARE = 8192  # the square GEMM both sections start with
MX_SHAPES = [(SQUARE, SQUARE, SQUARE), (T, 14336, 4096)]  # (M, N, K)


def hopper_backend(**options):
    return get_backend("hopper_fp8", "cuda", **options)


def section_gemm(shapes) -> list[dict]:
    rows = []
    hop = hopper_backend()
    fast = hopper_backend(use_fast_accum=True)  # its own instance: the layers' keeps the accurate one
    for M, N, K in [(SQUARE, SQUARE, SQUARE)] + [(T, n, k) for n, k in shapes]:
        a, b = activation((M, K), seed=1), activation((N, K), seed=2)
        t_bf16 = bench(lambda: a @ b.t())  # noqa: B023
        spec = OperandSpec()
        qa, qb = hop.quantize(a, 1, spec), hop.quantize(b, 1, spec)
        t_fp8 = bench(lambda: hop.mm_nt(qa, qb, torch.bfloat16))  # noqa: B023
        t_fast = bench(lambda: fast.mm_nt(qa, qb, torch.bfloat16))  # noqa: B023
        flops = 2 * M * N * K
        rows.append(dict(shape=(M, N, K), bf16_TFLOPs=flops / t_bf16 / 1e9, mxfp4_TFLOPs=flops / t_fp8 / 1e9,
                         speedup=t_bf16 / t_fp8, fast_accum_TFLOPs=flops / t_fast / 1e9))
        print("  gemm", rows[-1], flush=True)
    return rows


def section_mx() -> list[dict]:
    from adahop.kernels.mx_gemm import mxfp4_gemm_nt

    rows = []
    hop = hopper_backend()
    for M, N, K in MX_SHAPES:
        a, b = activation((M, K), seed=1), activation((N, K), seed=2)
        spec = OperandSpec()
        pa, pb = hop.quantize_packed(a, 1, spec), hop.quantize_packed(b, 1, spec)
        c = mxfp4_gemm_nt(pa, pb, torch.float32)
        fa, fb = dequantize_mxfp4(pa, keep_padding=True), dequantize_mxfp4(pb, keep_padding=True)
        err = rel(c, fa @ fb.t())
        del fa, fb, c
        qa, qb = hop.as_e4m3(pa), hop.as_e4m3(pb)
        t_bf16 = bench(lambda: a @ b.t())  # noqa: B023
        t_mx = bench(lambda: mxfp4_gemm_nt(pa, pb, torch.bfloat16))  # noqa: B023
        t_fp8 = bench(lambda: hop.mm_nt(qa, qb, torch.bfloat16))  # noqa: B023
        flops = 2 * M * N * K
        rows.append(dict(shape=(M, N, K), rel_err_vs_reference=err, bf16_TFLOPs=flops / t_bf16 / 1e9,
                         dot_scaled_TFLOPs=flops / t_mx / 1e9, hopper_fp8_TFLOPs=flops / t_fp8 / 1e9,
                         dot_scaled_vs_bf16=t_bf16 / t_mx))
        print("  mx", rows[-1], flush=True)
    return rows


def parse_args(argv=None):
    p = script_parser(__doc__)
    p.add_argument("--sections", default=",".join(SECTIONS),
                   help=f"comma-separated sections to run, in order (default: {','.join(SECTIONS)})")
    p.add_argument("--shapes", default="all",
                   help=f"layers (N,K) that 'gemm' times at T = 16384 after 8192^3: {SHAPES_HELP}")
    add_out_arg(p, "bench_gemm")
    args = p.parse_args(argv)
    parse_sections_and_shapes(p, args, SECTIONS)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    env = start("bench_gemm.py", argv)

    def run(name):
        return section_gemm(args.shapes) if name == "gemm" else section_mx()

    return run_sections(args.sections, run, Results(args.out, "bench_gemm", env))


if __name__ == "__main__":
    sys.exit(main())
