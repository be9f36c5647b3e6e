"""Counter-based RNG (adahop.formats.rng) against a pure-Python reference of its documented
definition."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch

from adahop.formats.rng import check_seed, lowbias32, mix_seeds, mix_seeds_from, sr_bits

M32 = 2**32 - 1


def ref_lowbias32(x: int) -> int:
    """Chris Wellons' lowbias32, written independently with Python ints."""
    x &= M32
    x ^= x >> 16
    x = (x * 0x7FEB352D) % 2**32
    x ^= x >> 15
    x = (x * 0x846CA68B) % 2**32
    x ^= x >> 16
    return x


def ref_sr_bits(counter: int, seed: int) -> int:
    pair = counter >> 1
    key = ref_lowbias32(seed ^ ref_lowbias32(pair >> 32))
    r = ref_lowbias32((pair & M32) ^ key)
    return (r >> 16) if counter & 1 else (r & 0xFFFF)


def test_lowbias32_known_structure():
    # lowbias32(0) == 0 (xorshift-multiply of 0), and it is a bijection-like mix: 1 maps far away
    assert ref_lowbias32(0) == 0
    assert int(lowbias32(torch.tensor([0]))[0]) == 0
    assert int(lowbias32(torch.tensor([1]))[0]) == ref_lowbias32(1) != 1


def test_lowbias32_matches_pure_python():
    rnd = random.Random(0)
    vals = [0, 1, 2, 3, 0xFFFF, 0x10000, 2**31 - 1, 2**31, 2**31 + 1, M32, M32 - 1, M32 - 2,
            2**32 - 255, 0x7FEB352D, 0x846CA68B, 0xDEADBEEF]
    vals += [rnd.randrange(2**32) for _ in range(5000)]
    vals += [2**32 - 1 - i for i in range(500)]
    got = lowbias32(torch.tensor(vals, dtype=torch.int64)).tolist()
    assert got == [ref_lowbias32(v) for v in vals]
    assert all(0 <= g <= M32 for g in got)


def test_lowbias32_is_injective_on_a_sample():
    # a composition of invertible steps: no collisions on distinct 32-bit inputs
    x = torch.arange(0, 200_000, dtype=torch.int64) * 21_474 % 2**32
    assert torch.unique(x).numel() == x.numel()
    assert torch.unique(lowbias32(x)).numel() == x.numel()


def test_sr_bits_match_pure_python_reference():
    rnd = random.Random(1)
    counters = list(range(300)) + [2**32 - 2, 2**32 - 1, 2**32, 2**32 + 1, 2**33 + 7, 2**40 + 3, 2**62]
    counters += [rnd.randrange(2**48) for _ in range(300)]
    for seed in (0, 1, 12345, 2**31, M32):
        got = sr_bits(torch.tensor(counters, dtype=torch.int64), seed)
        assert got.dtype == torch.int64
        assert got.tolist() == [ref_sr_bits(c, seed) for c in counters]


def test_sr_bits_pairs_share_one_hash():
    """Counters 2j and 2j + 1 are the two halves of the same 32-bit hash of j."""
    c = torch.arange(2000, dtype=torch.int64)
    b = sr_bits(c, 77)
    whole = b[0::2] | (b[1::2] << 16)
    assert torch.equal(whole, lowbias32(torch.arange(1000) ^ ref_lowbias32(ref_lowbias32(0) ^ 77)))


def test_sr_bits_range_and_determinism():
    c = torch.arange(100_000, dtype=torch.int64)
    b = sr_bits(c, 7)
    assert bool((b >= 0).all()) and bool((b < 2**16).all())
    assert torch.equal(b, sr_bits(c, 7))
    # shape is kept
    c2 = c.reshape(10, 100, 100)
    assert torch.equal(sr_bits(c2, 7), b.reshape(10, 100, 100))
    # a different seed gives a different stream, element by element almost everywhere
    assert float((b == sr_bits(c, 8)).float().mean()) < 0.001


