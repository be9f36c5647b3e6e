"""The 1x128 block-scaled e4m3 form (``hopper_fp8_block``): one scale per row and 128-element group.

Against the reference on the CPU (TRITON_INTERPRET=1, conftest.py): the folded e4m3 values times
their group scales are the reference's MXFP4 values exactly (blocks within 14 binades of their
group's largest), the unpacked saved form equals the direct one bit for bit, and the layer on the
backend (its cuBLAS GEMM emulated in float32 on the CPU) matches the reference backend."""

import pytest
import torch

triton = pytest.importorskip("triton")

from adahop.formats.mxfp4 import dequantize_mxfp4  # noqa: E402
from adahop.kernels.quantize import quantize_operand_triton  # noqa: E402
from adahop.kernels.unpack import unpack_to_e4m3  # noqa: E402
from adahop.ops import OperandSpec, quantize_operand  # noqa: E402
from adahop.ops import backends, kernel_backends  # noqa: E402
from adahop.ops.backends import ReferenceBackend  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make(shape, seed=0, spread=2.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp(torch.randn(shape[0], 1, generator=g) * spread)
    x[torch.rand(shape, generator=g) < 0.01] *= 40
    return x.to(torch.bfloat16).to(DEVICE)


def group_values(e4m3, group_scale):
    return e4m3.float() * group_scale.repeat_interleave(128, dim=1)


CASES = [  # (shape, dim, hadamard, signs, rounding, scale mode)
    ((16, 256), 1, 32, None, "rne", "even"),
    ((20, 300), 1, None, None, "sr", "even"),  # K padded to 320 (reference) and 384 (e4m3 form)
    ((260, 24), 0, 32, 7, "sr", "rceil"),
    ((8, 512), 1, 256, None, "rne", "floor"),
]


@pytest.mark.parametrize("shape,dim,h,signs,rounding,mode", CASES)
def test_group_form_is_the_reference_values(shape, dim, h, signs, rounding, mode):
    x = make(shape, seed=shape[0])
    spec = OperandSpec(rounding=rounding, hadamard_size=h, signs_seed=signs, sr_seed=3, scale_mode=mode)
    ref = quantize_operand(x, dim, spec)
    out = quantize_operand_triton(x, dim, rounding=rounding, hadamard_size=h, signs_seed=signs, sr_seed=3,
                                  scale_mode=mode, e4m3=True, packed=True, group_scale=True)
    deq = dequantize_mxfp4(ref, keep_padding=True)
    R, KP = deq.shape
    e4, gs = out["e4m3"], out["group_scale"]
    EKP = -(-KP // 128) * 128
    assert e4.shape == (R, EKP) and gs.shape == (R, EKP // 128)
    want = torch.zeros(R, EKP, device=deq.device)
    want[:, :KP] = deq
    assert torch.equal(group_values(e4, gs), want)
    # the scale of a group is 2**(its largest block exponent - 6), from the reference's bytes
    e = ref.scale_e8m0.to(torch.int32) - 127
    e = torch.nn.functional.pad(e, (0, EKP // 32 - e.shape[1]), value=-127).reshape(R, -1, 4).amax(2)
    assert torch.equal(gs, torch.exp2((e - 6).double()).float())
    # the packed form of the same call is the reference's (KP unchanged, so are the SR draws)
    assert torch.equal(out["mx"].codes, ref.codes) and torch.equal(out["mx"].scale_e8m0, ref.scale_e8m0)


def test_group_form_non_finite_blocks_and_far_blocks():
    x = make((8, 256), seed=1).float()
    x[2, 40] = float("nan")
    x[3, 200] = float("inf")
    x[4, :32] *= 2.0**-20  # 20 binades below its group's largest block: rounded, not exact
    out = quantize_operand_triton(x, 1, e4m3=True, packed=False, group_scale=True)
    e4 = out["e4m3"].view(torch.uint8)
    assert (e4[2, 32:64] == 0x7F).all() and (e4[3, 192:224] == 0x7F).all()
    assert (e4[2, :32] != 0x7F).all() and (e4[2, 128:] != 0x7F).all()  # other blocks untouched
    ref = dequantize_mxfp4(quantize_operand(x, 1, OperandSpec()), keep_padding=True)
    got = group_values(out["e4m3"], out["group_scale"])
    fine = torch.isfinite(ref)
    fine[4, :32] = False
    assert torch.equal(got[fine], ref[fine])
    group_max = ref[4, :128].abs().max()
    assert (got[4, :32] - ref[4, :32]).abs().max() <= 2.0**-15 * group_max


@pytest.mark.parametrize("dim,h", [(1, 32), (0, None)])
def test_unpack_to_group_form_equals_direct(dim, h):
    x = make((40, 200), seed=4)
    x[5, 7] = float("nan")
    out = quantize_operand_triton(x, dim, rounding="sr", sr_seed=9, hadamard_size=h, e4m3=True, packed=True, group_scale=True)
    e4, gs = unpack_to_e4m3(out["mx"], group_scale=True)
    assert torch.equal(e4.view(torch.uint8), out["e4m3"].view(torch.uint8))
    assert torch.equal(gs, out["group_scale"])


def test_group_form_arguments():
    x = make((16, 64))
    with pytest.raises(ValueError, match="needs e4m3=True"):
        quantize_operand_triton(x, 1, group_scale=True)
    empty = quantize_operand_triton(make((0, 64)), 1, e4m3=True, packed=False, group_scale=True)
    assert empty["e4m3"].shape == (0, 128) and empty["group_scale"].shape == (0, 1)


def _emulated_block_mm(a, b, out_dtype):
    """cuBLAS's 1x128 block-scaled GEMM in float32 (exact products, float32 sums): for the CPU."""
    fa = group_values(a.e4m3, a.group_scale)
    fb = group_values(b.e4m3, b.group_scale)
    return (fa @ fb.t()).to(out_dtype)


@pytest.mark.parametrize("recipe,modes", [
    ("adahop_lv2", {"fprop": "iht", "dgrad": "iht+oe_left", "wgrad": "iht+oe_right"}),
    ("tseng", None),
])
def test_layer_on_block_backend_matches_reference(monkeypatch, layer_on_backend, recipe, modes):
    monkeypatch.setattr(kernel_backends, "_scaled_mm_block", _emulated_block_mm)
    T, K, N = 96, 160, 64  # K and T not multiples of 128: the e4m3 forms are padded
    x, g = make((T, K), seed=1, spread=0.5).float(), make((T, N), seed=3, spread=0.5).float()
    w = make((N, K), seed=2, spread=0.3).float() * 0.1
    outs = [layer_on_backend(backend, recipe, x, w, g, modes)
            for backend in (ReferenceBackend(), kernel_backends.HopperFP8BlockBackend())]
    for want, got in zip(*outs):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * want.abs().max().item())


def test_block_backend_gate():
    if DEVICE == "cpu":
        assert "needs a CUDA GPU" in backends.unavailable_reason("hopper_fp8_block", "cpu")
        assert backends.get_backend("auto", "cpu").name == "reference"
    else:  # never picked by auto
        assert backends.get_backend("auto", "cuda").name != "hopper_fp8_block"
