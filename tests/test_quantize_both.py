"""Both orientations of one operand from one kernel (kernels.quantize_both: e4m3 + e4m3, or e4m3 +
packed) against two calls of the one-orientation kernel (itself tested against the reference),
bit for bit; and the layer with and without the fused kernels. On the CPU through
TRITON_INTERPRET=1 (conftest.py)."""

import pytest
import torch

triton = pytest.importorskip("triton")

from emulated_hopper import EmulatedHopper  # noqa: E402

from adahop.kernels.quantize import quantize_operand_triton  # noqa: E402
from adahop.kernels.quantize_both import quantize_both  # noqa: E402
from adahop.ops.backends.hopper_fp8 import HopperFP8Backend  # noqa: E402
from adahop.ops.operand import OperandSpec  # noqa: E402
from adahop.ops.outliers import largest_k, outer_norms, topk_outer  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp(torch.randn(shape[0], 1, generator=g) * 2)
    x[torch.rand(shape, generator=g) < 0.01] *= 40
    return x.to(torch.bfloat16).to(DEVICE)


def assert_same(got, want):
    assert torch.equal(got["e4m3"].view(torch.uint8), want["e4m3"].view(torch.uint8))
    assert torch.equal(got["row_scale"], want["row_scale"])


def separately(x, cols, rows):
    return (quantize_operand_triton(x, 1, cols, e4m3=True, packed=False),
            quantize_operand_triton(x, 0, rows, e4m3=True, packed=False))


@pytest.mark.parametrize(
    "shape,cols,rows,tile",
    [
        ((100, 150), OperandSpec(hadamard_size=32, rounding="sr", sr_seed=5, signs_seed=9),
         OperandSpec(hadamard_size=32, rounding="sr", sr_seed=6, scale_mode="rceil"), {}),
        ((64, 64), OperandSpec(), OperandSpec(rounding="sr", sr_seed=1), {}),
        ((40, 200), OperandSpec(hadamard_size=16, scale_mode="floor"), OperandSpec(hadamard_size=64, signs_seed=2),
         dict(block_r=64, block_c=32)),
        ((130, 96), OperandSpec(hadamard_size=128, rounding="sr", sr_seed=3), OperandSpec(scale_mode="ceil"), {}),
    ],
)
def test_equals_two_one_orientation_calls(shape, cols, rows, tile):
    x = make(shape, seed=sum(shape))
    a, b = quantize_both(x, cols, rows, **tile)
    want_a, want_b = separately(x, cols, rows)
    assert_same(a, want_a)
    assert_same(b, want_b)


def test_special_values():
    x = make((70, 90), seed=4)
    x[3, 7] = float("nan")
    x[10, :] = 0.0
    x[:, 20] = 0.0
    x[50, 60] = float("inf")
    x[60, 5] = float("-inf")
    cols, rows = OperandSpec(hadamard_size=32, rounding="sr", sr_seed=7), OperandSpec(hadamard_size=32)
    a, b = quantize_both(x, cols, rows)
    want_a, want_b = separately(x, cols, rows)
    assert_same(a, want_a)
    assert_same(b, want_b)


@pytest.mark.parametrize(
    "shape,cols,rows,tile",
    [
        ((100, 150), OperandSpec(hadamard_size=32, signs_seed=9),
         OperandSpec(hadamard_size=32, rounding="sr", sr_seed=6), {}),
        ((64, 64), OperandSpec(), OperandSpec(), {}),
        ((130, 96), OperandSpec(hadamard_size=16, rounding="sr", sr_seed=3, scale_mode="rceil"),
         OperandSpec(hadamard_size=64, scale_mode="floor"), {}),
        ((40, 200), OperandSpec(hadamard_size=32), OperandSpec(hadamard_size=32, signs_seed=4),
         dict(block_r=32, block_c=128)),
    ],
)
def test_packed_rows_equal_one_orientation_calls(shape, cols, rows, tile):
    """``rows_form="packed"``: orientation B in the packed MXFP4 form (what the forward saves of
    x) equals the one-orientation packed kernel (itself equal to the reference), codes and scale
    bytes; orientation A equals the e4m3 call. Special values included."""
    x = make(shape, seed=sum(shape) + 1)
    x[3, 7] = float("nan")
    x[5, :] = 0.0
    x[:, 11] = float("-inf")
    a, b = quantize_both(x, cols, rows, rows_form="packed", **tile)
    assert_same(a, quantize_operand_triton(x, 1, cols, e4m3=True, packed=False))
    want = quantize_operand_triton(x, 0, rows)["mx"]
    assert torch.equal(b["mx"].codes, want.codes) and torch.equal(b["mx"].scale_e8m0, want.scale_e8m0)
    assert (b["mx"].shape, b["mx"].dim, b["mx"].block_size) == (want.shape, want.dim, want.block_size)


