"""MXFP4 encoder/decoder (adahop.formats.mxfp4) against its documented contract and against two
independent references: ml_dtypes (E2M1 element rounding) and torchao 0.18 ``to_mx`` (scales and
packed codes, bit for bit, in every scale mode); stochastic rounding's unbiasedness to 0.1% of a
grid step.

ml_dtypes and torchao are in the ``[test]`` extra. Without them the reference tests FAIL, so that
a CI without them cannot pass silently; set ``ADAHOP_ALLOW_MISSING_REFERENCES=1`` to have them
skipped instead (e.g. on a platform torchao does not support).
"""

from __future__ import annotations

import importlib
import math
import os
import sys

import numpy as np
import pytest
import torch

from adahop.formats.mxfp4 import (
    MXFP4Tensor,
    dequantize_mxfp4,
    fake_quantize_mxfp4,
    quantize_mxfp4,
    unpack_codes,
)
from adahop.formats.rng import sr_bits

MODES = ("floor", "even", "ceil", "rceil")
GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # written out, not imported
F32_MAX = float(torch.finfo(torch.float32).max)


ALLOW_MISSING_REFERENCES = "ADAHOP_ALLOW_MISSING_REFERENCES"


# ----------------------------------------------------------------------------- helpers


def independent_reference(module: str):
    """Import ``module`` (an independent reference of the bit-exact tests). Missing, it fails the
    test, or skips it where ADAHOP_ALLOW_MISSING_REFERENCES=1 (the module doc)."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        if os.environ.get(ALLOW_MISSING_REFERENCES) == "1":
            pytest.skip(f"{module} is not installed and {ALLOW_MISSING_REFERENCES}=1")
        pytest.fail(
            f"{module} is not installed ({err}); it is an independent reference of the bit-exact "
            f"tests: pip install -e '.[test]', or set {ALLOW_MISSING_REFERENCES}=1 to skip them",
            pytrace=False,
        )


def codes_of(q: MXFP4Tensor) -> torch.Tensor:
    return unpack_codes(q.codes)


def block_with(values, pad_value=6.0, n=32):
    """A single 32-element block holding ``values`` followed by ``pad_value`` (which sets amax)."""
    vals = list(values) + [pad_value] * (n - len(values))
    return torch.tensor(vals, dtype=torch.float32)


def expected_bytes_from_amax(amax: float):
    """Hand/independently derived (floor, even, ceil, rceil) bytes for a positive normal float32 amax,
    with pure-Python arithmetic (math.frexp) rather than the code's bit tricks."""
    a = float(np.float32(amax))
    m, ex = math.frexp(a)  # a = m * 2**ex, m in [0.5, 1)
    E = ex - 1  # a = (2m) * 2**E, 2m in [1, 2)
    floor = E - 2
    # even: round the significand 2m to 1 fractional bit (ties up, like adding half an ulp)
    sig = 2 * m
    even = (E + 1 if sig >= 1.75 else E) - 2
    ceil = (E if sig == 1.0 else E + 1) - 2
    q = float(np.float32(a) / np.float32(6.0))
    mq, exq = math.frexp(q)
    rceil = exq - 1 if mq == 0.5 else exq
    clamp = lambda e: max(-127, min(127, e)) + 127  # noqa: E731
    return {"floor": clamp(floor), "even": clamp(even), "ceil": clamp(ceil), "rceil": clamp(rceil)}


def random_blocks(gen: torch.Generator, rows: int, nblocks: int, lo_exp=-60, hi_exp=60, outliers=True):
    """Random tensor [rows, nblocks*32] whose blocks span many binades, with planted outliers and
    exact grid ties. Every block has amax >= 2**-120 (away from torchao's tiny-scale difference)."""
    x = torch.randn(rows, nblocks, 32, generator=gen)
    kind = torch.randint(0, 4, (rows, nblocks, 1), generator=gen)
    # some blocks uniform, some heavy-tailed, some with exact E2M1 tie values
    unif = torch.rand(rows, nblocks, 32, generator=gen) * 2 - 1
    heavy = torch.randn(rows, nblocks, 32, generator=gen) ** 3
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.75, -1.25, -1.75,
                         -2.5, -3.5, -5.0, -6.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, -0.5, -1.0,
                         -1.5, -2.0, -3.0, -4.0, 0.1, -0.1, 0.0, -0.0])
    tie_blk = ties[torch.randperm(32, generator=gen)].expand(rows, nblocks, 32)
    x = torch.where(kind == 1, unif, x)
    x = torch.where(kind == 2, heavy, x)
    x = torch.where(kind == 3, tie_blk, x)
    e = torch.randint(lo_exp, hi_exp + 1, (rows, nblocks, 1), generator=gen).to(torch.float32)
    x = x * torch.exp2(e)
    if outliers:
        mask = torch.rand(rows, nblocks, 32, generator=gen) < 0.01
        x = torch.where(mask, x * 1000.0, x)
    # guarantee amax >= 2**-120 in every block
    x[..., 0] = torch.where(x.abs().amax(-1) < 2.0**-110, torch.exp2(e[..., 0]), x[..., 0])
    return x.reshape(rows, nblocks * 32)


