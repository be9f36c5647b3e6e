"""Triton kernels against the reference, bit for bit (on the CPU through TRITON_INTERPRET=1,
set in conftest.py; on a GPU natively). Grids stay small: the interpreter runs each program
in Python."""

import math

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

import adahop  # noqa: E402
from adahop.formats.mxfp4 import _round_rne, _round_sr, dequantize_mxfp4, e2m1_magnitude  # noqa: E402
from adahop.kernels.mxfp4_math import e2m1_rne_arith, e2m1_sr  # noqa: E402
from adahop.kernels.quantize import quantize_operand_triton  # noqa: E402
from adahop.kernels.unpack import unpack_to_e4m3  # noqa: E402
from adahop.ops import OperandSpec, quantize_operand  # noqa: E402
from adahop.ops.backends import get_backend, unavailable_reason  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make(shape, dtype=torch.float32, seed=0, outliers=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp(torch.randn(shape[0], 1, generator=g) * 2)
    if outliers:
        x[torch.rand(shape, generator=g) < 0.01] *= 40
        x[:, :1] *= 20
    return x.to(dtype).to(DEVICE)


def assert_same_mx(a, b):
    assert torch.equal(a.codes.cpu(), b.codes.cpu())
    assert torch.equal(a.scale_e8m0.cpu(), b.scale_e8m0.cpu())


CASES = [
    # (shape, dim, hadamard, signs_seed, scale_mode, rounding)
    ((16, 64), 1, None, None, "even", "rne"),
    ((20, 70), 1, 32, None, "even", "rne"),
    ((33, 50), 0, 32, 5, "rceil", "sr"),
    ((8, 256), 1, 128, None, "floor", "sr"),
    ((40, 33), 0, 16, None, "ceil", "rne"),
    ((24, 96), 1, 64, 9, "even", "sr"),
    ((17, 300), 1, 256, None, "rceil", "rne"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape,dim,h,signs,mode,rounding", CASES)
def test_quantize_kernel_bit_exact(shape, dim, h, signs, mode, rounding, dtype):
    x = make(shape, dtype, seed=len(shape) + shape[0])
    spec = OperandSpec(scale_mode=mode, rounding=rounding, hadamard_size=h, signs_seed=signs, sr_seed=1234)
    ref = quantize_operand(x, dim, spec)
    assert_same_mx(quantize_operand_triton(x, dim, spec)["mx"], ref)


def _bf16_rounding_cases(seed=0):
    """float32 values whose bfloat16 rounding is every kind of case: ties (half an ulp above a
    bfloat16, both parities), subnormals, values that round to Inf, NaN, Inf, signed zero."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(40, 96, generator=g) * torch.exp(torch.randn(40, 1, generator=g) * 3)
    b = torch.randn(8, 96, generator=g).to(torch.bfloat16)
    x[:8] = ((b.view(torch.int16).to(torch.int32) << 16) | 0x8000).view(torch.float32)
    x[8:11] = torch.randn(3, 96, generator=g) * 1e-39  # subnormal in float32 and bfloat16
    x[11, 3], x[12, 5], x[13, 7], x[13, 8] = float("nan"), float("inf"), 3.3999e38, -3.3999e38
    x[14] = -0.0
    return x


@pytest.mark.parametrize("dim,e4m3,spec,kw", [
    (1, False, OperandSpec(hadamard_size=32), {}),
    (0, True, OperandSpec(hadamard_size=32, rounding="sr", sr_seed=4), {}),
    (1, True, OperandSpec(), dict(single_chunk_max=0)),
    (1, True, OperandSpec(hadamard_size=16), dict(single_chunk_max=4096)),
])
def test_round_to_bf16_in_the_loads_equals_the_cast(dim, e4m3, spec, kw):
    """``round_to_bf16`` on a float32 operand gives the bits of quantizing ``x.to(bfloat16)``: the
    packed form against the reference, the e4m3 form against the kernel on the cast copy (the
    interpreter's bfloat16 loads mangle subnormals, so that comparison leaves them out)."""
    x = _bf16_rounding_cases().to(DEVICE)
    out = quantize_operand_triton(x, dim, spec, round_to_bf16=True, packed=not e4m3, e4m3=e4m3, **kw)
    if not e4m3:
        assert_same_mx(out["mx"], quantize_operand(x.to(torch.bfloat16), dim, spec))
        return
    if DEVICE == "cpu":
        x = torch.cat((x[:8], x[11:]))
        out = quantize_operand_triton(x, dim, spec, round_to_bf16=True, packed=False, e4m3=True, **kw)
    want = quantize_operand_triton(x.to(torch.bfloat16), dim, spec, packed=False, e4m3=True, **kw)
    assert torch.equal(out["e4m3"].view(torch.uint8), want["e4m3"].view(torch.uint8))
    assert torch.equal(out["row_scale"], want["row_scale"])
    with pytest.raises(ValueError, match="float32"):
        quantize_operand_triton(x.to(torch.bfloat16), dim, spec, round_to_bf16=True)


@pytest.mark.parametrize("sr_seed,signs_seed,big_keys",
                         [(2, 3, (True, False)), (3, 2, (False, True)), (7, 8, (True, True))])
def test_hash_keys_of_either_sign_as_int32(sr_seed, signs_seed, big_keys):
    """The SR and sign keys reach the kernel as int32 (one compiled kernel for every key): keys
    at or above 2**31 arrive negative and must give the reference's bits all the same."""
    from adahop.kernels.quantize import _lowbias32_int, as_int32, sign_key, sr_args, sr_key

    spec = OperandSpec(rounding="sr", hadamard_size=32, signs_seed=signs_seed, sr_seed=sr_seed)
    keys = (sr_args(spec)[0], sign_key(spec))
    assert keys == (as_int32(sr_key(sr_seed)), as_int32(_lowbias32_int(signs_seed)))
    assert all(-(2**31) <= k < 2**31 for k in keys)
    assert (sr_key(sr_seed) >= 2**31, _lowbias32_int(signs_seed) >= 2**31) == big_keys  # the cases cover both
    x = make((16, 64), torch.bfloat16, seed=sr_seed)
    assert_same_mx(quantize_operand_triton(x, 1, spec)["mx"], quantize_operand(x, 1, spec))


@pytest.mark.skipif(DEVICE == "cpu", reason="the interpreter compiles nothing")
def test_new_hash_keys_compile_nothing():
    from adahop.kernels.quantize import _mxfp4_quantize_kernel

    x = make((64, 256), torch.bfloat16)
    spec = OperandSpec(rounding="sr", hadamard_size=32, signs_seed=0, sr_seed=0)
    quantize_operand_triton(x, 1, spec, e4m3=True, packed=False)
    kernel_cache = _mxfp4_quantize_kernel.device_caches[torch.cuda.current_device()][0]
    compiled = len(kernel_cache)
    for seed in range(1, 40):  # keys of both signs, some divisible by 16
        spec = OperandSpec(rounding="sr", hadamard_size=32, signs_seed=seed, sr_seed=seed)
        quantize_operand_triton(x, 1, spec, e4m3=True, packed=False)
    assert len(kernel_cache) == compiled


@pytest.mark.parametrize("single_chunk_max", [0, 4096])  # the two-pass e4m3 form, and one chunk per row
def test_quantize_kernel_special_values(single_chunk_max):
    x = make((16, 96))
    x[0, 5] = float("nan")
    x[1, 40] = float("inf")
    x[2, 70] = -float("inf")
    x[3] = 0.0
    x[4, :32] = -0.0
    x[5, :32] = 1e-40  # subnormal inputs
    for h in (None, 32):
        spec = OperandSpec(hadamard_size=h)
        ref = quantize_operand(x, 1, spec)
        out = quantize_operand_triton(x, 1, spec, e4m3=True, single_chunk_max=single_chunk_max)
        assert_same_mx(out["mx"], ref)
        assert (ref.scale_e8m0[:3] == 255).any(dim=1).all()
        # the e4m3 form carries NaN exactly where the MXFP4 value is NaN
        fold = out["e4m3"].float() * out["row_scale"][:, None]
        deq = dequantize_mxfp4(ref, keep_padding=True)
        assert torch.equal(torch.isnan(fold), torch.isnan(deq))
        assert torch.equal(torch.nan_to_num(fold), torch.nan_to_num(deq))


@pytest.mark.parametrize("single_chunk_max", [0, 4096])
@pytest.mark.parametrize("dim,h", [(1, None), (1, 32), (0, 32)])
def test_e4m3_fold_is_exact_within_14_binades(dim, h, single_chunk_max):
    x = make((32, 128), seed=3, outliers=False)  # row spread e**(2*randn): blocks stay close
    spec = OperandSpec(hadamard_size=h)
    ref = quantize_operand(x, dim, spec)
    out = quantize_operand_triton(x, dim, spec, e4m3=True, single_chunk_max=single_chunk_max)
    assert_same_mx(out["mx"], ref)
    deq = dequantize_mxfp4(ref, keep_padding=True)
    assert torch.equal(out["e4m3"].float() * out["row_scale"][:, None], deq)


def test_e4m3_fold_rounds_far_blocks_within_bound():
    # one block 2**20 below its row's largest: more than 14 binades, so e4m3 rounds it
    x = make((16, 64), outliers=False)
    x[:, 32:] *= 2.0**-20
    ref = quantize_operand(x, 1, OperandSpec())
    out = quantize_operand_triton(x, 1, OperandSpec(), e4m3=True)
    deq = dequantize_mxfp4(ref, keep_padding=True)
    fold = out["e4m3"].float() * out["row_scale"][:, None]
    assert torch.equal(fold[:, :32], deq[:, :32])
    row_max = deq.abs().amax(1, keepdim=True)
    assert ((fold - deq).abs() <= row_max * 2.0**-15).all()


@pytest.mark.parametrize("dim,h,rounding", [(1, None, "rne"), (0, 32, "sr"), (1, 64, "rne")])
def test_unpack_equals_direct_e4m3(dim, h, rounding):
    x = make((24, 100), seed=5)
    spec = OperandSpec(hadamard_size=h, rounding=rounding, sr_seed=7)
    direct = quantize_operand_triton(x, dim, spec, e4m3=True, single_chunk_max=0)
    e4, rs = unpack_to_e4m3(direct["mx"])
    assert torch.equal(e4.view(torch.uint8), direct["e4m3"].view(torch.uint8))
    assert torch.equal(rs, direct["row_scale"])


def test_kernels_refuse_what_they_do_not_implement():
    x = make((16, 64))
    with pytest.raises(ValueError, match="MX blocks of 32, got block_size=16"):
        quantize_operand_triton(x, 1, OperandSpec(block_size=16))
    with pytest.raises(ValueError, match="take an OperandSpec, got dict"):
        quantize_operand_triton(x, 1, dict(hadamard_size=32))
    with pytest.raises(ValueError, match="2-D"):
        quantize_operand_triton(x[0], 0, OperandSpec())


def test_backend_dispatch():
    assert get_backend("auto", "cpu").name == "reference"
    with pytest.raises(ValueError, match="CUDA"):
        get_backend("hopper_fp8", "cpu")
    with pytest.raises(ValueError, match="known"):
        get_backend("native_fp4")
    assert unavailable_reason("triton", DEVICE) is None
    if not torch.cuda.is_available():  # a CUDA device asked for where there is none: a reason, no crash
        for name in ("hopper_fp8", "native_mx"):
            assert "got device cuda" in unavailable_reason(name, "cuda")
        assert get_backend("auto", "cuda").name == "reference"


def _run(layer, x, g):
    xx = x.clone().requires_grad_()
    y = layer(xx)
    y.backward(g)
    return y.detach(), xx.grad, layer.weight.grad


@pytest.mark.parametrize(
    "recipe,modes",
    [
        ("mxfp4", None),
        ("mxfp4_iht", None),
        ("tseng", None),
        ("adahop_lv2", {"fprop": "iht+oe_left", "dgrad": "iht+oe_right", "wgrad": "iht+oe_right"}),
        ("adahop_lv1", {"fprop": "iht+oe_right", "dgrad": "iht+oe_left", "wgrad": "iht"}),
    ],
)
@pytest.mark.parametrize("autocast", [False, True])
def test_linear_on_triton_backend_equals_reference(recipe, modes, autocast):
    """The whole layer (all three GEMMs, SR, OE) on the Triton kernels gives the reference's
    bits: the kernel backend skips OE's zeroing, which cannot change the result. Under bf16
    autocast the float32 weight of a plain mode is rounded to bf16 in the quantize kernel's
    loads, where the reference casts it first."""
    T, K, N = 40, 64, 48
    x, w, g = make((T, K), seed=1), make((N, K), seed=2, outliers=False) * 0.1, make((T, N), seed=3)
    outs = []
    for backend in ("reference", "triton"):
        cfg = adahop.AdaHOPConfig.from_recipe_name(recipe, backend=backend).with_gemm_settings(oe_k=4)
        lin = torch.nn.Linear(K, N, bias=False, device=DEVICE)
        lin.weight.data.copy_(w)
        layer = adahop.AdaHOPLinear.from_float(lin, config=cfg, name="probe")
        if modes:
            layer.set_modes(modes)
        with torch.autocast(torch.device(DEVICE).type, dtype=torch.bfloat16, enabled=autocast):
            outs.append(_run(layer, x, g if not autocast else g.to(torch.bfloat16)))
    for ref, got in zip(outs[0], outs[1]):
        assert torch.equal(ref, got)
    assert not math.isnan(outs[0][0].sum().item())


@pytest.mark.parametrize("dim,h,rounding", [(1, 32, "rne"), (0, 16, "sr"), (1, None, "sr")])
def test_single_chunk_path_equals_two_pass(dim, h, rounding):
    x = make((20, 200), seed=9)
    spec = OperandSpec(hadamard_size=h, rounding=rounding, sr_seed=3)
    kw = dict(e4m3=True, block_k=64)
    two = quantize_operand_triton(x, dim, spec, single_chunk_max=0, **kw)
    one = quantize_operand_triton(x, dim, spec, single_chunk_max=4096, **kw)
    assert_same_mx(one["mx"], two["mx"])
    assert torch.equal(one["e4m3"].view(torch.uint8), two["e4m3"].view(torch.uint8))
    assert torch.equal(one["row_scale"], two["row_scale"])
    assert_same_mx(one["mx"], quantize_operand(x, dim, spec))


@pytest.mark.parametrize("dim,h,mode,rounding", [(1, 32, "even", "rne"), (0, None, "floor", "rne"),
                                                 (1, 64, "rceil", "rne"), (1, 32, "even", "sr"),
                                                 (0, 16, "rceil", "sr")])
@pytest.mark.parametrize("single_chunk_max", [0, 4096])
def test_arithmetic_encoders_equal_the_reference(dim, h, mode, rounding, single_chunk_max):
    """The arithmetic E2M1 encoders give the reference codes (RNE and SR, special values too),
    and the e4m3 form carries the reference's values."""
    x = make((24, 96), seed=11)
    x[0, 3] = float("nan")
    x[1] = 0.0
    spec = OperandSpec(hadamard_size=h, scale_mode=mode, rounding=rounding, sr_seed=21)
    ref = quantize_operand(x, dim, spec)
    out = quantize_operand_triton(x, dim, spec, e4m3=True, single_chunk_max=single_chunk_max)
    assert_same_mx(out["mx"], ref)
    fold = out["e4m3"].float() * out["row_scale"][:, None]
    deq = dequantize_mxfp4(ref, keep_padding=True)
    assert torch.equal(torch.isnan(fold), torch.isnan(deq))
    assert torch.equal(torch.nan_to_num(fold), torch.nan_to_num(deq))


@triton.jit
def _both_encoders(a_ptr, bits_ptr, codes_ptr, values_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    a = tl.load(a_ptr + offs, mask=m, other=0.0)
    bits = tl.load(bits_ptr + offs, mask=m, other=0)
    c_rne, v_rne = e2m1_rne_arith(a)
    c_sr, v_sr = e2m1_sr(a, bits)
    tl.store(codes_ptr + offs, c_rne, mask=m)
    tl.store(codes_ptr + n + offs, c_sr, mask=m)
    tl.store(values_ptr + offs, v_rne, mask=m)
    tl.store(values_ptr + n + offs, v_sr, mask=m)


def test_arithmetic_encoders_on_every_boundary():
    """Encoder level: the arithmetic RNE encoder against the reference's comparison chain
    (``_round_rne``), and the SR encoder against its ``_round_sr``, on the grid points, the
    midpoints, one float32 step either side of each, values one 2**-17 step around a 16-bit
    fraction, and random magnitudes; SR with the extreme and the middle random bits. Each
    encoder's rounded value is its code's."""
    grid_pts = torch.tensor([0, 0.25, 0.5, 0.75, 1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6], dtype=torch.float32)
    near = torch.tensor([0.5 + 3 * 2**-18, 0.5 + 2**-18, 1.75 - 2**-17, 2.5 + 2**-16, 4.0 - 2**-16, 5.0 + 2**-15])
    special = torch.cat([grid_pts, near, torch.nextafter(grid_pts, torch.tensor(7.0)),
                         torch.nextafter(grid_pts, torch.tensor(-1.0)).clamp(min=0)])
    gen = torch.Generator().manual_seed(0)
    a = torch.cat([special.repeat(8), torch.rand(4096 - 8 * special.numel(), generator=gen) * 6]).clamp(max=6.0)
    bits = torch.randint(0, 2**16, (a.numel(),), generator=gen, dtype=torch.int32)
    bits[: 8 * special.numel()] = torch.tensor(
        [0, 1, 2**15 - 1, 2**15, 2**15 + 1, 2**16 - 2, 2**16 - 1, 12345], dtype=torch.int32
    ).repeat_interleave(special.numel())
    codes = torch.empty(2 * a.numel(), dtype=torch.int32, device=DEVICE)
    values = torch.empty(2 * a.numel(), dtype=torch.float32, device=DEVICE)
    _both_encoders[(triton.cdiv(a.numel(), 1024),)](a.to(DEVICE), bits.to(DEVICE), codes, values, a.numel(),
                                                    BLOCK=1024)
    codes, values = codes.view(2, -1).cpu(), values.view(2, -1).cpu()
    assert torch.equal(codes[0], _round_rne(a).to(torch.int32))
    assert torch.equal(codes[1], _round_sr(a, bits.to(torch.int64)).to(torch.int32))
    assert torch.equal(values, e2m1_magnitude(codes))


@pytest.mark.parametrize("dim,h,rounding,e4m3",
                         [(1, 32, "rne", True), (0, 16, "sr", True), (1, None, "sr", False), (0, 64, "rne", False)])
def test_k_split_equals_one_range_per_row(dim, h, rounding, e4m3):
    """Splitting K over several programs (operands with few rows) gives the same bits: the
    blocks are independent, and the e4m3 row scale comes from the ranges' partial maxima."""
    x = make((20, 456), seed=13)  # K padded to 512 (or 480): 8 chunks of 64
    x[3, 200] = float("inf")
    x = x if dim == 1 else x.t().contiguous()
    spec = OperandSpec(hadamard_size=h, rounding=rounding, sr_seed=4)
    kw = dict(e4m3=e4m3, block_k=64)
    one = quantize_operand_triton(x, dim, spec, k_splits=1, **kw)
    for splits in (3, 8, 50):  # 3 ranges of 3, 3, 2 chunks; one chunk each; more than chunks
        got = quantize_operand_triton(x, dim, spec, k_splits=splits, **kw)
        assert_same_mx(got["mx"], one["mx"])
        if e4m3:
            assert torch.equal(got["e4m3"].view(torch.uint8), one["e4m3"].view(torch.uint8))
            assert torch.equal(got["row_scale"], one["row_scale"])
    assert_same_mx(one["mx"], quantize_operand(x, dim, spec))
    with pytest.raises(ValueError, match="k_splits"):
        quantize_operand_triton(x, dim, spec, k_splits=0, **kw)


def test_auto_k_splits(monkeypatch):
    from adahop.kernels import quantize

    assert quantize.auto_k_splits(4, 100, torch.device("cpu")) == 1
    cuda = torch.device("cuda")
    monkeypatch.setitem(quantize._SM_COUNT, cuda, 132)  # an H100/H200's SMs, without a GPU
    assert quantize.auto_k_splits(24, 128, cuda) == 22  # 24 row groups x 22 ranges >= 4 per SM
    assert quantize.auto_k_splits(24, 8, cuda) == 8  # at most one range per chunk
    assert quantize.auto_k_splits(1024, 128, cuda) == 1  # the rows alone fill the GPU
    assert quantize.auto_k_splits(0, 128, cuda) == 1


@pytest.mark.parametrize("shape,dim", [((5, 0), 1), ((0, 64), 1), ((0, 64), 0), ((5, 0), 0)])
def test_empty_operands(shape, dim):
    """An empty operand quantizes to empty outputs; a row with no elements (K = 0) has no blocks,
    so its largest block exponent is the E8M0 minimum and its row scale 2**(-127 - 6)."""
    x = torch.zeros(shape, device=DEVICE)
    out = quantize_operand_triton(x, dim, OperandSpec(hadamard_size=32), e4m3=True)
    R, K = shape[1 - dim], shape[dim]
    assert out["e4m3"].shape == (R, -(-K // 32) * 32) and out["row_scale"].shape == (R,)
    assert torch.equal(out["row_scale"].cpu(), torch.full((R,), 2.0**-133))
    assert out["mx"].codes.shape[0] == R


@pytest.mark.parametrize("block_k", [32, 64, 256])
def test_unpack_over_several_chunks(block_k):
    """The unpack grid's chunks (2-D grid) and the separate row-exponent pass give the direct
    e4m3 bytes, NaN blocks (0x7F), a zero row and a row of tiny blocks far below its largest included."""
    x = make((40, 300), seed=17)  # KP = 320: several chunks for block_k 32 and 64, a partial one for 256
    x[2, 5] = float("nan")
    x[3, 100] = float("inf")
    x[4] = 0.0
    x[5, :32] *= 1e6  # the rest of row 5 sits ~20 binades below: rounded by the fold
    direct = quantize_operand_triton(x, 1, OperandSpec(hadamard_size=32), e4m3=True)
    e4, rs = unpack_to_e4m3(direct["mx"], block_k=block_k)
    assert torch.equal(e4.view(torch.uint8), direct["e4m3"].view(torch.uint8))
    assert torch.equal(rs, direct["row_scale"])
    for bad in (48, 96, 16):
        with pytest.raises(ValueError, match="block_k"):
            unpack_to_e4m3(direct["mx"], block_k=bad)
    with pytest.raises(ValueError, match="block_r"):
        unpack_to_e4m3(direct["mx"], block_r=12)


def test_hopper_mm_nt_float32_output_and_its_fallback(monkeypatch):
    """hopper_fp8's GEMM writes float32 through row-wise scales where torch allows it; where torch
    refuses a float32 output with row-wise scales it applies the scales after a unit-scale GEMM
    (the same values), remembers that, and any other error is raised. ``torch._scaled_mm`` is
    emulated here (the CPU has no FP8 GEMM of this form)."""
    from adahop.ops.backends.hopper_fp8 import HopperFP8Backend

    calls = []

    def fake_scaled_mm(a, b, *, scale_a, scale_b, out_dtype, use_fast_accum, refuse=True):
        rowwise = scale_a.dim() == 2
        calls.append((rowwise, out_dtype))
        if rowwise and out_dtype == torch.float32 and refuse:
            raise RuntimeError("Only bf16 high precision output types are supported for row-wise scaling.")
        return ((a.float() @ b.float()) * scale_a * scale_b).to(out_dtype)

    monkeypatch.setattr(HopperFP8Backend, "rowwise_fp32_out", True)
    backend = HopperFP8Backend()
    x, w = make((48, 64), seed=3), make((40, 64), seed=4)
    spec = OperandSpec(hadamard_size=32)
    a, b = backend.quantize(x, 1, spec), backend.quantize(w, 1, spec)
    monkeypatch.setattr(torch, "_scaled_mm", lambda *args, **kw: fake_scaled_mm(*args, refuse=False, **kw))
    direct = backend.mm_nt(a, b, torch.float32)
    assert calls == [(True, torch.float32)]
    monkeypatch.setattr(torch, "_scaled_mm", fake_scaled_mm)
    calls.clear()
    fallback = backend.mm_nt(a, b, torch.float32)
    assert calls == [(True, torch.float32), (False, torch.float32)] and not HopperFP8Backend.rowwise_fp32_out
    assert torch.equal(direct, fallback)
    calls.clear()
    backend.mm_nt(a, b, torch.float32)  # remembered: straight to the unit-scale GEMM
    assert calls == [(False, torch.float32)]

    def broken(*args, **kw):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(HopperFP8Backend, "rowwise_fp32_out", True)
    monkeypatch.setattr(torch, "_scaled_mm", broken)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        backend.mm_nt(a, b, torch.float32)
    assert HopperFP8Backend.rowwise_fp32_out