@pytest.mark.parametrize("shape", [(0, 40), (40, 0), (0, 0)])
def test_empty_operands(shape):
    x = torch.zeros(shape, dtype=torch.bfloat16, device=DEVICE)
    iht = OperandSpec(hadamard_size=32)
    a, b = quantize_both(x, iht, iht)
    want_a, want_b = separately(x, iht, iht)
    for got, want in ((a, want_a), (b, want_b)):
        assert got["e4m3"].shape == want["e4m3"].shape
        assert torch.equal(got["row_scale"], want["row_scale"])


def test_bad_arguments():
    """Its own arguments and the kernels' limit on the numerics (the specs check the rest)."""
    x = make((64, 64))
    plain = OperandSpec()
    with pytest.raises(ValueError, match="2-D"):
        quantize_both(x[0], plain, plain)
    with pytest.raises(ValueError, match="block_c must be a power of two and a multiple of 64"):
        quantize_both(x, OperandSpec(hadamard_size=64), plain, block_c=32)
    with pytest.raises(ValueError, match="block_r"):
        quantize_both(x, plain, plain, block_r=96)
    with pytest.raises(ValueError, match="MX blocks of 32, got block_size=16"):
        quantize_both(x, OperandSpec(block_size=16), plain)
    with pytest.raises(ValueError, match="take an OperandSpec, got dict"):
        quantize_both(x, plain, dict(hadamard_size=32))
    with pytest.raises(ValueError, match="rows_form must be 'e4m3' or 'packed'"):
        quantize_both(x, plain, plain, rows_form="fp8")


class _EmulatedHopperSeparate(EmulatedHopper):
    quantize_both = None  # the backward quantizes g twice, as without the fused kernel
    quantize_and_pack = None  # and the forward x twice


@pytest.mark.parametrize("recipe,modes", [
    ("adahop_lv2", {"fprop": "iht", "dgrad": "iht+oe_left", "wgrad": "iht+oe_right"}),
    ("tseng", None),
])
def test_layer_same_with_and_without_fusion(monkeypatch, layer_on_backend, recipe, modes):
    """The layer's output and gradients are the same bits whether x's two quantizations (forward)
    and g's two (backward) come from one kernel each or from two calls (and the fused kernels are
    what the layer calls). With outlier extraction the fused kernels' norms pick the slices
    (no tie within float32 rounding here, so the same slices)."""
    T, K, N = 64, 64, 96
    x, g = make((T, K), seed=1), make((T, N), seed=3)
    w = make((N, K), seed=2).float() * 0.1
    calls = []
    for name in ("quantize_both", "quantize_and_pack"):
        real = getattr(HopperFP8Backend, name)

        def counting(self, *args, _real=real, _name=name, **kwargs):
            calls.append((_name, tuple(sorted(k for k, v in kwargs.items() if v is not None and v is not False))))
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(EmulatedHopper, name, counting)
    monkeypatch.setattr(EmulatedHopper, "FUSED_X_MIN_K", 0)  # the fused x kernel at this small K too
    outs = [layer_on_backend(backend, recipe, x, w, g, modes)
            for backend in (EmulatedHopper(), _EmulatedHopperSeparate())]
    # with OE (lv2: dgrad OE-left, wgrad OE-right) the fused kernels also sum the norms it ranks;
    # every call gets the bounds on x's rows and g's rows and columns (layer.bounds)
    asked = [("quantize_and_pack", ("col_norms", "row_bound")), ("quantize_both", ("bounds", "row_norms"))] \
        if modes else [("quantize_and_pack", ("row_bound",)), ("quantize_both", ("bounds",))]
    assert sorted(calls) == asked
    for ref, got in zip(outs[1], outs[0]):
        assert torch.equal(ref, got)
    assert torch.isfinite(outs[0][2]).all()


def test_quantize_and_pack_takes_two_calls_below_the_fused_size(monkeypatch):
    """Below ``FUSED_X_MIN_K`` columns x is quantized by two one-orientation calls (faster
    there, measured), above by the fused kernel: the same bits."""
    import adahop.kernels.quantize_both as qb

    x = make((64, 96), seed=4)
    spec = OperandSpec(hadamard_size=32)
    launched = []
    real = qb.quantize_both
    monkeypatch.setattr(qb, "quantize_both", lambda *a, **k: launched.append(1) or real(*a, **k))
    backend = HopperFP8Backend()
    assert x.shape[1] < backend.FUSED_X_MIN_K
    a2, b2, n2 = backend.quantize_and_pack(x, spec, spec, col_norms=True)
    assert not launched
    monkeypatch.setattr(HopperFP8Backend, "FUSED_X_MIN_K", 32)
    a1, b1, n1 = backend.quantize_and_pack(x, spec, spec, col_norms=True)
    assert launched == [1]
    assert torch.equal(a1.e4m3.view(torch.uint8), a2.e4m3.view(torch.uint8))
    assert torch.equal(a1.row_scale, a2.row_scale)
    assert torch.equal(b1.codes, b2.codes) and torch.equal(b1.scale_e8m0, b2.scale_e8m0)
    # the column norms: the reference's from the two calls, summed by the kernel when fused
    assert torch.equal(n2, outer_norms(x, 1))
    torch.testing.assert_close(n1, n2, rtol=1e-6, atol=0)
    assert backend.quantize_and_pack(x, spec, spec)[2] is None


