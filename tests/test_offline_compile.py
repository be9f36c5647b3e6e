"""Every launch variant of the Triton kernels compiles for Hopper (sm_90) and Ada (sm_89), on a
machine without a GPU (benchmarks/offline_compile.py, a developer tool outside the package). The
interpreter runs the kernels' Python but compiles nothing, so a kernel can pass every CPU test
and still fail to compile on the GPU; this catches that in CI. The SASS counts of
benchmarks/sass_count.py come from the same compilations. Both run in a subprocess: the kernels
must be imported without ``TRITON_INTERPRET=1``."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def run(script, *args, interpret=False, timeout=600):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run([sys.executable, str(BENCH / script), *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_every_launch_variant_compiles_for_sm90():
    out = run("offline_compile.py")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    compiled = [line.split()[2:4] for line in out.stdout.splitlines() if " s  _" in line]
    kernels = {"_mxfp4_quantize_kernel", "_quantize_both_kernel", "_partial_max_kernel", "_row_exponent_kernel",
               "_mxfp4_unpack_kernel", "_topk_kernel"}
    for arch in ("sm_90", "sm_89"):  # Hopper, and Ada (hopper_fp8 runs there too)
        assert {name for name, a in compiled if a == arch} == kernels, arch
        assert f"kernels for {arch}" in out.stdout


def test_sass_counts_of_every_quantize_launch():
    out = run("sass_count.py")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    counts = {}  # variant -> instructions, conversions, int multiplies, shuffles, shared memory
    for line in out.stdout.splitlines():
        fields = line[22:].split()
        if len(fields) == 5 and all(f.isdigit() for f in fields):
            counts[line[:22].strip()] = [int(f) for f in fields]
    expected = ["e4m3 phase 1", "e4m3 phase 2, RNE", "e4m3 phase 2, SR", "packed, RNE", "packed, SR",
                "x: phase 1 (+packed)", "x: phase 1, col norms", "x: phase 2", "g: phase 1", "g: phase 1, row norms",
                "g: phase 2"]
    assert list(counts) == expected, out.stdout
    for name, (total, *classes) in counts.items():
        assert total > 100 and all(0 <= c < total for c in classes), (name, total, classes)
    # SR draws random bits: more integer multiplies than round-to-nearest, in the same kernel
    assert counts["e4m3 phase 2, SR"][2] > counts["e4m3 phase 2, RNE"][2]


def test_refuses_to_run_interpreted():
    for script in ("offline_compile.py", "sass_count.py"):
        out = run(script, interpret=True, timeout=120)
        assert out.returncode == 2 and "TRITON_INTERPRET" in out.stderr, (script, out.stderr[-2000:])


# The PTX division instructions of the quantize kernel's launch under each scale mode, one line
# "mode: instr instr ..." per mode (compiled for sm_90 in a subprocess, as above).
DIVISIONS_SCRIPT = """
import sys
sys.path.insert(0, sys.argv[1])
import torch
from offline_compile import compile_launches
from adahop.kernels.quantize import quantize_operand_triton
from adahop.ops import OperandSpec
x = torch.randn(64, 768).to(torch.bfloat16)
for mode in ("floor", "rceil"):
    with compile_launches(90) as done:
        quantize_operand_triton(x, 1, OperandSpec(scale_mode=mode))
    ptx = "".join(kernel.asm["ptx"] for *_, kernel in done)
    print(mode + ":", *sorted({line.split()[0] for line in ptx.splitlines() if line.strip().startswith("div.")}))
"""


def test_rceil_divides_with_ieee_rounding_in_the_compiled_kernel():
    # rceil's amax / 6 must be the correctly rounded division (div.rn.f32), as the reference's
    # torch division: Triton's fp32 "/" compiles to div.full.f32 (approximate, up to 2 ulp off),
    # which moves the scale of blocks whose amax / 6 lies next to a power of two. The interpreter
    # divides exactly either way, so only the compiled PTX can tell them apart.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", DIVISIONS_SCRIPT, str(BENCH)], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    divisions = dict(line.split(":") for line in out.stdout.splitlines() if ":" in line)
    assert divisions["rceil"].split() == ["div.rn.f32"], out.stdout
    assert divisions["floor"].split() == [], out.stdout  # the division is rceil's alone
