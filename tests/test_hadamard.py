"""Block Hadamard transform (adahop.transforms.hadamard) and the operand spec that names it
(adahop.transforms.operand_spec)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from adahop.transforms.hadamard import (
    HADAMARD_SIZES,
    block_hadamard,
    hadamard_matrix,
    inverse_block_hadamard,
    random_signs,
)
from adahop.transforms.operand_spec import OperandSpec

SIZES = (16, 32, 64, 128, 256)
M32 = 2**32 - 1


def ref_lowbias32(x: int) -> int:
    x &= M32
    x ^= x >> 16
    x = (x * 0x7FEB352D) % 2**32
    x ^= x >> 15
    x = (x * 0x846CA68B) % 2**32
    x ^= x >> 16
    return x


def sylvester(n: int) -> np.ndarray:
    """Unnormalised Sylvester matrix from the entry formula H[i, j] = (-1)**popcount(i & j)."""
    i = np.arange(n)
    return np.where(np.vectorize(lambda v: bin(v).count("1") % 2)(i[:, None] & i[None, :]) == 1, -1.0, 1.0)


def ref_fwht_f32(x: np.ndarray, size: int) -> np.ndarray:
    """The documented float32 butterfly, stage h = size/2, ..., 2, 1, then one multiply by
    float32(1/sqrt(size)) -- a loop implementation independent of the library's."""
    x = x.astype(np.float32).copy()
    n = x.shape[-1]
    h = size // 2
    while h >= 1:
        for start in range(0, n, 2 * h):
            a = x[..., start:start + h].copy()
            b = x[..., start + h:start + 2 * h].copy()
            x[..., start:start + h] = a + b
            x[..., start + h:start + 2 * h] = a - b
        h //= 2
    return x * np.float32(1.0 / math.sqrt(size))


def test_supported_sizes():
    assert tuple(HADAMARD_SIZES) == SIZES


@pytest.mark.parametrize("size", [1, 2, 4, 8, 16, 32, 64, 128, 256])
def test_hadamard_matrix_orthonormal_and_sylvester(size):
    h = hadamard_matrix(size)
    assert h.dtype == torch.float64 and h.shape == (size, size)
    assert torch.allclose(h @ h.T, torch.eye(size, dtype=torch.float64), rtol=0, atol=1e-13)
    assert torch.equal(h, h.T)  # Sylvester matrices are symmetric
    np.testing.assert_allclose(h.numpy() * math.sqrt(size), sylvester(size), rtol=0, atol=1e-12)
    assert hadamard_matrix(size, dtype=torch.float32).dtype == torch.float32


@pytest.mark.parametrize("size", [0, 3, 48, 100])
def test_hadamard_matrix_rejects_non_power_of_two(size):
    with pytest.raises(ValueError, match="power of two"):
        hadamard_matrix(size)


@pytest.mark.parametrize("size", SIZES)
def test_block_hadamard_equals_blockwise_matmul_float64(size):
    gen = torch.Generator().manual_seed(size)
    x = torch.randn(7, 3 * size, generator=gen, dtype=torch.float64)
    y = block_hadamard(x, size=size)
    assert y.dtype == torch.float64 and y.shape == x.shape
    ref = (x.reshape(7, 3, size) @ hadamard_matrix(size)).reshape(7, 3 * size)
    torch.testing.assert_close(y, ref, rtol=0, atol=1e-13)


@pytest.mark.parametrize("size", SIZES)
def test_block_hadamard_float32_bit_exact_butterfly(size):
    gen = torch.Generator().manual_seed(100 + size)
    x = torch.randn(5, 2 * size, generator=gen) * 10
    y = block_hadamard(x, size=size)
    assert y.dtype == torch.float32
    ref = ref_fwht_f32(x.numpy(), size)
    np.testing.assert_array_equal(y.numpy(), ref)
    # bf16 / fp16 inputs compute in float32
    xb = x.to(torch.bfloat16)
    yb = block_hadamard(xb, size=size)
    assert yb.dtype == torch.float32
    np.testing.assert_array_equal(yb.numpy(), ref_fwht_f32(xb.float().numpy(), size))


def test_norm_constants_are_exact_powers_of_two_for_16_64_256():
    # a unit vector at index 0 of a block transforms to a constant 1/sqrt(n) row
    for size, c in [(16, 0.25), (64, 0.125), (256, 0.0625)]:
        e = torch.zeros(size)
        e[0] = 1.0
        assert torch.equal(block_hadamard(e, size=size), torch.full((size,), c))