# ----------------------------------------------------------------------------- element grid


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_every_grid_value_is_exact(sign):
    vals = [sign * v for v in GRID]
    x = block_with(vals, pad_value=6.0)
    q = quantize_mxfp4(x)  # even: amax 6 -> scale 1
    assert q.scale_e8m0.tolist() == [127]
    codes = codes_of(q)[: len(vals)]
    sign_bit = 8 if sign < 0 else 0
    assert codes.tolist() == [i | sign_bit for i in range(8)]
    deq = dequantize_mxfp4(q)
    assert torch.equal(deq, x)


@pytest.mark.parametrize("mode", ["floor", "even", "rceil"])  # all give scale 1 for amax 6
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_ties_round_to_even(mode, sign):
    ties = {0.25: 0.0, 0.75: 1.0, 1.25: 1.0, 1.75: 2.0, 2.5: 2.0, 3.5: 4.0, 5.0: 4.0}
    x = block_with([sign * t for t in ties], pad_value=6.0)
    q = quantize_mxfp4(x, scale_mode=mode)
    assert q.scale_e8m0.tolist() == [127]
    deq = dequantize_mxfp4(q)[: len(ties)]
    expected = torch.tensor([sign * v for v in ties.values()])
    assert torch.equal(deq, expected)
    # the sign is kept even when the magnitude rounds to 0 (0.25 -> code 0 / 0x8)
    assert int(codes_of(q)[0]) == (8 if sign < 0 else 0)


def test_values_just_off_ties_round_to_nearest():
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    lows = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0]
    highs = [0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    above = [float(np.nextafter(np.float32(t), np.float32(10))) for t in ties]
    below = [float(np.nextafter(np.float32(t), np.float32(-10))) for t in ties]
    deq_a = dequantize_mxfp4(quantize_mxfp4(block_with(above)))[:7]
    deq_b = dequantize_mxfp4(quantize_mxfp4(block_with(below)))[:7]
    assert deq_a.tolist() == highs
    assert deq_b.tolist() == lows


@pytest.mark.parametrize("mag", [6.5, 7.0, 7.99, 1e3])
def test_floor_mode_saturates_above_6(mag):
    # floor: e = floor(log2 amax) - 2 -> for amax in [4, 8) the scale is 1, so |x| > 6 clips to 6
    x = block_with([mag, -mag, 6.0, 3.0], pad_value=0.0)
    q = quantize_mxfp4(x, scale_mode="floor")
    scale = 2.0 ** (int(q.scale_e8m0[0]) - 127)
    deq = dequantize_mxfp4(q)
    if mag < 8:
        assert scale == 1.0
        assert deq[0].item() == 6.0 and deq[1].item() == -6.0
        assert codes_of(q)[:2].tolist() == [0x7, 0xF]
    else:
        # amax = 1000 -> e = 9 - 2 = 7, 1000 / 128 = 7.8 -> clips to 6 * 128
        assert scale == 128.0
        assert deq[0].item() == 768.0 and deq[1].item() == -768.0
    assert deq.abs().max().item() <= 6.0 * scale


@pytest.mark.parametrize("mode", ["even", "ceil", "rceil"])
def test_no_saturation_for_ceil_and_rceil_modes(mode):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(64, 256, generator=gen) * 10
    q = quantize_mxfp4(x, scale_mode=mode)
    scales = 2.0 ** (q.scale_e8m0.to(torch.float64) - 127)
    amax = x.reshape(64, 8, 32).abs().amax(-1).to(torch.float64)
    if mode in ("ceil", "rceil"):
        assert bool((amax <= 6 * scales).all())
    else:  # even may clip up to 1.75 * 2**E -> at most 7/6 of the max
        assert bool((amax <= 7 * scales).all())


def test_signed_zeros():
    x = block_with([0.0, -0.0, 0.1, -0.1, 1e-30, -1e-30], pad_value=6.0)
    codes = codes_of(quantize_mxfp4(x))[:6].tolist()
    assert codes == [0x0, 0x8, 0x0, 0x8, 0x0, 0x8]
    deq = dequantize_mxfp4(quantize_mxfp4(x))[:6]
    assert deq.tolist() == [0.0] * 6
    assert torch.signbit(deq).tolist() == [False, True, False, True, False, True]


def test_all_zero_block_gets_byte0_and_zero_codes():
    x = torch.zeros(3, 96)
    x[1, 32:64] = torch.linspace(-3, 3, 32)
    q = quantize_mxfp4(x)
    assert q.scale_e8m0[0].tolist() == [0, 0, 0]
    assert q.scale_e8m0[1].tolist()[0] == 0 and q.scale_e8m0[1].tolist()[2] == 0
    assert q.scale_e8m0[1, 1].item() != 0
    c = codes_of(q)
    assert int(c[0].count_nonzero()) == 0 and int(c[2].count_nonzero()) == 0
    assert int(c[1, :32].count_nonzero()) == 0 and int(c[1, 64:].count_nonzero()) == 0
    deq = dequantize_mxfp4(q)
    assert torch.equal(deq[0], torch.zeros(96)) and torch.equal(deq[2], torch.zeros(96))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_block_gets_nan_scale(mode, bad):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 96, generator=gen)
    x[1, 40] = bad
    x[2, 95] = bad
    x[0, 0] = float("nan")
    q = quantize_mxfp4(x, scale_mode=mode)
    s = q.scale_e8m0
    assert s[1, 1].item() == 0xFF and s[2, 2].item() == 0xFF and s[0, 0].item() == 0xFF
    c = codes_of(q).reshape(3, 3, 32)
    for r, b in [(1, 1), (2, 2), (0, 0)]:
        assert int(c[r, b].count_nonzero()) == 0
    deq = dequantize_mxfp4(q)
    assert bool(deq[1, 32:64].isnan().all())
    assert bool(deq[2, 64:96].isnan().all())
    assert bool(deq[0, 0:32].isnan().all())
    # all other blocks unaffected: same as quantizing them alone, finite
    clean = x.clone()
    clean[1, 32:64] = 0
    clean[2, 64:96] = 0
    clean[0, 0:32] = 0
    ref = dequantize_mxfp4(quantize_mxfp4(clean, scale_mode=mode))
    bad_mask = torch.zeros(3, 96, dtype=torch.bool)
    bad_mask[1, 32:64] = bad_mask[2, 64:96] = bad_mask[0, 0:32] = True
    assert torch.equal(deq[~bad_mask], ref[~bad_mask])
    assert bool(torch.isfinite(deq[~bad_mask]).all())
    other = torch.ones(9, dtype=torch.bool)
    other[[4, 8, 0]] = False  # flat indices of (1,1), (2,2), (0,0)
    assert bool((s.flatten()[other] != 0xFF).all())