@pytest.mark.parametrize("rows_form", ["e4m3", "packed"])
def test_norms_from_the_first_pass(rows_form):
    """Row and column norms summed in PHASE 1 equal ``ops.outliers.outer_norms`` up to the order
    of the additions, with tiles that split both dims (partial sums added by torch), and leave
    the quantized outputs unchanged."""
    x = make((150, 200), seed=11)
    x[7] *= 1000  # a row and a column that outlier extraction picks
    x[:, 33] *= 1000
    cols, rows = OperandSpec(hadamard_size=32, rounding="sr", sr_seed=2), OperandSpec(hadamard_size=32)
    a, b = quantize_both(x, cols, rows, rows_form=rows_form, row_norms=True, col_norms=True, block_r=32, block_c=64)
    torch.testing.assert_close(a["norms"], outer_norms(x, 0), rtol=1e-6, atol=0)
    torch.testing.assert_close(b["norms"], outer_norms(x, 1), rtol=1e-6, atol=0)
    assert torch.equal(largest_k(a["norms"], 8), topk_outer(x, 0, 8)) and 7 in largest_k(a["norms"], 8)
    assert torch.equal(largest_k(b["norms"], 8), topk_outer(x, 1, 8)) and 33 in largest_k(b["norms"], 8)
    plain_a, plain_b = quantize_both(x, cols, rows, rows_form=rows_form, block_r=32, block_c=64)
    assert "norms" not in plain_a and "norms" not in plain_b
    assert_same(a, plain_a)
    if rows_form == "e4m3":
        assert_same(b, plain_b)
    else:
        assert torch.equal(b["mx"].codes, plain_b["mx"].codes)
        assert torch.equal(b["mx"].scale_e8m0, plain_b["mx"].scale_e8m0)
    empty_a, empty_b = quantize_both(x[:0], cols, rows, rows_form=rows_form, row_norms=True, col_norms=True)
    assert empty_a["norms"].shape == (0,) and torch.equal(empty_b["norms"], torch.zeros(200, device=x.device))


def test_backend_quantize_both_row_norms():
    x = make((96, 128), seed=12)
    spec = OperandSpec(hadamard_size=32, rounding="sr", sr_seed=4)
    backend = HopperFP8Backend()
    a, b, norms = backend.quantize_both(x, spec, spec, row_norms=True)
    torch.testing.assert_close(norms, outer_norms(x, 0), rtol=1e-6, atol=0)
    a0, b0, none = backend.quantize_both(x, spec, spec)
    assert none is None
    assert torch.equal(a.e4m3.view(torch.uint8), a0.e4m3.view(torch.uint8))
    assert torch.equal(b.e4m3.view(torch.uint8), b0.e4m3.view(torch.uint8))


@pytest.mark.parametrize("with_b", [True, False])
def test_row_maxima_of_partials(with_b):
    """The reduction between the two phases, over more partials than one step loads (16) and
    row counts that are not multiples of its 128 rows: each row's largest byte 0."""
    from adahop.kernels.quantize_both import _row_maxima

    g = torch.Generator().manual_seed(3)
    parta = torch.randint(0, 256, (37, 300, 16), generator=g, dtype=torch.uint8).to(DEVICE)
    partb = torch.randint(0, 256, (5, 130, 16), generator=g, dtype=torch.uint8).to(DEVICE)
    partb[:, 7, 0] = 0  # a row whose every partial is the smallest byte
    emaxa = torch.full((300,), 7, dtype=torch.uint8, device=DEVICE)
    emaxb = torch.full((130,), 7, dtype=torch.uint8, device=DEVICE)
    _row_maxima(parta, emaxa, partb if with_b else None, emaxb if with_b else None)
    assert torch.equal(emaxa, parta[:, :, 0].amax(0))
    if with_b:
        assert torch.equal(emaxb, partb[:, :, 0].amax(0))
        assert emaxb[7] == 0
    else:
        assert (emaxb == 7).all()  # untouched
