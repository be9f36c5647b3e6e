"""Counter-based random bits for stochastic rounding, the same bits on every backend.

Stochastic rounding (SR) must be reproducible (a seed gives the same codes on the CPU reference,
under the Triton interpreter and on the GPU) and cheap in a kernel: with ``tl.rand``'s Philox a
Hadamard + MXFP4 quantize pass measured 5x slower on the H200 (0.27 against 1.46 TB/s; see
docs/kernels.md, 'Stochastic rounding in kernels'). So the random bits are a stateless hash of
(seed, element counter); two neighbouring elements share one 32-bit hash, 16 bits each:

    pair = counter >> 1
    key  = lowbias32(seed ^ lowbias32(pair >> 32))
    r    = lowbias32((pair & 0xFFFFFFFF) ^ key)
    bits = r & 0xFFFF if counter is even else r >> 16       # 16 bits per element

Sixteen bits resolve a rounding probability to 2**-16 (``formats.mxfp4``: the bias is under
2**-17 of a grid step), and one hash per two elements halves the integer work of the kernels
(an integer multiply is half the FP32 rate on Hopper).

``lowbias32`` is Chris Wellons' 32-bit integer hash (two multiply-xorshift rounds; it passes the
usual avalanche tests and costs a handful of integer ops). The counter of an element is its flat
index in the quantized layout (the quantization dim moved last, padded to the block size), so a
kernel recomputes it from its tile coordinates.

All arithmetic here is on int64 tensors holding uint32 values. A 32x32-bit product can reach 2**64
and overflow int64, so multiplications are split into 16-bit halves (each partial product < 2**48).
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
LOWBIAS32_M1 = 0x7FEB352D
LOWBIAS32_M2 = 0x846CA68B


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for uint32 values held in int64, without int64 overflow."""
    c_lo, c_hi = c & 0xFFFF, c >> 16
    return (x * c_lo + (((x * c_hi) & 0xFFFF) << 16)) & MASK32


def lowbias32(x: torch.Tensor) -> torch.Tensor:
    """Wellons' lowbias32 hash of uint32 values held in an int64 tensor."""
    x = x & MASK32
    x = x ^ (x >> 16)
    x = _mul32(x, LOWBIAS32_M1)
    x = x ^ (x >> 15)
    x = _mul32(x, LOWBIAS32_M2)
    x = x ^ (x >> 16)
    return x


def check_seed(seed: int, what: str = "seed") -> int:
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MASK32:
        raise ValueError(f"{what} must be an int in [0, 2**32), got {seed!r}")
    return seed


def sr_bits(counter: torch.Tensor, seed: int) -> torch.Tensor:
    """16 random bits (int64 in [0, 2**16)) per element, a pure function of (seed, counter).
    ``counter`` is an int64 tensor of non-negative element indices; the counters 2j and 2j + 1
    take the low and the high half of the hash of j."""
    check_seed(seed)
    counter = counter.to(torch.int64)
    pair = counter >> 1
    key = lowbias32(lowbias32(pair >> 32) ^ seed)
    r = lowbias32((pair & MASK32) ^ key)
    return (r >> ((counter & 1) * 16)) & 0xFFFF


def _lowbias32_int(x: int) -> int:
    x &= MASK32
    x ^= x >> 16
    x = (x * LOWBIAS32_M1) & MASK32
    x ^= x >> 15
    x = (x * LOWBIAS32_M2) & MASK32
    x ^= x >> 16
    return x


MIX_START = 0x9E3779B9  # golden-ratio start, so mix_seeds() of zeros is not zero


def mix_seeds(*values: int) -> int:
    """Derive a 32-bit seed from several non-negative ints (config seed, layer id, call counter,
    GEMM and operand index): a chain of lowbias32 over each value's 32-bit words, each value
    closed by its word count (so (2**32 + a,) and (a, 1) do not collide)."""
    return mix_seeds_from(MIX_START, *values)


def mix_seeds_from(state: int, *values: int) -> int:
    """Continue the chain of ``mix_seeds`` from ``state``: ``mix_seeds_from(mix_seeds(a, b), c)
    == mix_seeds(a, b, c)``, so a caller can hash a fixed prefix once."""
    h = state
    for v in values:
        v = int(v)
        if v < 0:
            raise ValueError(f"mix_seeds takes non-negative ints, got {v}")
        words = 0
        while True:
            h = _lowbias32_int(h ^ (v & MASK32))
            words += 1
            v >>= 32
            if v == 0:
                break
        h = _lowbias32_int(h ^ words)
    return h


class SRStream:
    """The stochastic-rounding seed of one operand of one GEMM of one layer call, held on the
    device: ``mix_seeds_from(prefix, call, gemm, operand)`` with ``state`` an int64 tensor
    ``[prefix, call]`` (the layer's chain prefix and its call counter; ``AdaHOPLinear``). The
    Triton kernels derive the seed from ``state`` themselves (``kernels.quantize``,
    ``_sr_key_from_state``), so nothing is read back to the host and a CUDA graph replayed with a
    new counter draws new bits; the reference reads it (``seed``). It stands where an int seed
    would (``OperandSpec.sr_seed``) and gives the same bits as that int."""

    __slots__ = ("state", "gemm", "operand")

    def __init__(self, state: torch.Tensor, gemm: int, operand: int):
        if not isinstance(state, torch.Tensor) or state.dtype != torch.int64 or state.shape != (2,):
            raise ValueError(f"an SRStream's state is an int64 tensor of shape (2,), got {state!r}")
        if gemm not in (0, 1, 2) or operand not in (0, 1):
            raise ValueError(f"an SRStream names GEMM 0-2 and operand 0-1, got {gemm}, {operand}")
        self.state, self.gemm, self.operand = state, gemm, operand

    def seed(self) -> int:
        """The seed as an int (reads ``state``: a device sync on a GPU)."""
        prefix, call = (int(v) for v in self.state.tolist())
        return mix_seeds_from(prefix, call, self.gemm, self.operand)

    def __repr__(self) -> str:
        return f"SRStream(gemm={self.gemm}, operand={self.operand})"