# ----------------------------------------------------------------------------- scale exponent


@pytest.mark.parametrize(
    "amax, floor, even, ceil, rceil",
    [
        # hand-computed: 6 = 1.5*2**2; 7 = 1.75*2**2; 4 = 2**2; 1 = 2**0; 3 = 1.5*2**1;
        # 12.5 = 1.5625*2**3; 1.7 rounds to 1.5 (no carry) in `even`
        (6.0, 127, 127, 128, 127),
        (7.0, 127, 128, 128, 128),
        (4.0, 127, 127, 127, 127),
        (1.0, 125, 125, 125, 125),
        (3.0, 126, 126, 127, 126),
        (12.5, 128, 128, 129, 129),
        (1.7, 125, 125, 126, 126),
        (1.75, 125, 126, 126, 126),
        (1.75 * 2.0**40, 165, 166, 166, 166),
        (1.75 * 2.0**-40, 85, 86, 86, 86),
        (6.0 * 2.0**-100, 27, 27, 28, 27),
        (2.0**-100, 25, 25, 25, 25),
        # float32 max = (2 - 2**-23) * 2**127: even carries into the next binade
        (F32_MAX, 252, 253, 253, 253),
        (2.0**127, 252, 252, 252, 252),
        # subnormal amax: everything clamps to byte 0 (e = -127)
        (2.0**-127, 0, 0, 0, 0),
        (2.0**-149, 0, 0, 0, 0),
        (2.0**-125, 0, 0, 0, 0),
        # rceil near the bottom: amax / 6 is exactly the subnormal 2**-127 (e = -127), or just
        # above it (e = -126)
        (6.0 * 2.0**-127, 0, 0, 1, 0),
        (6.0 * 2.0**-127 * (1 + 2.0**-20), 0, 0, 1, 1),
    ],
)
def test_scale_byte_hand_computed(amax, floor, even, ceil, rceil):
    x = torch.zeros(32)
    x[5] = amax
    x[6] = -amax / 2
    got = {m: quantize_mxfp4(x, scale_mode=m).scale_e8m0.item() for m in MODES}
    assert got == {"floor": floor, "even": even, "ceil": ceil, "rceil": rceil}
    # negative amax gives the same scale
    got_neg = {m: quantize_mxfp4(-x, scale_mode=m).scale_e8m0.item() for m in MODES}
    assert got_neg == got


def test_scale_byte_matches_frexp_derivation():
    gen = torch.Generator().manual_seed(11)
    # amax values over the whole normal range, including exact powers of two and ties
    e = torch.randint(-120, 125, (400,), generator=gen).to(torch.float64)
    m = torch.rand(400, generator=gen, dtype=torch.float64) + 1.0
    m[:50] = 1.0
    m[50:100] = 1.5
    m[100:150] = 1.75
    amax = (m * torch.exp2(e)).to(torch.float32)
    x = torch.zeros(400, 32)
    x[:, 7] = amax
    for mode in MODES:
        got = quantize_mxfp4(x, scale_mode=mode).scale_e8m0[:, 0].tolist()
        exp = [expected_bytes_from_amax(a)[mode] for a in amax.tolist()]
        assert got == exp, mode


