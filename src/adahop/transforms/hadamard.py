"""Block Hadamard transform along one dim, with optional random signs, and its inverse.

The transform of a vector ``x`` (its length a multiple of ``size``) is, per block of ``size``
consecutive elements, ``y = (x * s) @ H / sqrt(size)`` with ``H`` the ``size x size`` Sylvester
Hadamard matrix (``H_1 = [1]``, ``H_2n = [[H_n, H_n], [H_n, -H_n]]``; symmetric, ``H H = n I``)
and ``s`` an optional +-1 sign vector over the whole dim. It is orthonormal, so ``(A T)(T^T B) =
A B``: applied to both operands along a GEMM's inner dim (IHT) it needs no inverse.

Numerics (the contract the Triton kernels reproduce bit for bit). In float32 (float64 inputs stay
float64, for exactness tests):
1. multiply by the signs (exact);
2. the fast Walsh-Hadamard butterfly, stages ``h = size/2, size/4, ..., 1`` in that order, each
   replacing the pair ``(a, b) = (x[i], x[i + h])`` (i in the lower half of each 2h-group) by
   ``(a + b, a - b)``. (The kernels compute these additions in place, as here.)
3. one multiply by ``HADAMARD_NORM[size]``, ``1/sqrt(size)`` rounded to float32 (a power of two,
   hence exact, for sizes 16, 64, 256).
A tensor-core dot would be faster to write but its accumulation order is unspecified, so no
reference could match it bit for bit; the butterfly's order is fixed.

Random signs come from the counter hash of ``formats.rng`` (sign of element i = top bit of its
hash), so a kernel generates them in registers from (seed, i) instead of loading a vector.
"""

from __future__ import annotations

import math

import torch

from adahop.formats.mxfp4 import check_float_tensor, normalize_dim
from adahop.formats.rng import MASK32, check_seed, lowbias32

HADAMARD_SIZES = (16, 32, 64, 128, 256)
DEFAULT_HADAMARD_SIZE = 32
# 1/sqrt(n) rounded to float32 (exact powers of two for n = 16, 64, 256).
HADAMARD_NORM = {n: float(torch.tensor(1.0 / math.sqrt(n), dtype=torch.float32)) for n in HADAMARD_SIZES}


def check_hadamard_size(size: int) -> int:
    if size not in HADAMARD_SIZES:
        raise ValueError(f"Hadamard size must be one of {HADAMARD_SIZES}, got {size!r}")
    return size


def hadamard_matrix(size: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Normalised Sylvester Hadamard matrix ``H / sqrt(size)`` (any power of two)."""
    if size < 1 or size & (size - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {size!r}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < size:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return (h / math.sqrt(size)).to(dtype)


def random_signs(n: int, seed: int, device: torch.device | str | None = None) -> torch.Tensor:
    """+-1 float32 vector of length n: element i is -1 iff the top bit of
    ``lowbias32(i ^ lowbias32(seed))`` is set."""
    check_seed(seed)
    key = int(lowbias32(torch.tensor([seed], dtype=torch.int64)).item())
    idx = torch.arange(n, dtype=torch.int64, device=device)
    bit = (lowbias32((idx & MASK32) ^ key) >> 31).to(torch.float32)
    return 1.0 - 2.0 * bit


def _fwht_last(x: torch.Tensor, size: int) -> torch.Tensor:
    """Unnormalised Walsh-Hadamard butterfly over blocks of ``size`` along the last dim."""
    shape = x.shape
    h = size // 2
    while h >= 1:
        y = x.reshape(*shape[:-1], shape[-1] // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        x = torch.stack((a + b, a - b), dim=-2).reshape(shape)
        h //= 2
    return x


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _norm(size: int, dtype: torch.dtype) -> float:
    return 1.0 / math.sqrt(size) if dtype == torch.float64 else HADAMARD_NORM[size]


def _prepare(x: torch.Tensor, dim: int, size: int, signs: torch.Tensor | None):
    check_float_tensor(x)
    check_hadamard_size(size)
    dim = normalize_dim(dim, x.dim())
    n = x.shape[dim]
    if n % size:
        raise ValueError(
            f"the transformed dim ({n}) must be a multiple of the Hadamard size {size}; pad it "
            "first (the GEMM path pads with zeros to a multiple of max(block, Hadamard size))"
        )
    if signs is not None and (signs.dim() != 1 or signs.shape[0] != n):
        raise ValueError(f"signs must be a 1-D tensor of length {n}, got shape {tuple(signs.shape)}")
    return dim


def block_hadamard(
    x: torch.Tensor, *, dim: int = -1, size: int = DEFAULT_HADAMARD_SIZE, signs=None
) -> torch.Tensor:
    """Orthonormal block Hadamard transform of ``x`` along ``dim`` (float32 result; float64 for
    float64 input). ``signs``: optional +-1 vector over the dim (see ``random_signs``)."""
    dim = _prepare(x, dim, size, signs)
    dt = _compute_dtype(x)
    y = x.movedim(dim, -1).to(dt)
    if signs is not None:
        y = y * signs.to(device=y.device, dtype=dt)
    y = _fwht_last(y, size) * _norm(size, dt)
    return y.movedim(-1, dim)


def inverse_block_hadamard(
    y: torch.Tensor, *, dim: int = -1, size: int = DEFAULT_HADAMARD_SIZE, signs=None
) -> torch.Tensor:
    """Inverse of ``block_hadamard`` with the same ``size`` and ``signs``."""
    dim = _prepare(y, dim, size, signs)
    dt = _compute_dtype(y)
    x = _fwht_last(y.movedim(dim, -1).to(dt), size) * _norm(size, dt)
    if signs is not None:
        x = x * signs.to(device=x.device, dtype=dt)
    return x.movedim(-1, dim)