@pytest.mark.parametrize("size", SIZES)
def test_inverse_recovers_input(size):
    gen = torch.Generator().manual_seed(200 + size)
    x64 = torch.randn(6, 4 * size, generator=gen, dtype=torch.float64)
    back = inverse_block_hadamard(block_hadamard(x64, size=size), size=size)
    torch.testing.assert_close(back, x64, rtol=0, atol=1e-12)
    x32 = x64.float()
    back32 = inverse_block_hadamard(block_hadamard(x32, size=size), size=size)
    assert back32.dtype == torch.float32
    rel = ((back32.double() - x32.double()).norm() / x32.double().norm()).item()
    assert rel < 1e-6
    # the transform is not the identity
    assert not torch.allclose(block_hadamard(x32, size=size), x32)


@pytest.mark.parametrize("size", SIZES)
def test_norm_preserved(size):
    gen = torch.Generator().manual_seed(300 + size)
    x = torch.randn(4, 8, 2 * size, generator=gen, dtype=torch.float64)
    y = block_hadamard(x, size=size)
    # per block: orthonormal
    nx = x.reshape(4, 8, 2, size).norm(dim=-1)
    ny = y.reshape(4, 8, 2, size).norm(dim=-1)
    torch.testing.assert_close(ny, nx, rtol=1e-12, atol=0)
    s = random_signs(2 * size, seed=1)
    ys = block_hadamard(x, size=size, signs=s)
    torch.testing.assert_close(ys.reshape(4, 8, 2, size).norm(dim=-1), nx, rtol=1e-12, atol=0)


def test_gemm_invariance_inner_hadamard():
    # (A T)(B T)^T = A B^T, with and without signs: the IHT needs no inverse
    gen = torch.Generator().manual_seed(3)
    a = torch.randn(9, 128, generator=gen, dtype=torch.float64)
    b = torch.randn(11, 128, generator=gen, dtype=torch.float64)
    s = random_signs(128, seed=77)
    for signs in (None, s):
        at = block_hadamard(a, signs=signs)
        bt = block_hadamard(b, signs=signs)
        torch.testing.assert_close(at @ bt.T, a @ b.T, rtol=0, atol=1e-12)


def test_random_signs_properties():
    s = random_signs(4096, seed=5)
    assert s.dtype == torch.float32 and s.shape == (4096,)
    assert set(s.unique().tolist()) == {-1.0, 1.0}
    assert torch.equal(s, random_signs(4096, seed=5))
    assert not torch.equal(s, random_signs(4096, seed=6))
    neg = float((s < 0).float().mean())
    assert abs(neg - 0.5) < 5 * math.sqrt(0.25 / 4096)
    # prefix property: sign i depends only on (seed, i)
    assert torch.equal(random_signs(100, seed=5), s[:100])
    assert random_signs(0, seed=5).shape == (0,)


def test_random_signs_match_documented_hash():
    for seed in (0, 1, 42, M32):
        key = ref_lowbias32(seed)
        exp = [(-1.0 if ref_lowbias32(i ^ key) >> 31 else 1.0) for i in range(300)]
        assert random_signs(300, seed=seed).tolist() == exp


@pytest.mark.parametrize("seed", [-1, 2**32, True])
def test_random_signs_reject_bad_seed(seed):
    with pytest.raises(ValueError):
        random_signs(32, seed=seed)


@pytest.mark.parametrize("size", [16, 32, 256])
def test_signs_then_inverse_with_signs(size):
    gen = torch.Generator().manual_seed(400 + size)
    n = 2 * size
    x = torch.randn(5, n, generator=gen, dtype=torch.float64)
    s = random_signs(n, seed=123)
    y = block_hadamard(x, size=size, signs=s)
    # the definition: (x * s) @ H per block
    ref = ((x * s.double()).reshape(5, 2, size) @ hadamard_matrix(size)).reshape(5, n)
    torch.testing.assert_close(y, ref, rtol=0, atol=1e-13)
    assert not torch.allclose(y, block_hadamard(x, size=size))
    torch.testing.assert_close(inverse_block_hadamard(y, size=size, signs=s), x, rtol=0, atol=1e-12)
    # without the signs the inverse does not recover x
    assert not torch.allclose(inverse_block_hadamard(y, size=size), x)
    # float32
    x32 = x.float()
    y32 = block_hadamard(x32, size=size, signs=s)
    back = inverse_block_hadamard(y32, size=size, signs=s)
    assert ((back - x32).norm() / x32.norm()).item() < 1e-6