def test_sr_bits_are_roughly_uniform():
    n, bins = 1 << 17, 64
    for seed in (0, 99, 2**32 - 1):
        u = sr_bits(torch.arange(n, dtype=torch.int64), seed).double() / 2**16
        # mean 1/2 and variance 1/12 within 6 standard errors
        assert abs(u.mean().item() - 0.5) < 6 * math.sqrt(1 / 12 / n)
        assert abs(u.var().item() - 1 / 12) < 6 * math.sqrt(1 / 180 / n)
        counts = torch.histc(u, bins=bins, min=0.0, max=1.0)
        exp = n / bins
        chi2 = float(((counts - exp) ** 2 / exp).sum())
        dof = bins - 1
        assert chi2 < dof + 6 * math.sqrt(2 * dof), chi2
        # neighbouring counters are uncorrelated: the two halves of one hash, and across pairs
        for a, b in ((u[0::2], u[1::2]), (u[1:-1:2], u[2::2]), (u[:-2], u[2:])):
            corr = torch.corrcoef(torch.stack((a, b)))[0, 1].item()
            assert abs(corr) < 6 / math.sqrt(a.numel())


def test_sr_bits_high_counter_words_matter():
    # counters whose pair index differs only above bit 32 give different streams
    lo = torch.arange(10_000, dtype=torch.int64)
    assert float((sr_bits(lo, 5) == sr_bits(lo + 2**33, 5)).float().mean()) < 0.001


@pytest.mark.parametrize("seed", [-1, 2**32, True, 1.0, "3", None])
def test_sr_bits_reject_bad_seed(seed):
    with pytest.raises(ValueError, match="seed"):
        sr_bits(torch.arange(4), seed)
    with pytest.raises(ValueError, match=r"\[0, 2\*\*32\)"):
        check_seed(seed)


def test_check_seed_accepts_bounds():
    assert check_seed(0) == 0
    assert check_seed(M32) == M32


def test_mix_seeds_deterministic_and_distinct():
    assert mix_seeds(1, 2, 3) == mix_seeds(1, 2, 3)
    assert mix_seeds() == mix_seeds()
    assert mix_seeds(0) != 0 and mix_seeds() != 0
    # typical use: (config seed, layer id, call counter, gemm index, operand index)
    tuples = [()]
    tuples += [(a,) for a in range(50)]
    tuples += [(a, b) for a in range(20) for b in range(20)]
    tuples += [(s, layer, step, g, o) for s in (0, 1) for layer in range(8) for step in range(10)
               for g in range(3) for o in range(2)]
    tuples += [(0, 0, 0), (0, 0, 0, 0), (M32,), (M32, M32), (M32, 0), (0, M32)]
    seeds = [mix_seeds(*t) for t in tuples]
    assert len(set(seeds)) == len(tuples)
    assert all(0 <= s <= M32 for s in seeds)
    # order matters
    assert mix_seeds(1, 2) != mix_seeds(2, 1)
    # a usable SR seed
    assert check_seed(mix_seeds(3, 4)) == mix_seeds(3, 4)


def test_mix_seeds_matches_documented_chain():
    def ref(*values):
        h = 0x9E3779B9
        for v in values:
            words = 0
            while True:
                h = ref_lowbias32(h ^ (v & M32))
                words += 1
                v >>= 32
                if v == 0:
                    break
            h = ref_lowbias32(h ^ words)  # each value closed by its word count
        return h

    for t in [(), (0,), (7, 11), (2**32 + 3, 9), (2**70 + 1,), (1, 2, 3, 4, 5)]:
        assert mix_seeds(*t) == ref(*t)


def test_mix_seeds_values_do_not_run_together():
    assert mix_seeds(2**32 + 5) != mix_seeds(5, 1)
    assert mix_seeds(0, 0) != mix_seeds(0)


def test_mix_seeds_rejects_negative():
    with pytest.raises(ValueError, match="non-negative"):
        mix_seeds(1, -1)


def test_mix_seeds_from_continues_the_chain():
    from adahop.formats.rng import MIX_START, mix_seeds_from

    assert mix_seeds_from(MIX_START) == mix_seeds()
    assert mix_seeds_from(mix_seeds(7, 2**40 + 3), 5, 0) == mix_seeds(7, 2**40 + 3, 5, 0)
    with pytest.raises(ValueError):
        mix_seeds_from(MIX_START, -1)