@pytest.mark.parametrize("mode", MODES)
def test_e8m0_extremes_do_not_crash(mode):
    gen = torch.Generator().manual_seed(5)
    tiny = torch.randn(4, 64, generator=gen) * 2.0**-127
    tiny[0, :32] = 2.0**-149  # smallest subnormal
    tiny[1, 3] = 2.0**-126
    huge = torch.randn(4, 64, generator=gen) * 1e37
    huge[0, 0] = F32_MAX
    huge[1, 33] = -F32_MAX
    huge[2, 5] = 3.0e38
    for x in (tiny, huge):
        q = quantize_mxfp4(x, scale_mode=mode)
        assert q.scale_e8m0.dtype == torch.uint8
        assert int(q.scale_e8m0.max()) <= 254
        deq = dequantize_mxfp4(q)
        assert not bool(deq.isnan().any())
    # tiny blocks: byte 0, the error is below the smallest normal float32
    q = quantize_mxfp4(tiny, scale_mode=mode)
    assert q.scale_e8m0.tolist() == [[0, 0]] * 4
    assert float((dequantize_mxfp4(q) - tiny).abs().max()) < 2.0**-126
    # floor never rounds above amax: huge blocks decode finite and within float32
    if mode == "floor":
        deq = dequantize_mxfp4(quantize_mxfp4(huge, scale_mode=mode))
        assert bool(torch.isfinite(deq).all())


def test_subnormal_amax_block_decodes_exactly_when_representable():
    # amax = 2**-125 with byte 0 (2**-127): 2**-125 = 4 * 2**-127 is exactly code 6
    x = torch.zeros(32)
    x[0] = 2.0**-125
    x[1] = -(2.0**-126)
    q = quantize_mxfp4(x, scale_mode="floor")
    assert q.scale_e8m0.item() == 0
    assert codes_of(q)[:2].tolist() == [0x6, 0xC]
    assert torch.equal(dequantize_mxfp4(q), x)


# ----------------------------------------------------------------------------- layout


def test_packing_low_nibble_is_even_element():
    x = block_with([0.5, 6.0, -1.0, 3.0, -6.0, -0.0], pad_value=0.0)
    q = quantize_mxfp4(x, scale_mode="floor")
    assert q.scale_e8m0.item() == 127
    # codes: 0.5->1, 6->7, -1->0xA, 3->5, -6->0xF, -0->0x8
    assert q.codes[:3].tolist() == [0x71, 0x5A, 0x8F]
    assert q.codes.dtype == torch.uint8 and q.codes.shape == (16,)


def test_unpack_codes_round_trip():
    gen = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (5, 7, 64), generator=gen, dtype=torch.uint8)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    assert torch.equal(unpack_codes(packed), codes)
    # and the quantizer's packing agrees with an independent nibble split
    x = torch.randn(6, 64, generator=gen)
    q = quantize_mxfp4(x)
    lo = q.codes & 0xF
    hi = q.codes >> 4
    c = unpack_codes(q.codes)
    assert torch.equal(c[..., 0::2], lo) and torch.equal(c[..., 1::2], hi)


