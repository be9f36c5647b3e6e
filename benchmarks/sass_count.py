"""Offline SASS instruction counts of the fused quantize kernel for sm_90 (Hopper), no GPU needed.

Compiles ``kernels.quantize._mxfp4_quantize_kernel`` (per 16 x 256 chunk) and
``kernels.quantize_both._quantize_both_kernel`` (per 64 x 64 tile) for a CUDA target with ``triton.compile``
and disassembles it with the ``cuobjdump`` that ships with Triton, then prints the instruction
count per variant and the classes that decide its speed: conversions (F2I, I2F, FRND, F2FP: a
quarter of the FP32 rate on sm_90), integer multiplies, warp shuffles and shared-memory traffic.
A cheap check of a kernel change before spending GPU time on it (design.md: "the layout lesson").

    python benchmarks/sass_count.py                      # the default variants
    python benchmarks/sass_count.py --block-r 16 --block-k 256 --warps 4
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from collections import Counter

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from adahop.kernels.quantize import _mxfp4_quantize_kernel
from adahop.kernels.quantize_both import _quantize_both_kernel

POINTERS = ["x_ptr", "codes_ptr", "scales_ptr", "e4m3_ptr", "e4m3_bits_ptr", "rowscale_ptr", "sumsq_ptr", "epart_ptr"]
POINTER_TYPES = ["*bf16", "*u8", "*u8", "*fp8e4nv", "*u8", "*fp32", "*fp32", "*u8"]
INTS = ["stride_r", "stride_k", "R", "K", "KP", "SPLIT_K", "n_splits", "sr_key", "sign_key"]
CLASSES = {
    "conversions": ("F2I", "I2F", "FRND", "F2F", "F2FP", "I2FP"),
    "int multiplies": ("IMAD", "IMUL"),
    "shuffles": ("SHFL",),
    "shared memory": ("STS", "LDS"),
}

# (name, PHASE, SR, WRITE_PACKED, WRITE_E4M3): the launches the linear layer makes.
VARIANTS = [
    ("e4m3 phase 1", 1, False, False, True),
    ("e4m3 phase 2, RNE", 2, False, False, True),
    ("e4m3 phase 2, SR", 2, True, False, True),
    ("packed, RNE", 0, False, True, False),
    ("packed, SR", 0, True, True, False),
]


# quantize_both: its pointers (bf16 input, e4m3 / u8 / fp32 outputs) and ints.
BOTH_POINTERS = {
    "x_ptr": "*bf16", "e4a_ptr": "*fp8e4nv", "e4a_bits_ptr": "*u8", "rsa_ptr": "*fp32", "parta_ptr": "*u8",
    "emaxa_ptr": "*u8", "ssa_ptr": "*fp32", "e4b_ptr": "*fp8e4nv", "e4b_bits_ptr": "*u8", "rsb_ptr": "*fp32",
    "partb_ptr": "*u8", "emaxb_ptr": "*u8", "ssb_ptr": "*fp32", "codes_b_ptr": "*u8", "scales_b_ptr": "*u8",
}
BOTH_INTS = ["stride_r", "R", "C", "RP", "CP", "sr_key_a", "sr_key_b", "sign_key_a", "sign_key_b"]
# (name, PHASE, B_PACKED, SR, SUMSQ_A, SUMSQ_B): the launches of the layer's forward (x: e4m3
# along C, packed along R, RNE; with x's column norms for wgrad's OE-right) and backward (g: e4m3
# both ways, SR: the default rounding of gradients; with g's row norms for dgrad's OE-left).
BOTH_VARIANTS = [
    ("x: phase 1 (+packed)", 1, True, False, False, False),
    ("x: phase 1, col norms", 1, True, False, False, True),
    ("x: phase 2", 2, True, False, False, False),
    ("g: phase 1", 1, False, True, False, False),
    ("g: phase 1, row norms", 1, False, True, True, False),
    ("g: phase 2", 2, False, True, False, False),
]


def sass_of(meta: dict, num_warps: int, kernel=_mxfp4_quantize_kernel) -> list[str]:
    if kernel is _mxfp4_quantize_kernel:
        types = dict(zip(POINTERS, POINTER_TYPES))
        types.update({name: "i32" for name in INTS})
        types.update(norm="fp32", stride_k="constexpr")
        consts = dict(meta, stride_k=1)
        # Pointers and sizes divisible by 16, as at the real shapes (Triton specializes on it).
        aligned = POINTERS + ["stride_r", "R", "K", "KP", "SPLIT_K"]
    else:
        types = dict(BOTH_POINTERS)
        types.update({name: "i32" for name in BOTH_INTS})
        types.update(norm_a="fp32", norm_b="fp32", stride_c="constexpr")
        consts = dict(meta, stride_c=1)
        aligned = list(BOTH_POINTERS) + ["stride_r", "R", "C", "RP", "CP"]
    types.update({name: "constexpr" for name in meta})
    # In the kernel's argument order: attributes are given by argument position.
    names = list(kernel.arg_names)
    sig = {name: types[name] for name in names}
    attrs = {(names.index(p),): [["tt.divisibility", 16]] for p in aligned}
    src = ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    return [line.split("*/")[1].strip() for line in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", line)]


def opcode(ins: str) -> str:
    return (ins.split()[1] if ins.startswith("@") else ins.split()[0]).split(".")[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--block-r", type=int, default=16)
    p.add_argument("--block-k", type=int, default=256)
    p.add_argument("--warps", type=int, default=4)
    p.add_argument("--log2-h", type=int, default=5, help="Hadamard size 2**N (0: none)")
    p.add_argument("--both-tile", type=int, default=64, help="quantize_both's square tile")
    p.add_argument("--both-warps", type=int, default=4)
    a = p.parse_args()
    print(f"chunk {a.block_r} x {a.block_k}, {a.warps} warps, Hadamard {1 << a.log2_h if a.log2_h else 'none'}")
    print(f"{'variant':<22}{'instructions':>13}" + "".join(f"{c:>16}" for c in CLASSES))
    for name, phase, sr, packed, e4m3 in VARIANTS:
        meta = dict(
            BLOCK_R=a.block_r, BLOCK_K=a.block_k, LOG2_H=a.log2_h, HAS_SIGNS=False, SCALE_MODE=1,
            SR=sr, SINGLE_CHUNK=False, WRITE_PACKED=packed, WRITE_E4M3=e4m3, WRITE_SUMSQ=False,
            NAN_BY_CAST=True, FWHT_INPLACE=True, ARITH_E2M1=True, PHASE=phase,
        )
        report(name, sass_of(meta, a.warps))
    print(f"quantize_both, tile {a.both_tile} x {a.both_tile}, {a.both_warps} warps, Hadamard 32 both ways")
    for name, phase, packed, sr, ssa, ssb in BOTH_VARIANTS:
        meta = dict(
            BLOCK_R=a.both_tile, BLOCK_C=a.both_tile, LOG2_HA=5, LOG2_HB=5, HAS_SIGNS_A=False, HAS_SIGNS_B=False,
            SCALE_MODE_A=1, SCALE_MODE_B=1, SR_A=sr, SR_B=sr, NAN_BY_CAST=True, PHASE=phase, B_PACKED=packed,
            SUMSQ_A=ssa, SUMSQ_B=ssb,
        )
        report(name, sass_of(meta, a.both_warps, _quantize_both_kernel))


def report(name: str, sass: list[str]) -> None:
    ops = Counter(opcode(i) for i in sass)
    counts = [sum(ops[o] for o in group) for group in CLASSES.values()]
    print(f"{name:<22}{sum(ops.values()):>13}" + "".join(f"{c:>16}" for c in counts))


if __name__ == "__main__":
    main()
