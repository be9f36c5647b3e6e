"""kernels.launch.FastLauncher: the compiled kernel it keeps for a call signature is the one
Triton picks, so results equal Triton's own launch path. The fast path exists only on a GPU
(the interpreter has no compiled kernels: there it delegates, checked on the CPU too)."""

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from adahop.kernels.launch import FastLauncher  # noqa: E402
from adahop.kernels.quantize import quantize_operand_triton  # noqa: E402
from adahop.ops import OperandSpec, quantize_operand  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _axpy_kernel(x_ptr, y_ptr, out_ptr, n, alpha, BLOCK: tl.constexpr, SQUARE: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m)
    if SQUARE:
        x = x * x
    tl.store(out_ptr + offs, alpha * x + tl.load(y_ptr + offs, mask=m), mask=m)


def test_same_results_as_triton_over_changing_signatures():
    """Sizes of either divisibility (1, 16, 17, ...), addresses of either alignment (views at an
    odd offset), both constexpr values: every launch writes the bits of Triton's own launch of
    the same call, repeated calls included (the kept kernels)."""
    launch = FastLauncher(_axpy_kernel)
    base_x = torch.randn(300, device=DEVICE)
    base_y = torch.randn(300, device=DEVICE)
    calls = 0
    for _ in range(2):
        for n in (1, 16, 17, 64, 100):
            for offset in (0, 1, 4):  # 4 floats = 16 bytes: aligned again
                x, y = base_x[offset:offset + n], base_y[offset:offset + n]
                for square in (False, True):
                    got, want = torch.empty(n, device=DEVICE), torch.empty(n, device=DEVICE)
                    grid = (triton.cdiv(n, 64),)
                    launch[grid](x, y, got, n, 0.5, BLOCK=64, SQUARE=square)
                    launch.fn[grid](x, y, want, n, 0.5, BLOCK=64, SQUARE=square)
                    calls += 1
                    assert torch.equal(got, want), (n, offset, square)
                    assert torch.allclose(got, 0.5 * (x * x if square else x) + y)
    if DEVICE == "cuda":  # the second round took only kept kernels
        assert launch.fast_launches >= calls // 2
        assert 0 < len(launch.compiled) <= calls // 2


def test_quantize_equals_reference_on_repeated_calls():
    x = torch.randn(64, 200, device=DEVICE).to(torch.bfloat16)
    spec = OperandSpec(hadamard_size=32, rounding="sr", sr_seed=11)
    want = quantize_operand(x, 1, spec)
    for _ in range(3):
        for view in (x, x[1:]):  # the tensor and a view of it one row in
            got = quantize_operand_triton(view, 1, spec, e4m3=True)
            ref = want if view is x else quantize_operand(view, 1, spec)
            assert torch.equal(got["mx"].codes, ref.codes) and torch.equal(got["mx"].scale_e8m0, ref.scale_e8m0)


@pytest.mark.skipif(DEVICE != "cuda", reason="the kept kernels exist on a GPU only")
def test_misaligned_operand_gets_its_own_kernel():
    from adahop.kernels.quantize import _QUANTIZE

    raw = torch.randn(64 * 97 + 1, device="cuda").to(torch.bfloat16)
    x_aligned = raw[: 64 * 96].view(64, 96)
    x_odd = raw[1: 1 + 64 * 96].view(64, 96)  # 2 bytes in: not 16-byte aligned
    for x in (x_aligned, x_odd, x_aligned, x_odd):
        spec = OperandSpec(hadamard_size=32)
        got = quantize_operand_triton(x, 1, spec, e4m3=True)
        ref = quantize_operand(x, 1, spec)
        assert torch.equal(got["mx"].codes, ref.codes) and torch.equal(got["mx"].scale_e8m0, ref.scale_e8m0)
    assert _QUANTIZE.fast_launches > 0


def test_other_triton_versions_take_tritons_own_launch_path(monkeypatch):
    """The fast path calls Triton 3.6's launch internals: on any other version every launch goes
    through ``kernel[grid]`` (the same results, the host cost of Triton's path)."""
    import adahop.kernels.launch as launch_mod

    calls = []

    class Kernel:  # stands in for a JITFunction: its params and its own launch
        params = [type("P", (), {"is_constexpr": c, "name": n})() for n, c in (("x", False), ("B", True))]

        def __getitem__(self, grid):
            return lambda *a, **kw: calls.append((grid, a, kw)) or "launched"

    monkeypatch.setattr(launch_mod, "FAST_PATH", False)
    fast = FastLauncher(Kernel())
    x = torch.zeros(4)
    assert fast[(1,)](x, B=4) == "launched" and fast[(2,)](x, B=4) == "launched"
    assert len(calls) == 2 and fast.fast_launches == 0 and not fast.compiled