@pytest.mark.parametrize("n", [1, 5, 31, 33, 63, 100])
def test_padding(n):
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(3, n, generator=gen) + 0.1
    q = quantize_mxfp4(x)
    padded = -(-n // 32) * 32
    assert q.codes.shape == (3, padded // 2)
    assert q.scale_e8m0.shape == (3, padded // 32)
    assert q.padded_size == padded
    assert q.shape == x.shape and q.dim == 1
    deq = dequantize_mxfp4(q)
    assert deq.shape == x.shape and deq.dtype == torch.float32
    full = dequantize_mxfp4(q, keep_padding=True)
    assert full.shape == (3, padded)
    assert torch.equal(full[:, n:], torch.zeros(3, padded - n))
    assert int(codes_of(q)[:, n:].count_nonzero()) == 0
    assert torch.equal(full[:, :n], deq)
    # same as quantizing the explicitly zero-padded tensor
    xp = torch.nn.functional.pad(x, (0, padded - n))
    qp = quantize_mxfp4(xp)
    assert torch.equal(qp.codes, q.codes) and torch.equal(qp.scale_e8m0, q.scale_e8m0)


def test_padding_along_dim0():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(45, 6, generator=gen)
    q = quantize_mxfp4(x, dim=0)
    assert q.codes.shape == (6, 32) and q.scale_e8m0.shape == (6, 2)
    deq = dequantize_mxfp4(q)
    assert deq.shape == (45, 6)
    assert torch.equal(dequantize_mxfp4(q, keep_padding=True)[:, :45], deq.t())


@pytest.mark.parametrize("rounding", ["rne", "sr"])
def test_quantize_along_dim0_of_2d(rounding):
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(96, 40, generator=gen) * 3
    q0 = quantize_mxfp4(x, dim=0, rounding=rounding, seed=9)
    qt = quantize_mxfp4(x.movedim(0, -1), dim=-1, rounding=rounding, seed=9)
    assert q0.dim == 0
    assert torch.equal(q0.codes, qt.codes) and torch.equal(q0.scale_e8m0, qt.scale_e8m0)
    assert q0.codes.shape == (40, 48) and q0.scale_e8m0.shape == (40, 3)
    assert q0.codes.is_contiguous() and q0.scale_e8m0.is_contiguous()
    d0 = dequantize_mxfp4(q0)
    assert d0.shape == x.shape
    assert torch.equal(d0, dequantize_mxfp4(qt).movedim(-1, 0))
    # negative dim is normalised
    qn = quantize_mxfp4(x, dim=-2, rounding=rounding, seed=9)
    assert qn.dim == 0 and torch.equal(qn.codes, q0.codes)


@pytest.mark.parametrize("rounding", ["rne", "sr"])
def test_quantize_along_middle_dim_of_3d(rounding):
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(3, 70, 5, generator=gen)
    q = quantize_mxfp4(x, dim=1, rounding=rounding, seed=123)
    ref = quantize_mxfp4(x.movedim(1, -1), rounding=rounding, seed=123)
    assert q.codes.shape == (3, 5, 48) and q.scale_e8m0.shape == (3, 5, 3)
    assert torch.equal(q.codes, ref.codes) and torch.equal(q.scale_e8m0, ref.scale_e8m0)
    d = dequantize_mxfp4(q)
    assert d.shape == x.shape
    assert torch.equal(d, dequantize_mxfp4(ref).movedim(-1, 1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("mode", MODES)
def test_input_dtypes(dtype, mode):
    gen = torch.Generator().manual_seed(8)
    x = (torch.randn(8, 96, generator=gen) * 4).to(dtype)
    q = quantize_mxfp4(x, scale_mode=mode)
    ref = quantize_mxfp4(x.to(torch.float32), scale_mode=mode)
    assert torch.equal(q.codes, ref.codes) and torch.equal(q.scale_e8m0, ref.scale_e8m0)
    deq = dequantize_mxfp4(q)
    assert deq.dtype == torch.float32 and deq.shape == x.shape


def test_float64_is_rounded_to_float32_first():
    # 0.25 + 1e-12 is above the 0.25 tie in float64 but rounds to exactly 0.25 in float32
    x = torch.tensor([0.25 + 1e-12, 1.25 + 1e-12] + [6.0] * 30, dtype=torch.float64)
    q = quantize_mxfp4(x)
    assert codes_of(q)[:2].tolist() == [0x0, 0x2]  # ties to even: 0 and 1.0


def test_empty_tensors():
    for shape, dim, cshape, sshape in [
        ((0,), 0, (0,), (0,)),
        ((4, 0), 1, (4, 0), (4, 0)),
        ((4, 0), 0, (0, 16), (0, 1)),
        ((0, 32), 1, (0, 16), (0, 1)),
        ((0, 32), 0, (32, 0), (32, 0)),
        ((3, 0, 5), 1, (3, 5, 0), (3, 5, 0)),
    ]:
        x = torch.zeros(shape)
        q = quantize_mxfp4(x, dim=dim)
        assert tuple(q.codes.shape) == cshape, (shape, dim)
        assert tuple(q.scale_e8m0.shape) == sshape, (shape, dim)
        d = dequantize_mxfp4(q)
        assert d.shape == x.shape and d.dtype == torch.float32
        assert fake_quantize_mxfp4(x, dim=dim, rounding="sr", seed=1).shape == x.shape


@pytest.mark.parametrize("mode", MODES)
def test_non_contiguous_inputs(mode):
    gen = torch.Generator().manual_seed(10)
    base = torch.randn(64, 128, generator=gen) * 5
    views = [base.t(), base[:, ::2], base[::2, 1::2], base.t()[3:, :]]
    for v in views:
        assert not v.is_contiguous()
        for dim in (0, 1):
            for rounding in ("rne", "sr"):
                q = quantize_mxfp4(v, dim=dim, scale_mode=mode, rounding=rounding, seed=5)
                r = quantize_mxfp4(v.contiguous(), dim=dim, scale_mode=mode, rounding=rounding, seed=5)
                assert torch.equal(q.codes, r.codes) and torch.equal(q.scale_e8m0, r.scale_e8m0)


def test_mxfp4tensor_properties():
    x = torch.randn(10, 50)
    q = quantize_mxfp4(x, dim=-1)
    assert q.dim == 1 and q.block_size == 32 and q.shape == torch.Size([10, 50])
    assert q.padded_size == 64
    assert q.nbytes == 10 * 32 + 10 * 2


def test_other_block_sizes():
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(4, 64, generator=gen)
    for bs in (2, 16, 64):
        q = quantize_mxfp4(x, block_size=bs)
        assert q.scale_e8m0.shape == (4, 64 // bs) and q.block_size == bs
        amax = x.reshape(4, 64 // bs, bs).abs().amax(-1)
        exp = [[expected_bytes_from_amax(a)["even"] for a in row] for row in amax.tolist()]
        assert q.scale_e8m0.tolist() == exp


# ----------------------------------------------------------------------------- references


@pytest.mark.parametrize("mode", MODES)
def test_element_rounding_matches_ml_dtypes(mode):
    ml_dtypes = independent_reference("ml_dtypes")
    gen = torch.Generator().manual_seed(21)
    for trial in range(20):
        x = random_blocks(gen, 8, 6)
        if trial % 2:
            x = x.to(torch.bfloat16).to(torch.float32)
        q = quantize_mxfp4(x, scale_mode=mode)
        e = q.scale_e8m0.to(torch.float64) - 127
        scaled = (x.reshape(8, 6, 32).to(torch.float64) / torch.exp2(e).unsqueeze(-1)).numpy()
        ref = np.asarray(scaled, dtype=np.float32).astype(ml_dtypes.float4_e2m1fn).view(np.uint8)
        got = codes_of(q).reshape(8, 6, 32).numpy()
        np.testing.assert_array_equal(got, ref)


def _torchao():
    mx_tensor = independent_reference("torchao.prototype.mx_formats.mx_tensor")
    return mx_tensor.to_mx, mx_tensor.ScaleCalculationMode


@pytest.mark.parametrize("module", ["ml_dtypes", "torchao.prototype.mx_formats.mx_tensor"])
def test_missing_reference_fails_unless_allowed(module, monkeypatch):
    monkeypatch.setitem(sys.modules, module, None)  # import raises ImportError
    monkeypatch.delenv(ALLOW_MISSING_REFERENCES, raising=False)
    with pytest.raises(pytest.fail.Exception, match=ALLOW_MISSING_REFERENCES):
        independent_reference(module)
    monkeypatch.setenv(ALLOW_MISSING_REFERENCES, "1")
    with pytest.raises(pytest.skip.Exception):
        independent_reference(module)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", MODES)
def test_bit_exact_vs_torchao(mode, dtype):
    to_mx, SCM = _torchao()
    gen = torch.Generator().manual_seed(1000 + MODES.index(mode))
    for trial in range(60):
        rows = int(torch.randint(1, 9, (1,), generator=gen))
        nblocks = int(torch.randint(1, 7, (1,), generator=gen))
        x = random_blocks(gen, rows, nblocks, lo_exp=-90, hi_exp=90).to(dtype)
        blocks = x.float().reshape(rows, nblocks, 32)
        assert float(blocks.abs().amax(-1).min()) >= 2.0**-120
        s_ref, c_ref = to_mx(x, torch.float4_e2m1fn_x2, 32, getattr(SCM, mode.upper()))
        q = quantize_mxfp4(x, scale_mode=mode)
        assert torch.equal(q.scale_e8m0, s_ref.view(torch.uint8)), (mode, trial)
        assert torch.equal(q.codes, c_ref.view(torch.uint8)), (mode, trial)


@pytest.mark.parametrize("mode", MODES)
def test_bit_exact_vs_torchao_3d_and_extreme_binades(mode):
    to_mx, SCM = _torchao()
    gen = torch.Generator().manual_seed(77)
    x = torch.randn(3, 5, 128, generator=gen) * torch.exp2(
        torch.randint(-115, 120, (3, 5, 1), generator=gen).float()
    )
    x[0, 0, 0] = F32_MAX / 2
    x[1, 1, 1] = -3.0e37
    s_ref, c_ref = to_mx(x, torch.float4_e2m1fn_x2, 32, getattr(SCM, mode.upper()))
    q = quantize_mxfp4(x, scale_mode=mode)
    assert torch.equal(q.scale_e8m0, s_ref.view(torch.uint8))
    assert torch.equal(q.codes, c_ref.view(torch.uint8))


# ----------------------------------------------------------------------------- stochastic rounding


def _neighbours(v: np.ndarray):
    """Grid neighbours (lo, hi) of |v| in [0, 6], computed independently with searchsorted."""
    a = np.abs(v)
    idx = np.searchsorted(GRID, a, side="right") - 1
    lo = GRID[idx]
    hi = GRID[np.minimum(idx + 1, 7)]
    hi = np.where(lo == a, lo, hi)
    return lo, hi


def test_sr_reproducible_and_seed_dependent():
    gen = torch.Generator().manual_seed(30)
    x = torch.randn(16, 256, generator=gen)
    a = quantize_mxfp4(x, rounding="sr", seed=42)
    b = quantize_mxfp4(x, rounding="sr", seed=42)
    c = quantize_mxfp4(x, rounding="sr", seed=43)
    assert torch.equal(a.codes, b.codes)
    assert not torch.equal(a.codes, c.codes)
    assert torch.equal(a.scale_e8m0, c.scale_e8m0)
    # differs from RNE somewhere (SR is not RNE)
    r = quantize_mxfp4(x)
    assert not torch.equal(a.codes, r.codes)
    # without a seed: torch's default generator decides
    torch.manual_seed(1234)
    d = quantize_mxfp4(x, rounding="sr")
    torch.manual_seed(1234)
    e = quantize_mxfp4(x, rounding="sr")
    assert torch.equal(d.codes, e.codes)
    # seed boundaries are accepted
    quantize_mxfp4(x, rounding="sr", seed=0)
    quantize_mxfp4(x, rounding="sr", seed=2**32 - 1)


@pytest.mark.parametrize("mode", MODES)
def test_sr_rounds_to_a_neighbour_only(mode):
    gen = torch.Generator().manual_seed(31)
    x = torch.randn(32, 128, generator=gen) * 2.0
    for seed in range(5):
        q = quantize_mxfp4(x, rounding="sr", seed=seed, scale_mode=mode)
        e = q.scale_e8m0.to(torch.float64) - 127
        scale = torch.exp2(e).repeat_interleave(32, dim=-1).numpy()
        v = np.clip(x.double().numpy() / scale, -6, 6)
        lo, hi = _neighbours(v)
        got = dequantize_mxfp4(q).double().numpy() / scale
        ok = (np.abs(got) == lo) | (np.abs(got) == hi)
        assert ok.all()
        assert (np.sign(got) * np.sign(v) >= 0).all()


def test_sr_decision_follows_documented_counter_bits():
    """|v| / s to 16 fractional bits (ties to even) plus the element's 16 random bits, floored:
    s = the grid spacing, bits = sr_bits(flat index, seed) (the module doc's definition)."""
    gen = torch.Generator().manual_seed(32)
    x = torch.randn(5, 70, 3, generator=gen) * 3  # quantized along dim 1 (padded to 96)
    x[0, :8, 0] = torch.tensor([1.75, 1.75 + 2**-18, 0.5 + 3 * 2**-18, 2.5, 5.0, 6.0, 3.999999, 0.0]) * 64
    seed = 987654321
    q = quantize_mxfp4(x, dim=1, rounding="sr", seed=seed, scale_mode="rceil")
    xl = torch.nn.functional.pad(x.movedim(1, -1), (0, 26))  # [5, 3, 96]
    e = q.scale_e8m0.to(torch.float64) - 127
    v = np.abs(xl.double().numpy() / torch.exp2(e).repeat_interleave(32, -1).numpy())
    s = np.where(v < 2, 0.5, np.where(v < 4, 1.0, 2.0))
    fixed = np.round(v / s * 2**16).astype(np.int64)  # numpy rounds half to even
    bits = sr_bits(torch.arange(5 * 3 * 96).reshape(5, 3, 96), seed).numpy()
    mag = ((fixed + bits) >> 16) * s
    got = dequantize_mxfp4(q, keep_padding=True).double().numpy() / torch.exp2(e).repeat_interleave(32, -1).numpy()
    np.testing.assert_array_equal(np.abs(got), mag)


def test_sr_exact_on_grid_values():
    x = torch.tensor([float(v) * s for v in GRID for s in (1, -1)] * 2) * 4.0
    for seed in range(10):
        q = quantize_mxfp4(x, rounding="sr", seed=seed, scale_mode="rceil")
        assert torch.equal(dequantize_mxfp4(q), x)


# SR unbiasedness, statistically. A value at fraction p of the way from its lower grid neighbour to
# the upper one (both in grid steps: 0.5 below 2, 1 below 4, 2 above) goes up with probability p,
# so "up - p" has mean 0 and variance p (1 - p). Over n values with p uniform in [0, 1),
# Z = sum(up - p) / sqrt(sum p (1 - p)) is standard normal, and a bias of b grid steps shifts it
# by b n / sqrt(n / 6) = b sqrt(6 n). To see b = 0.1% of a step with Z's threshold at 4 and a
# shift of at least 8 (so that a biased rounding lands past the threshold even from Z = -4, and
# an unbiased one would need a 4-sigma fluke to fail): sqrt(6 n) >= 8000, n >= 1.07e7. The
# 16-bit decision itself is biased by at most 2**-17 of a step (docs/method.md, 'Stochastic
# rounding'), which moves Z by at most 0.03 at this n.
SR_BIAS_STEPS = 1e-3  # the bias the test must be able to see, in grid steps
SR_Z_MAX = 4.0
SR_CHUNKS, SR_ROWS = 11, 2**15  # 11 x 32768 rows x 31 values = 1.12e7 draws


def _sr_draws(rounding: str, chunk: int):
    """One chunk of draws: rows of 32 values whose first is 6.0 (so rceil gives scale 1), the
    other 31 uniform magnitudes in [0, 6) with random signs, each row its own counters and each
    chunk its own seed. Returns (p, up) as float64 numpy arrays over the 31 * SR_ROWS values."""
    gen = torch.Generator().manual_seed(500 + chunk)
    x = torch.rand(SR_ROWS, 32, generator=gen) * 6.0
    x = torch.where(torch.rand(SR_ROWS, 32, generator=gen) < 0.5, -x, x)
    x[:, 0] = 6.0
    q = quantize_mxfp4(x, rounding=rounding, seed=7000 + chunk, scale_mode="rceil")
    assert bool((q.scale_e8m0 == 127).all())  # scale 1: grid units are the values themselves
    a = x[:, 1:].double().abs().numpy()
    got = dequantize_mxfp4(q)[:, 1:].double().numpy()
    assert (np.signbit(got) == np.signbit(x[:, 1:].numpy())).all()
    step = np.where(a < 2, 0.5, np.where(a < 4, 1.0, 2.0))
    lo = np.floor(a / step) * step
    up = (np.abs(got) - lo) / step
    assert np.isin(up, (0.0, 1.0)).all()  # a grid neighbour, nothing else
    return ((a - lo) / step).ravel(), up.ravel(), step.ravel()


def _z(resid: np.ndarray, var: np.ndarray) -> float:
    return float(resid.sum() / np.sqrt(var.sum()))


def test_sr_is_unbiased_to_a_tenth_of_a_percent_of_a_step():
    p, up, step = map(np.concatenate, zip(*(_sr_draws("sr", c) for c in range(SR_CHUNKS))))
    resid, var = up - p, p * (1 - p)
    n = p.size
    assert n >= 1.07e7
    shift = SR_BIAS_STEPS * n / np.sqrt(var.sum())  # what a bias of 0.1% of a step adds to Z
    assert shift >= 2 * SR_Z_MAX, shift  # the power argument above, on the realised sample
    z = _z(resid, var)
    assert abs(z) < SR_Z_MAX, z
    # the same statistic on a copy biased by 0.1% of a step, either way, fails
    assert _z(resid + SR_BIAS_STEPS, var) > SR_Z_MAX and _z(resid - SR_BIAS_STEPS, var) < -SR_Z_MAX
    # no bias hiding in one spacing of the grid, or at some fractions (16 bins of p): each of
    # these sees a bias of ~0.2% (spacings) or ~0.5% (bins) of a step
    for s in (0.5, 1.0, 2.0):
        m = step == s
        assert abs(_z(resid[m], var[m])) < SR_Z_MAX + 0.5, s
    bins = np.minimum((p * 16).astype(np.int64), 15)
    for b in range(16):
        m = bins == b
        assert abs(_z(resid[m], var[m])) < SR_Z_MAX + 0.5, b


def test_sr_statistic_flags_round_to_nearest():
    """RNE on the same values: always down below p = 1/2, up above, so every bin of p is far off
    (the statistic is not blind to a biased rounding)."""
    p, up, _ = _sr_draws("rne", 0)
    bins = np.minimum((p * 16).astype(np.int64), 15)
    var = np.maximum(p * (1 - p), 1e-12)
    for b in (0, 3, 12, 15):
        m = bins == b
        assert abs(_z(up[m] - p[m], var[m])) > 20, b  # seen 44-70


def test_sr_saturates_in_floor_mode():
    x = block_with([7.0, -7.5], pad_value=0.0)
    for seed in range(5):
        deq = dequantize_mxfp4(quantize_mxfp4(x, rounding="sr", seed=seed, scale_mode="floor"))
        assert deq[:2].tolist() == [6.0, -6.0]


# ----------------------------------------------------------------------------- fake quantize


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_fake_quantize_equals_round_trip(dtype):
    gen = torch.Generator().manual_seed(40)
    x = (torch.randn(7, 45, 3, generator=gen) * 3).to(dtype)
    for kw in [dict(), dict(dim=1, scale_mode="floor"), dict(dim=0, rounding="sr", seed=3),
               dict(block_size=16, scale_mode="rceil")]:
        y = fake_quantize_mxfp4(x, **kw)
        assert y.dtype == torch.float32 and y.shape == x.shape
        assert torch.equal(y, dequantize_mxfp4(quantize_mxfp4(x, **kw)))
    # rceil: the error is at most half a grid step (the largest gap is 2) times the block scale
    q = quantize_mxfp4(x.float(), scale_mode="rceil")
    scale = torch.exp2(q.scale_e8m0.double() - 127).repeat_interleave(32, -1)[..., :3]
    y = fake_quantize_mxfp4(x.float(), scale_mode="rceil")
    assert bool(((y - x.float()).abs().double() <= scale).all())


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8, torch.bool, torch.int8])
def test_rejects_non_float_dtypes(dtype):
    x = torch.ones(32, dtype=dtype)
    with pytest.raises(ValueError, match="float"):
        quantize_mxfp4(x)
    with pytest.raises(ValueError, match="float"):
        fake_quantize_mxfp4(x)


def test_rejects_scalar_and_non_tensor():
    with pytest.raises(ValueError, match="scalar"):
        quantize_mxfp4(torch.tensor(1.0))
    with pytest.raises(ValueError, match="Tensor"):
        quantize_mxfp4([1.0, 2.0])
    with pytest.raises(ValueError, match="MXFP4Tensor"):
        dequantize_mxfp4(torch.ones(4))


@pytest.mark.parametrize("bs", [0, 1, 3, 48, -32, True, 32.0, "32"])
def test_rejects_bad_block_size(bs):
    with pytest.raises(ValueError, match="power of two"):
        quantize_mxfp4(torch.ones(64), block_size=bs)


@pytest.mark.parametrize("mode", ["FLOOR", "nearest", "", None, "rne"])
def test_rejects_unknown_scale_mode(mode):
    with pytest.raises(ValueError) as ei:
        quantize_mxfp4(torch.ones(32), scale_mode=mode)
    for allowed in MODES:
        assert allowed in str(ei.value)


@pytest.mark.parametrize("rounding", ["RNE", "stochastic", "even", None])
def test_rejects_unknown_rounding(rounding):
    with pytest.raises(ValueError) as ei:
        quantize_mxfp4(torch.ones(32), rounding=rounding)
    assert "rne" in str(ei.value) and "sr" in str(ei.value)


@pytest.mark.parametrize("seed", [-1, 2**32, 2**40, True, 1.5, "1"])
def test_rejects_bad_seed(seed):
    with pytest.raises(ValueError, match=r"2\*\*32"):
        quantize_mxfp4(torch.ones(32), rounding="sr", seed=seed)


@pytest.mark.parametrize("dim", [2, -3, 10])
def test_rejects_bad_dim(dim):
    with pytest.raises(ValueError, match="out of range"):
        quantize_mxfp4(torch.ones(4, 32), dim=dim)


def test_e2m1_magnitude_is_the_grid():
    from adahop.formats.mxfp4 import E2M1_GRID, e2m1_magnitude

    assert e2m1_magnitude(torch.arange(8, dtype=torch.uint8)).tolist() == list(E2M1_GRID)
