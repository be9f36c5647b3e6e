"""Compile the library's Triton kernels for a CUDA GPU on a machine without one (a developer
tool on Triton's compiler internals, not part of the installed package).

The CPU tests run the kernels under Triton's interpreter (``TRITON_INTERPRET=1``), which executes
the Python of a kernel but compiles nothing: code the interpreter accepts can still fail to
compile for a GPU (``tl.multiple_of`` on a literal did). This module is the check for that,
without a GPU (docs/kernels.md, 'Offline compile check'):

Inside ``with compile_launches():``, host code (the library's kernel entry points on CPU tensors,
``library_launches``) runs with every ``FastLauncher`` launch replaced by a compilation for the
target (sm_90, Hopper, by default, through PTX to a cubin with the ptxas that ships with Triton).
The signature, constexprs and specializations come from the launch's own arguments through
Triton's own binder, so it compiles what the same call would compile on that GPU. Outputs are
left unwritten (the host code around the launches runs on uninitialised memory; only what is
compiled matters). ``tl.dot_scaled``'s GEMM (``kernels.mx_gemm``) launches without
``FastLauncher`` and is not covered: Hopper never runs it (``ops.backends``).

    python benchmarks/offline_compile.py               # every launch of library_launches, sm_90 and sm_89
    python benchmarks/offline_compile.py --archs 90

It must run without ``TRITON_INTERPRET=1`` (``triton.jit`` reads it at import): the tests run it
in a subprocess (tests/test_offline_compile.py). ``benchmarks/sass_count.py`` builds on
``compile_launches``. It uses Triton's private compiler API (``triton.compiler``,
``JITFunction._pack_args``), checked with Triton 3.6.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from contextlib import contextmanager

import torch


def compile_for_target(fn, args, kwargs, target):
    """What ``fn[grid](*args, **kwargs)`` compiles on ``target``, as Triton's ``JITFunction.run``
    builds it (signature, constexprs, divisibility and alignment attributes, options)."""
    from triton import knobs
    from triton.compiler import ASTSource, compile, make_backend
    from triton.runtime.jit import create_function_from_signature

    kwargs = dict(kwargs)
    kwargs["debug"] = kwargs.get("debug", fn.debug) or knobs.runtime.debug
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound_args, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound_args, specialization, options)
    key = repr((fn.__name__, signature, sorted(constexprs.items(), key=str), sorted(attrs.items(), key=str),
                sorted(options.__dict__.items(), key=str)))
    return key, lambda: compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)


@contextmanager
def compile_launches(arch: int = 90):
    """Within the block, ``FastLauncher`` launches compile for CUDA ``sm_<arch>`` instead of
    running; yields the list of ``(kernel name, constexprs, seconds, compiled kernel)`` (each
    distinct compilation once; ``benchmarks/sass_count.py`` reads the kernels' SASS)."""
    from triton.backends.compiler import GPUTarget

    from adahop.kernels.launch import INTERPRETED, FastLauncher

    if INTERPRETED:
        raise RuntimeError("offline compilation needs TRITON_INTERPRET unset (the kernels are interpreted)")
    target = GPUTarget("cuda", arch, 32)
    done: list = []
    seen: set = set()

    def launch(self, grid, args, kw):
        key, build = compile_for_target(self.fn, args, kw, target)
        if key not in seen:
            seen.add(key)
            t0 = time.perf_counter()
            compiled = build()
            constexprs = {k: v for k, v in kw.items() if k[0].isupper()}
            done.append((self.fn.__name__, constexprs, time.perf_counter() - t0, compiled))

    real = FastLauncher.launch
    FastLauncher.launch = launch
    try:
        yield done
    finally:
        FastLauncher.launch = real


def library_launches() -> None:
    """The kernel entry points on small CPU operands that take every launch variant the layer
    uses: one chunk per row and two passes, split K ranges, packed / e4m3 / both, RNE / SR,
    signs, every scale mode, float32 rounded to bf16 in the loads, both orientations from one
    kernel (with and without the norms of outlier extraction) and the reduction between its
    passes, unpack, top-k (held in registers with 4, 8 and 16 warps, and re-read)."""
    from adahop.kernels.quantize import quantize_operand_triton
    from adahop.kernels.quantize_both import quantize_both
    from adahop.kernels.topk import topk_indices
    from adahop.kernels.unpack import unpack_to_e4m3
    from adahop.ops import OperandSpec

    x = torch.randn(64, 4096).to(torch.bfloat16)
    small = x[:, :768]
    iht = OperandSpec(hadamard_size=32)
    iht_sr, iht_sr2 = (OperandSpec(hadamard_size=32, rounding="sr", sr_seed=seed) for seed in (1, 2))
    for rows in (small, x):  # one chunk per row (K <= 2048), two passes
        quantize_operand_triton(rows, 1, iht)
        quantize_operand_triton(rows, 1, iht, e4m3=True, packed=False)
        quantize_operand_triton(rows, 1, iht_sr, e4m3=True, packed=False)
    quantize_operand_triton(x, 0, iht_sr)  # along dim 0 (strided view)
    quantize_operand_triton(x, 1, iht, e4m3=True, packed=False, k_splits=2)
    quantize_operand_triton(x, 1, OperandSpec(), e4m3=True, packed=False)  # no Hadamard
    w = x.float()  # a float32 weight rounded to bf16 in the loads (both passes, both orientations)
    quantize_operand_triton(w, 1, iht, e4m3=True, packed=False, round_to_bf16=True)
    quantize_operand_triton(w, 0, iht, e4m3=True, packed=False, round_to_bf16=True)
    for mode in ("floor", "ceil", "rceil"):
        quantize_operand_triton(small, 1, OperandSpec(hadamard_size=32, scale_mode=mode, signs_seed=3))
    quantize_both(x, iht_sr, iht_sr2)
    quantize_both(x, iht_sr, iht_sr2, row_norms=True)
    quantize_both(x, iht, iht, rows_form="packed")
    quantize_both(x, iht, iht, rows_form="packed", col_norms=True)
    unpack_to_e4m3(quantize_operand_triton(x, 0, iht)["mx"])
    topk_indices(torch.rand(4096), 64)
    topk_indices(torch.rand(14336), 64)
    topk_indices(torch.rand(20000), 64)  # 32,768 in registers, 16 warps
    topk_indices(torch.rand(40000), 64)


def main(argv=None) -> int:
    """Compile every launch of ``library_launches`` for each CUDA arch: by default Hopper
    (sm_90) and Ada (sm_89, the other GPUs ``hopper_fp8`` runs on)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--archs", nargs="+", type=int, default=[90, 89],
                   help="CUDA compute capabilities to compile for, as major*10+minor (default: 90 89)")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("offline_compile.py: unset TRITON_INTERPRET: offline compilation needs the compiled kernels",
              file=sys.stderr)
        return 2
    total = 0
    for arch in args.archs:
        t0 = time.perf_counter()
        with compile_launches(arch) as done:
            library_launches()
        for name, meta, seconds, _ in done:
            print(f"{seconds:6.1f} s  {name}  sm_{arch}  {meta}")
        print(f"compiled {len(done)} kernels for sm_{arch} in {time.perf_counter() - t0:.0f} s")
        total += len(done)
    return 0 if total else 1


if __name__ == "__main__":
    sys.exit(main())