@pytest.mark.parametrize("size", [16, 64])
def test_along_dim0_and_middle_dims(size):
    gen = torch.Generator().manual_seed(500 + size)
    x = torch.randn(2 * size, 5, generator=gen, dtype=torch.float64)
    s = random_signs(2 * size, seed=9)
    y0 = block_hadamard(x, dim=0, size=size, signs=s)
    assert y0.shape == x.shape
    torch.testing.assert_close(y0, block_hadamard(x.T, size=size, signs=s).T, rtol=0, atol=0)
    torch.testing.assert_close(inverse_block_hadamard(y0, dim=0, size=size, signs=s), x,
                               rtol=0, atol=1e-12)
    x3 = torch.randn(3, size, 4, 2, generator=gen, dtype=torch.float64)
    y3 = block_hadamard(x3, dim=1, size=size)
    ref = block_hadamard(x3.movedim(1, -1), size=size).movedim(-1, 1)
    torch.testing.assert_close(y3, ref, rtol=0, atol=0)
    ref2 = torch.einsum("ajbc,jk->akbc", x3, hadamard_matrix(size))
    torch.testing.assert_close(y3, ref2, rtol=0, atol=1e-13)
    torch.testing.assert_close(inverse_block_hadamard(y3, dim=-3, size=size), x3, rtol=0, atol=1e-12)
    # float32 along dim 0 is bit-identical to the transposed computation
    x32 = x.float()
    assert torch.equal(block_hadamard(x32, dim=0, size=size), block_hadamard(x32.T.contiguous(), size=size).T)


def test_non_contiguous_input():
    gen = torch.Generator().manual_seed(6)
    base = torch.randn(64, 96, generator=gen)
    v = base[:, ::3]  # [64, 32], non-contiguous
    assert not v.is_contiguous()
    assert torch.equal(block_hadamard(v), block_hadamard(v.contiguous()))


@pytest.mark.parametrize("size", [8, 48, 512, 0, 1, 33])
def test_rejects_bad_size(size):
    with pytest.raises(ValueError, match="Hadamard size"):
        block_hadamard(torch.ones(4, 1024), size=size)
    with pytest.raises(ValueError, match="Hadamard size"):
        inverse_block_hadamard(torch.ones(4, 1024), size=size)


@pytest.mark.parametrize("n", [16, 48, 33, 1])
def test_rejects_dim_not_multiple_of_size(n):
    with pytest.raises(ValueError, match="multiple"):
        block_hadamard(torch.ones(3, n), size=32)
    with pytest.raises(ValueError, match="multiple"):
        inverse_block_hadamard(torch.ones(n, 3), dim=0, size=32)


def test_rejects_wrong_signs():
    x = torch.ones(3, 64)
    for s in (torch.ones(32), torch.ones(65), torch.ones(1, 64), torch.ones(3, 64)):
        with pytest.raises(ValueError, match="signs"):
            block_hadamard(x, signs=s)
        with pytest.raises(ValueError, match="signs"):
            inverse_block_hadamard(x, signs=s)


def test_rejects_bad_tensors():
    with pytest.raises(ValueError):
        block_hadamard(torch.ones(4, 32, dtype=torch.int32))
    with pytest.raises(ValueError):
        block_hadamard(torch.tensor(1.0))
    with pytest.raises(ValueError):
        block_hadamard(torch.ones(4, 32), dim=2)


@pytest.mark.parametrize("kw,match", [
    (dict(rounding="nearest"), r"rounding must be one of \('rne', 'sr'\)"),
    (dict(scale_mode="round"), "scale_mode must be one of"),
    (dict(hadamard_size=48), r"hadamard_size must be one of \(16, 32, 64, 128, 256\) or None"),
    (dict(block_size=24), "block_size must be a power of two"),
    (dict(rounding="sr"), "rounding 'sr' needs an sr_seed"),
    (dict(rounding="sr", sr_seed=2**32), r"sr_seed must be an int in \[0, 2\*\*32\)"),
    (dict(signs_seed=3), "signs_seed needs a hadamard_size"),
    (dict(hadamard_size=32, signs_seed=-1), "signs_seed must be an int"),
])
def test_bad_numerics_are_refused_by_the_spec(kw, match):
    """An operand's numerics are checked once, when its ``OperandSpec`` is made (the kernels
    add only their own limit, blocks of 32: test_kernels.py)."""
    with pytest.raises(ValueError, match=match):
        OperandSpec(**kw)


def test_operand_spec_derived_values():
    spec = OperandSpec(hadamard_size=64)
    assert (spec.alignment, spec.padded(100), spec.padded(128), spec.padded(0)) == (64, 128, 128, 0)
    assert (spec.log2_hadamard, spec.hadamard_norm, spec.stochastic) == (6, 0.125, False)
    plain = OperandSpec(rounding="sr", sr_seed=1)
    assert (plain.alignment, plain.padded(33), plain.log2_hadamard, plain.hadamard_norm) == (32, 64, 0, 1.0)
    assert plain.stochastic
