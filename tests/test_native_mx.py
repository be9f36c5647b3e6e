"""The MX tensor-core GEMM (kernels.mx_gemm) and the ``native_mx`` backend, against the reference.

On the CPU (TRITON_INTERPRET=1, conftest.py) the kernel runs with its in-kernel decode in place of
``tl.dot_scaled``, which the interpreter lacks; on a CUDA GPU the tests run ``tl.dot_scaled``
itself (on Hopper Triton emulates it through BF16: correct, and slow). The gate that keeps
``native_mx`` off GPUs without MX tensor cores is tested with a faked device."""

import pytest
import torch

triton = pytest.importorskip("triton")

from adahop.formats.mxfp4 import dequantize_mxfp4, quantize_mxfp4  # noqa: E402
from adahop.kernels.mx_gemm import mxfp4_gemm_nt  # noqa: E402
from adahop.ops import backends  # noqa: E402
from adahop.ops.backends import ReferenceBackend  # noqa: E402
from adahop.ops.backends.native_mx import NativeMXBackend  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
F32_EPS = 2.0**-23


def operand(rows, k, seed, spread=3.0):
    """Rows and K-blocks over ~2 * spread binades, a few large outliers."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * torch.exp(torch.randn(rows, 1, generator=g) * spread)
    x *= torch.exp(torch.randn(1, k, generator=g))
    x[torch.rand(rows, k, generator=g) < 0.01] *= 30
    return x.to(DEVICE)


def reference_mm(qa, qb):
    fa = dequantize_mxfp4(qa, keep_padding=True)
    fb = dequantize_mxfp4(qb, keep_padding=True)
    return fa @ fb.t(), fa.abs() @ fb.abs().t()


def assert_accumulation_close(got, want, absprod, kp):
    """Equal up to float32 accumulation order: |got - want| <= 2 * KP * eps * sum |a||b|."""
    ok = torch.isfinite(want)
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    err = (got.float() - want)[ok].abs()
    bound = 2 * kp * F32_EPS * absprod[ok] + 1e-30
    assert (err <= bound).all(), f"max excess {(err / bound).max().item():.3g}"


DOT_SCALED = [False] if DEVICE == "cpu" else [False, True]
TILES = dict(block_m=16, block_n=32, block_k=64) if DEVICE == "cpu" else {}


@pytest.mark.parametrize("dot_scaled", DOT_SCALED)
@pytest.mark.parametrize("M,N,K", [(32, 32, 64), (40, 24, 96), (33, 70, 200), (1, 5, 31)])
def test_gemm_matches_reference(M, N, K, dot_scaled):
    qa = quantize_mxfp4(operand(M, K, seed=M), dim=1)
    qb = quantize_mxfp4(operand(N, K, seed=N + 1), dim=1)
    want, absprod = reference_mm(qa, qb)
    got = mxfp4_gemm_nt(qa, qb, torch.float32, dot_scaled=dot_scaled, **TILES)
    assert got.dtype == torch.float32 and got.shape == (M, N)
    assert_accumulation_close(got, want, absprod, qa.padded_size)


@pytest.mark.skipif(DEVICE == "cpu", reason="real shapes and tl.dot_scaled need a GPU")
@pytest.mark.parametrize("M,N,K", [(4096, 4096, 4096), (1000, 3000, 1056)])
def test_gemm_matches_reference_at_real_shapes(M, N, K):
    qa = quantize_mxfp4(operand(M, K, seed=1), dim=1)
    qb = quantize_mxfp4(operand(N, K, seed=2), dim=1)
    want, absprod = reference_mm(qa, qb)
    assert_accumulation_close(mxfp4_gemm_nt(qa, qb), want, absprod, qa.padded_size)


@pytest.mark.parametrize("dot_scaled", DOT_SCALED)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_low_precision_output_is_the_rounded_float32_result(out_dtype, dot_scaled):
    qa = quantize_mxfp4(operand(48, 128, seed=3, spread=1.0) * 0.05, dim=1)  # within float16's range
    qb = quantize_mxfp4(operand(40, 128, seed=4, spread=1.0) * 0.05, dim=1)
    f32 = mxfp4_gemm_nt(qa, qb, torch.float32, dot_scaled=dot_scaled, **TILES)
    got = mxfp4_gemm_nt(qa, qb, out_dtype, dot_scaled=dot_scaled, **TILES)
    assert got.dtype == out_dtype and torch.isfinite(got).all()
    assert torch.equal(got, f32.to(out_dtype))


@pytest.mark.parametrize("dot_scaled", DOT_SCALED)
def test_nan_blocks_and_extreme_scales(dot_scaled):
    """A NaN/Inf block poisons exactly the dot products that touch it; blocks at the smallest
    and largest E8M0 scales keep their values."""
    a = operand(32, 96, seed=5)
    b = operand(32, 96, seed=6)
    a[3, 40] = float("nan")
    b[7, 5] = float("inf")
    a[10, :32] *= 2.0**-130  # scale byte near 0: subnormal float32 values
    b[12, 64:] *= 2.0**100
    qa, qb = quantize_mxfp4(a, dim=1), quantize_mxfp4(b, dim=1)
    want, absprod = reference_mm(qa, qb)
    got = mxfp4_gemm_nt(qa, qb, dot_scaled=dot_scaled, **TILES)
    assert torch.isnan(got[3]).all() and torch.isnan(got[:, 7]).all()
    assert torch.isfinite(got[:3, :7]).all()
    assert_accumulation_close(got, want, absprod, qa.padded_size)


def test_empty_and_zero_k():
    qa = quantize_mxfp4(torch.randn(0, 64, device=DEVICE), dim=1)
    qb = quantize_mxfp4(torch.randn(8, 64, device=DEVICE), dim=1)
    assert mxfp4_gemm_nt(qa, qb, **TILES).shape == (0, 8)
    qa = quantize_mxfp4(torch.randn(4, 0, device=DEVICE), dim=1)
    qb = quantize_mxfp4(torch.randn(8, 0, device=DEVICE), dim=1)
    out = mxfp4_gemm_nt(qa, qb, **TILES)
    assert out.shape == (4, 8) and (out == 0).all()


def test_bad_arguments():
    qa = quantize_mxfp4(torch.randn(16, 64), dim=1)
    qb = quantize_mxfp4(torch.randn(16, 96), dim=1)
    with pytest.raises(ValueError, match="disagree along K"):
        mxfp4_gemm_nt(qa, qb)
    with pytest.raises(ValueError, match="must be an MXFP4Tensor"):
        mxfp4_gemm_nt(torch.zeros(16, 32, dtype=torch.uint8), qa)
    with pytest.raises(ValueError, match="out_dtype"):
        mxfp4_gemm_nt(qa, qa, torch.int32)
    with pytest.raises(ValueError, match="block_k"):
        mxfp4_gemm_nt(qa, qa, block_k=48)
    with pytest.raises(ValueError, match="blocks of 32"):
        mxfp4_gemm_nt(quantize_mxfp4(torch.randn(16, 64), dim=1, block_size=16), qa)
    if DEVICE == "cpu":
        with pytest.raises(ValueError, match="interpreter has no tl.dot_scaled"):
            mxfp4_gemm_nt(qa, qa, dot_scaled=True)


def test_layer_matches_reference_backend(layer_on_backend):
    """adahop_lv2 with outlier extraction on all three GEMMs: output and both gradients from the
    native_mx backend equal the reference backend's up to float32 accumulation order."""
    T, K, N = 64, 96, 64
    x, g = operand(T, K, seed=7, spread=1.0), operand(T, N, seed=8, spread=1.0)
    w = operand(N, K, seed=9, spread=0.5) * 0.05
    modes = {"fprop": "iht+oe_left", "dgrad": "iht+oe_left", "wgrad": "iht+oe_right"}
    outs = [layer_on_backend(backend, "adahop_lv2", x, w, g, modes)
            for backend in (ReferenceBackend(), NativeMXBackend())]
    for want, got in zip(*outs):
        scale = want.abs().max().item()
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * scale)