def test_layer_seeds_follow_the_documented_formula():
    from torch import nn

    import adahop

    lin = nn.Linear(64, 32)
    layer = adahop.AdaHOPLinear.from_float(lin, config=adahop.AdaHOPConfig.from_recipe_name("tseng", seed=5),
                                           name="blocks.0.wq")
    signs_checked = sr_checked = 0
    for call in range(3):
        layer.calls = call
        plan = layer._plan(torch.device("cpu"))
        for gi, gemm in enumerate(("fprop", "dgrad", "wgrad")):
            g = getattr(plan, gemm)
            for operand, spec in enumerate((g.a, g.b)):  # RNE draws nothing: no seed
                if spec.rounding == "sr":
                    assert spec.sr_seed.seed() == mix_seeds(5, layer.layer_id, call, gi, operand)
                    sr_checked += 1
                else:
                    assert spec.sr_seed is None
            if g.a.signs_seed is not None:
                assert g.a.signs_seed == mix_seeds(5, layer.layer_id, gi, 2)
                signs_checked += 1
    assert signs_checked >= 3  # tseng signs its backward GEMMs: the signs formula was checked
    assert sr_checked >= 3  # and rounds their gradients stochastically
    layer.config = layer.config.replace(seed=6)  # a new seed is picked up (the device prefix is rewritten)
    layer.calls = 3
    plan = layer._plan(torch.device("cpu"))
    assert plan.dgrad.a.sr_seed.seed() == mix_seeds(6, layer.layer_id, 3, 1, 0)


def test_plan_follows_a_new_config():
    """The layer's cached plan is rebuilt when its config is replaced (here: another Hadamard
    size and rounding for fprop's activation)."""
    from torch import nn

    import adahop

    layer = adahop.AdaHOPLinear.from_float(nn.Linear(64, 32), config=adahop.AdaHOPConfig.from_recipe_name("mxfp4_iht"),
                                           name="p")
    assert layer._plan(torch.device("cpu")).fprop.a.hadamard_size == 32
    cfg = layer.config
    layer.config = cfg.replace(fprop=dataclasses.replace(cfg.fprop, hadamard_size=64, a_rounding="sr"))
    layer.calls = 1
    plan = layer._plan(torch.device("cpu"))
    assert plan.fprop.a.hadamard_size == 64 and plan.fprop.a.rounding == "sr"
    assert plan.fprop.a.sr_seed.seed() == mix_seeds(cfg.seed, layer.layer_id, 1, 0, 0)


@pytest.mark.parametrize("prefix,call,gemm,operand", [(12345, 7, 1, 0), (2**32 - 5, 2**33 + 3, 2, 1), (0, 0, 0, 0)])
def test_device_stream_gives_the_int_seeds_bits(prefix, call, gemm, operand):
    """An ``SRStream`` (the seed chain's state on the device) quantizes to the same bits as its
    int seed, in the reference and in both Triton kernels, which derive the key from the state
    themselves (a call count of two 32-bit words included)."""
    from adahop.formats.rng import SRStream
    from adahop.kernels.quantize import quantize_operand_triton
    from adahop.kernels.quantize_both import quantize_both
    from adahop.ops.operand import OperandSpec, quantize_operand

    stream = SRStream(torch.tensor([prefix, call]), gemm, operand)
    seed = mix_seeds_from(prefix, call, gemm, operand)
    assert stream.seed() == seed
    x = torch.randn(64, 96, generator=torch.Generator().manual_seed(call % 1000))
    for dim in (0, 1):
        by_int = quantize_operand_triton(x, dim, OperandSpec(rounding="sr", sr_seed=seed, hadamard_size=32))["mx"]
        by_stream = quantize_operand_triton(x, dim, OperandSpec(rounding="sr", sr_seed=stream, hadamard_size=32))["mx"]
        ref = quantize_operand(x, dim, OperandSpec(rounding="sr", sr_seed=stream, hadamard_size=32))
        assert torch.equal(by_int.codes, by_stream.codes) and torch.equal(by_int.codes, ref.codes)
        assert torch.equal(by_int.scale_e8m0, by_stream.scale_e8m0)
    other = OperandSpec(rounding="sr", sr_seed=seed + 1)
    by_int = quantize_both(x, OperandSpec(rounding="sr", sr_seed=seed), other)
    by_stream = quantize_both(x, OperandSpec(rounding="sr", sr_seed=stream), other)
    for a, b in zip(by_int, by_stream):
        assert torch.equal(a["e4m3"].view(torch.uint8), b["e4m3"].view(torch.uint8))


def test_stream_refuses_a_bad_state():
    from adahop.formats.rng import SRStream

    with pytest.raises(ValueError, match="int64 tensor of shape"):
        SRStream(torch.zeros(2, dtype=torch.int32), 0, 0)
    with pytest.raises(ValueError, match="GEMM 0-2"):
        SRStream(torch.zeros(2, dtype=torch.int64), 3, 0)
