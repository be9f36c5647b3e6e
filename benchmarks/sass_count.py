"""Offline SASS instruction counts of the fused quantize kernels for sm_90 (Hopper), no GPU needed.

Runs the library's own entry points (``quantize_operand_triton`` per 16 x 256 chunk,
``quantize_both`` per 64 x 64 tile) on CPU tensors inside ``offline_compile.compile_launches``,
so what is compiled is exactly what those calls launch on an H100/H200 (signature,
specializations and constexprs by Triton's own binder), disassembles each kernel with the
``cuobjdump`` that ships with Triton, and prints the instruction count per launch and the classes
that decide its speed: conversions (F2I, I2F, FRND, F2FP: a quarter of the FP32 rate on sm_90),
integer multiplies, warp shuffles and shared-memory traffic. A cheap check of a kernel change
before spending GPU time on it (docs/kernels.md, 'Layout rules for Triton').

    python benchmarks/sass_count.py                      # the default variants
    python benchmarks/sass_count.py --block-r 16 --block-k 256 --warps 4

It must run without ``TRITON_INTERPRET=1`` (as ``offline_compile.py``). The counts are those of
the launches the library makes: a hand-written kernel signature can differ from them (a runtime
``n_splits`` where a layer-sized operand gets the constant 1 added about 100 instructions to the
e4m3 emit).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter

import torch
import triton
from offline_compile import compile_launches

from adahop.kernels.quantize import quantize_operand_triton
from adahop.kernels.quantize_both import quantize_both
from adahop.ops import OperandSpec

CLASSES = {
    "conversions": ("F2I", "I2F", "FRND", "F2F", "F2FP", "I2FP"),
    "int multiplies": ("IMAD", "IMUL"),
    "shuffles": ("SHFL",),
    "shared memory": ("STS", "LDS"),
}


def sass(compiled) -> list[str]:
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        out = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    return [line.split("*/")[1].strip() for line in out.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", line)]


def launches(call) -> dict[int, list[str]]:
    """SASS of each quantize kernel ``call()`` launches, by its PHASE (the launches without one,
    such as ``quantize_both``'s row-exponent reduction between its two passes, are not counted)."""
    with compile_launches() as done:
        call()
    return {meta["PHASE"]: sass(compiled) for _, meta, _, compiled in done if "PHASE" in meta}


def opcode(ins: str) -> str:
    return (ins.split()[1] if ins.startswith("@") else ins.split()[0]).split(".")[0]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("--block-r", type=int, default=16, help="rows per program of quantize_operand_triton (default: 16)")
    p.add_argument("--block-k", type=int, default=256,
                   help="columns per chunk of quantize_operand_triton (default: 256)")
    p.add_argument("--warps", type=int, default=4, help="warps of quantize_operand_triton (default: 4)")
    p.add_argument("--log2-h", type=int, default=5, help="Hadamard size 2**N (0: none) (default: 5)")
    p.add_argument("--both-tile", type=int, default=64, help="quantize_both's square tile (default: 64)")
    p.add_argument("--both-warps", type=int, default=4, help="warps of quantize_both (default: 4)")
    a = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("sass_count.py: unset TRITON_INTERPRET: the SASS is that of the compiled kernels", file=sys.stderr)
        return 2
    h = 1 << a.log2_h if a.log2_h else None
    print(f"chunk {a.block_r} x {a.block_k}, {a.warps} warps, Hadamard {h or 'none'}")
    print(f"{'variant':<22}{'instructions':>13}" + "".join(f"{c:>16}" for c in CLASSES))
    # Rows of 4096 over several chunks, as the layer's (single_chunk_max=0: the two-pass e4m3 form).
    x = torch.randn(4 * a.block_r, 4096).to(torch.bfloat16)
    rne, sr = OperandSpec(hadamard_size=h), OperandSpec(hadamard_size=h, rounding="sr", sr_seed=1)
    one = dict(block_r=a.block_r, block_k=a.block_k, num_warps=a.warps, single_chunk_max=0)
    e4m3 = dict(one, e4m3=True, packed=False)
    two_pass = launches(lambda: quantize_operand_triton(x, 1, rne, **e4m3))
    report("e4m3 phase 1", two_pass[1])
    report("e4m3 phase 2, RNE", two_pass[2])
    report("e4m3 phase 2, SR", launches(lambda: quantize_operand_triton(x, 1, sr, **e4m3))[2])
    report("packed, RNE", launches(lambda: quantize_operand_triton(x, 1, rne, **one))[0])
    report("packed, SR", launches(lambda: quantize_operand_triton(x, 1, sr, **one))[0])
    # The layer's two-way launches: x (e4m3 along C, packed along R, RNE; with x's column norms
    # for wgrad's OE-right) and g (e4m3 both ways, SR; with g's row norms for dgrad's OE-left).
    print(f"quantize_both, tile {a.both_tile} x {a.both_tile}, {a.both_warps} warps, Hadamard 32 both ways")
    t = 4 * a.both_tile
    xb = torch.randn(t, t).to(torch.bfloat16)
    tile = dict(block_r=a.both_tile, block_c=a.both_tile, num_warps=a.both_warps)
    iht, iht_sr = OperandSpec(hadamard_size=32), OperandSpec(hadamard_size=32, rounding="sr", sr_seed=1)
    x_both = launches(lambda: quantize_both(xb, iht, iht, rows_form="packed", **tile))
    report("x: phase 1 (+packed)", x_both[1])
    x_norms = launches(lambda: quantize_both(xb, iht, iht, rows_form="packed", col_norms=True, **tile))
    report("x: phase 1, col norms", x_norms[1])
    report("x: phase 2", x_both[2])
    g_both = launches(lambda: quantize_both(xb, iht_sr, iht_sr, **tile))
    report("g: phase 1", g_both[1])
    report("g: phase 1, row norms", launches(lambda: quantize_both(xb, iht_sr, iht_sr, row_norms=True, **tile))[1])
    report("g: phase 2", g_both[2])
    return 0


def report(name: str, sass_lines: list[str]) -> None:
    ops = Counter(opcode(i) for i in sass_lines)
    counts = [sum(ops[o] for o in group) for group in CLASSES.values()]
    print(f"{name:<22}{sum(ops.values()):>13}" + "".join(f"{c:>16}" for c in counts))


if __name__ == "__main__":
    sys.exit(main())