# ---- the gate: native_mx only where MX tensor cores are ----------------------------------------


class _Props:
    def __init__(self, arch):
        self.gcnArchName = arch


def fake_gpu(monkeypatch, capability=None, hip_arch=None, name="Fake GPU"):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda dev=None: name)
    monkeypatch.setattr(torch.version, "hip", "6.4" if hip_arch else None)
    if hip_arch:
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev=None: _Props(hip_arch))
        capability = (9, 5)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: capability)
    monkeypatch.setattr(backends, "_INSTANCES", {})


def test_native_mx_is_refused_on_hopper_even_by_name(monkeypatch):
    fake_gpu(monkeypatch, capability=(9, 0), name="NVIDIA H200")
    reason = backends.unavailable_reason("native_mx", "cuda")
    assert reason is not None and "MX tensor cores" in reason and "NVIDIA H200" in reason
    with pytest.raises(ValueError, match="MX tensor cores"):
        backends.get_backend("native_mx", "cuda")
    assert backends.get_backend("auto", "cuda").name == "hopper_fp8"
    assert "native_mx" not in backends.available_backends("cuda")


@pytest.mark.parametrize("capability,hip_arch,arch", [((10, 0), None, "sm_100"), ((10, 3), None, "sm_103"),
                                                      (None, "gfx950:sramecc+:xnack-", "gfx950")])
def test_auto_picks_native_mx_on_mx_tensor_cores(monkeypatch, capability, hip_arch, arch):
    fake_gpu(monkeypatch, capability=capability, hip_arch=hip_arch)
    assert backends.native_mx_arch("cuda") == arch
    assert backends.get_backend("auto", "cuda").name == "native_mx"


@pytest.mark.parametrize("capability", [(12, 0), (12, 1)])
def test_consumer_blackwell_is_left_to_hopper_fp8(monkeypatch, capability):
    """Block-scaled MMA exists there, but Triton 3.6 may emulate tl.dot_scaled: not offered."""
    fake_gpu(monkeypatch, capability=capability, name="NVIDIA GeForce RTX 5090")
    assert backends.native_mx_arch("cuda") is None
    assert "RTX 5090" in backends.unavailable_reason("native_mx", "cuda")
    assert backends.get_backend("auto", "cuda").name == "hopper_fp8"


def test_no_mx_on_older_amd(monkeypatch):
    fake_gpu(monkeypatch, hip_arch="gfx942")
    assert backends.native_mx_arch("cuda") is None
    assert "MX tensor cores" in backends.unavailable_reason("native_mx", "cuda")


def test_native_mx_needs_a_gpu():
    assert "needs a GPU with MX tensor cores" in backends.unavailable_reason("native_mx", "cpu")
    with pytest.raises(ValueError, match="native_mx"):
        backends.get_backend("native_mx", "cpu")
