"""Every launch variant of the Triton kernels compiles for Hopper (sm_90) and Ada (sm_89), on a
machine without a GPU (``adahop.kernels.offline``). The interpreter runs the kernels' Python but
compiles nothing, so a kernel can pass every CPU test and still fail to compile on the GPU; this
catches that in CI. It runs in a subprocess: the kernels must be imported without
``TRITON_INTERPRET=1``."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")


def test_every_launch_variant_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-m", "adahop.kernels.offline"], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    compiled = [line.split()[2:4] for line in out.stdout.splitlines() if " s  _" in line]
    kernels = {"_mxfp4_quantize_kernel", "_quantize_both_kernel", "_partial_max_kernel", "_row_exponent_kernel",
               "_mxfp4_unpack_kernel", "_topk_kernel"}
    for arch in ("sm_90", "sm_89"):  # Hopper, and Ada (hopper_fp8 runs there too)
        assert {name for name, a in compiled if a == arch} == kernels, arch
        assert f"kernels for {arch}" in out.stdout


def test_refuses_to_run_interpreted():
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-m", "adahop.kernels.offline"], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "TRITON_INTERPRET" in out.stderr
