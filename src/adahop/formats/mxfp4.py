"""MXFP4 (OCP Microscaling v1.0): the reference encoder and decoder every backend must match.

Format
------
A tensor is cut into blocks of ``block_size`` (32) consecutive elements along one dim, the
*quantization dim* (the contraction dim of the GEMM the tensor feeds). Each block stores

* one E8M0 scale byte: the biased power-of-two exponent, ``scale = 2**(byte - 127)``; byte 0xFF is
  NaN. Bytes 0..254 are used (2**-127 .. 2**127);
* ``block_size`` E2M1 codes: 1 sign bit (0x8) and 3 magnitude bits indexing
  ``E2M1_GRID = [0, 0.5, 1, 1.5, 2, 3, 4, 6]``; two codes per byte, the even element in the low
  nibble (a decision: docs/method.md, 'MXFP4').

The value of an element is ``E2M1_GRID[code & 7] * (-1 if code & 8 else 1) * scale``.

Layout
------
``quantize_mxfp4(x, dim=d)`` moves dim ``d`` last and pads it with zeros to a multiple of the block
size: ``codes`` is ``[*other dims in order, padded_size // 2]`` uint8 and ``scale_e8m0`` is
``[*other dims, padded_size // block_size]`` uint8, both contiguous. For a 2-D tensor quantized
along dim 0 this is the transposed layout, which is what a GEMM wants for its B operand.

Numerics (the contract the Triton and Hopper kernels reproduce bit for bit)
--------------------------------------------------------------------------
1. The input is converted to float32 (exact for bf16/fp16; fp64 is rounded to fp32 first).
2. ``amax`` = max |x| over the block. A block holding NaN or +-Inf gets scale byte 0xFF and all
   codes 0 (dequantizes to NaN): bad values never crash and never pass silently.
3. The scale exponent ``e`` from ``amax``'s float32 bits (``E`` = unbiased exponent field,
   ``m`` = 23 mantissa bits), with the definitions of torchao's ``ScaleCalculationMode``:

   * ``floor`` (OCP spec): ``e = E - 2`` (2 = E2M1's largest exponent; values above 6 clip);
   * ``even`` (the AdaHOP reference kernels; default): round the mantissa to 1 bit, i.e.
     ``bits' = (bits + 2**21) & 0x7F800000``, then ``e = E(bits') - 2``;
   * ``ceil``: ``e = E + (m != 0) - 2``;
   * ``rceil`` (NVIDIA's): ``e = ceil(log2(fp32(amax / 6)))``, computed exactly from the bits of
     the quotient: nothing saturates, so SR stays unbiased.

   ``e`` is clamped to [-127, 127]; an all-zero block gets ``e = -127`` (byte 0) and zero codes.
   (Blocks whose amax is within a factor 2 of float32's maximum can dequantize to +-Inf in the
   ``even``/``ceil``/``rceil`` modes: the rounded-up value exceeds float32. Training data never
   comes near 3e38.)
4. The block is scaled by ``2**-e`` (a multiply by a normal float32 power of two: exact unless
   the result is below 2**-126, where every rounding gives code 0 anyway), clamped to [-6, 6]
   (saturation; the sign is kept, so -0.1 encodes as -0, code 0x8, like ml_dtypes), and rounded:

   * ``rne``: round to nearest, ties to even code: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2,
     3.5->4, 5->4 (the comparisons in ``_round_rne`` are the definition);
   * ``sr``: with s the grid spacing at |v| (0.5 below 2, 1 below 4, 2 above) and ``bits`` the 16
     counter-based random bits of ``formats.rng.sr_bits``: ``y = |v| / s`` (exact, in [0, 4)) is
     rounded to 16 fractional bits, ``Y = round_half_even(y * 2**16)``, and the magnitude is
     ``floor((Y + bits) / 2**16) * s``. So |v| goes to its upper neighbour with probability
     frac(y) to 16 bits: unbiased to within 2**-17 of a step, and exact integer arithmetic
     after one float32 multiply, so every backend takes the same decision.

Where we differ from torchao's ``to_mx`` (deliberately; the tests compare away from these):
torchao divides by ``max(scale, 2**-126)`` so blocks with ``amax < 2**-124`` encode differently,
and it gives Inf-holding blocks a finite scale; we use the exact scale and the NaN byte.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from adahop.formats.rng import check_seed, sr_bits

E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude of codes 0b000 .. 0b111
E2M1_MAX = 6.0
E2M1_MAX_POW2 = 2  # 6 = 1.5 * 2**2
E2M1_SIGN_BIT = 0x8  # 0b1000
E8M0_BIAS = 127
E8M0_NAN = 0xFF  # 0b1111_1111
E8M0_MIN_EXP = -127  # byte 0x00
E8M0_MAX_EXP = 127  # byte 0xFE
F32_MANTISSA_BITS = 23
F32_EXP_MASK = 0x7F800000  # 0b0_11111111_000...0
F32_MANTISSA_MASK = 0x007FFFFF
EVEN_ROUND_ADD = 1 << (F32_MANTISSA_BITS - 2)  # rounds the mantissa to 1 bit (torchao EVEN)

SCALE_MODES = ("floor", "even", "ceil", "rceil")
ROUNDINGS = ("rne", "sr")
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
DEFAULT_BLOCK_SIZE = 32


@dataclass(frozen=True)
class MXFP4Tensor:
    """An MXFP4-quantized tensor: packed codes, E8M0 scale bytes and what is needed to undo the
    layout. ``codes``/``scale_e8m0`` have the quantization dim last (see the module doc)."""

    codes: torch.Tensor  # uint8 [*rest, padded_size // 2], low nibble = even element
    scale_e8m0: torch.Tensor  # uint8 [*rest, padded_size // block_size]
    shape: torch.Size  # shape of the original tensor
    dim: int  # quantization dim of the original tensor (non-negative)
    block_size: int

    @property
    def padded_size(self) -> int:
        return self.codes.shape[-1] * 2

    @property
    def nbytes(self) -> int:
        return self.codes.numel() * self.codes.element_size() + self.scale_e8m0.numel()


def check_block_size(block_size: int) -> int:
    if (
        isinstance(block_size, bool)
        or not isinstance(block_size, int)
        or block_size < 2
        or block_size & (block_size - 1)
    ):
        raise ValueError(
            f"block_size must be a power of two >= 2 (MX uses 32), got {block_size!r}"
        )
    return block_size


def check_choice(name: str, value: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
    return value


def check_float_tensor(x: torch.Tensor, what: str = "x") -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        allowed = ", ".join(str(d) for d in FLOAT_DTYPES)
        raise ValueError(f"{what} must have a floating dtype ({allowed}), got {x.dtype}")
    if x.dim() == 0:
        raise ValueError(f"{what} must have at least one dim to quantize along, got a scalar")


def normalize_dim(dim: int, ndim: int) -> int:
    if not -ndim <= dim < ndim:
        raise ValueError(f"dim {dim} is out of range for a tensor with {ndim} dims")
    return dim % ndim


def pad_to_multiple(x: torch.Tensor, multiple: int) -> torch.Tensor:
    """Zero-pad the last dim of ``x`` up to a multiple of ``multiple``."""
    pad = -x.shape[-1] % multiple
    if pad == 0:
        return x
    return torch.nn.functional.pad(x, (0, pad))


def _f32_bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def pow2_f32(e: torch.Tensor) -> torch.Tensor:
    """Exact float32 2**e for integer e in [-127, 127], built from its bits (no libm pow):
    e >= -126 is a normal number, e == -127 the subnormal 0x00400000."""
    e = e.to(torch.int32)
    bits = torch.where(e >= -126, (e + E8M0_BIAS) << F32_MANTISSA_BITS, 1 << 22)
    return bits.to(torch.int32).view(torch.float32)


def scale_exponent(amax: torch.Tensor, scale_mode: str) -> torch.Tensor:
    """Unbiased E8M0 exponent (int32) of each block from its float32 ``amax`` (finite, >= 0).
    Non-finite blocks are handled by the caller."""
    check_choice("scale_mode", scale_mode, SCALE_MODES)
    if scale_mode == "rceil":
        descale = amax / E2M1_MAX  # fp32 division, rounded: the quotient's bits define e
        bits = _f32_bits(descale)
        exp_field = bits >> F32_MANTISSA_BITS
        mantissa = bits & F32_MANTISSA_MASK
        # ceil(log2(q)) exactly: 2**(E-127) for a power of two, else one more. Subnormal q
        # (exp_field 0) lies below 2**-126: ceil is -126 above 2**-127, else -127 or lower.
        e = exp_field - E8M0_BIAS + (mantissa != 0).to(torch.int64)
        e = torch.where(exp_field == 0, torch.where(mantissa > (1 << 22), -126, -127), e)
    else:
        bits = _f32_bits(amax)
        if scale_mode == "even":
            bits = (bits + EVEN_ROUND_ADD) & F32_EXP_MASK
        exp_field = bits >> F32_MANTISSA_BITS
        e = exp_field - E8M0_BIAS - E2M1_MAX_POW2
        if scale_mode == "ceil":
            e = e + ((bits & F32_MANTISSA_MASK) != 0).to(torch.int64)
    return e.clamp(E8M0_MIN_EXP, E8M0_MAX_EXP).to(torch.int32)


def _round_rne(a: torch.Tensor) -> torch.Tensor:
    """Magnitude code (0..7) of |v| in [0, 6], round to nearest, ties to the even code.
    Each comparison is one decision boundary; '>' where the tie goes down, '>=' where it goes up.
    """
    return (
        (a > 0.25).to(torch.uint8)
        + (a >= 0.75)
        + (a > 1.25)
        + (a >= 1.75)
        + (a > 2.5)
        + (a >= 3.5)
        + (a > 5.0)
    ).to(torch.uint8)


def _round_sr(a: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """Magnitude code of |v| in [0, 6], stochastically rounded with 16 random ``bits`` (int64)."""
    small, mid = a < 2.0, a < 4.0
    y = a * torch.where(small, 2.0, torch.where(mid, 1.0, 0.5))  # a / spacing: exact, in [0, 4)
    fixed = torch.round(y * 65536.0).to(torch.int64)  # 16 fractional bits, ties to even
    k = (fixed + bits) >> 16  # the lower grid index, plus one with probability frac
    return torch.where(small, k, torch.where(mid, k + 2, k + 4)).to(torch.uint8)


def _sr_counters(shape: torch.Size, device: torch.device) -> torch.Tensor:
    return torch.arange(shape.numel(), dtype=torch.int64, device=device).reshape(shape)


def quantize_mxfp4(
    x: torch.Tensor,
    *,
    dim: int = -1,
    block_size: int = DEFAULT_BLOCK_SIZE,
    scale_mode: str = "even",
    rounding: str = "rne",
    seed: int | None = None,
) -> MXFP4Tensor:
    """Quantize ``x`` to MXFP4 along ``dim`` (see the module doc for the exact numerics).

    ``rounding="sr"`` draws its randomness from ``seed`` (an int in [0, 2**32)); without a seed
    one is drawn from torch's default generator, so ``torch.manual_seed`` makes it reproducible.
    """
    check_float_tensor(x)
    check_block_size(block_size)
    check_choice("scale_mode", scale_mode, SCALE_MODES)
    check_choice("rounding", rounding, ROUNDINGS)
    if rounding == "sr":
        seed = int(torch.randint(0, 2**32, (1,)).item()) if seed is None else check_seed(seed)
    dim = normalize_dim(dim, x.dim())

    x_last = pad_to_multiple(x.movedim(dim, -1).to(torch.float32), block_size).contiguous()
    rest, padded = x_last.shape[:-1], x_last.shape[-1]
    blocks = x_last.reshape(*rest, padded // block_size, block_size)

    amax = blocks.abs().amax(dim=-1, keepdim=True)
    finite = torch.isfinite(amax)
    exp = scale_exponent(torch.where(finite, amax, 0.0), scale_mode)
    scaled = blocks * pow2_f32(-exp)  # e in [-127, 126] here, so 2**-e is a normal float32
    scaled = torch.where(finite, scaled, 0.0).clamp(-E2M1_MAX, E2M1_MAX)
    mag = scaled.abs()
    if rounding == "rne":
        code = _round_rne(mag)
    else:
        code = _round_sr(mag, sr_bits(_sr_counters(blocks.shape, x.device), seed))
    code = code | (torch.signbit(scaled).to(torch.uint8) << 3)

    scale_e8m0 = torch.where(
        finite.squeeze(-1), (exp.squeeze(-1) + E8M0_BIAS), E8M0_NAN
    ).to(torch.uint8)
    code = code.reshape(*rest, padded)
    packed = code[..., 0::2] | (code[..., 1::2] << 4)
    return MXFP4Tensor(
        codes=packed.contiguous(),
        scale_e8m0=scale_e8m0.contiguous(),
        shape=x.shape,
        dim=dim,
        block_size=block_size,
    )


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n/2] (two codes per byte, low nibble first) -> uint8 codes [..., n]."""
    lo, hi = packed & 0x0F, packed >> 4
    return torch.stack((lo, hi), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def e2m1_magnitude(mag_codes: torch.Tensor) -> torch.Tensor:
    """Magnitude codes 0..7 -> ``E2M1_GRID`` values (float32), by arithmetic: 0.5 c below 4,
    c - 2 for 4 and 5, 2 (c - 4) for 6 and 7. Exact, and no table is copied to the device (a
    host-to-device copy is not allowed in a CUDA-graph capture and synchronises outside one)."""
    c = mag_codes.to(torch.float32)
    return torch.where(c < 4, c * 0.5, torch.where(c < 6, c - 2.0, (c - 4.0) * 2.0))


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Unpacked E2M1 codes (uint8) -> float32 values (without scale)."""
    mag = e2m1_magnitude(codes & 0x7)
    return torch.where((codes & E2M1_SIGN_BIT) != 0, -mag, mag)


def decode_e8m0(scale_e8m0: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes -> float32 scales (0xFF -> NaN; 0x00 -> 2**-127, a float32 subnormal)."""
    exp = (scale_e8m0.to(torch.int32) - E8M0_BIAS).clamp(max=E8M0_MAX_EXP)
    return torch.where(scale_e8m0 == E8M0_NAN, float("nan"), pow2_f32(exp))


def dequantize_mxfp4(q: MXFP4Tensor, *, keep_padding: bool = False) -> torch.Tensor:
    """MXFP4 -> float32. By default the original shape and layout; with ``keep_padding=True``
    the quantized layout (quantization dim last, padded), which is what a GEMM consumes."""
    if not isinstance(q, MXFP4Tensor):
        raise ValueError(f"dequantize_mxfp4 takes an MXFP4Tensor, got {type(q).__name__}")
    vals = decode_e2m1(unpack_codes(q.codes))
    rest, padded = vals.shape[:-1], vals.shape[-1]
    scale = decode_e8m0(q.scale_e8m0).unsqueeze(-1)
    vals = (vals.reshape(*rest, padded // q.block_size, q.block_size) * scale).reshape(
        *rest, padded
    )
    if keep_padding:
        return vals
    return vals[..., : q.shape[q.dim]].movedim(-1, q.dim).contiguous()


def fake_quantize_mxfp4(
    x: torch.Tensor,
    *,
    dim: int = -1,
    block_size: int = DEFAULT_BLOCK_SIZE,
    scale_mode: str = "even",
    rounding: str = "rne",
    seed: int | None = None,
) -> torch.Tensor:
    """Quantize to MXFP4 and back: float32 values with ``x``'s shape."""
    q = quantize_mxfp4(
        x, dim=dim, block_size=block_size, scale_mode=scale_mode, rounding=rounding, seed=seed
    )
    return dequantize_mxfp4(q)


def fake_quantize_mxfp4_tiles(
    x: torch.Tensor, *, block_size: int = DEFAULT_BLOCK_SIZE, scale_mode: str = "even"
) -> torch.Tensor:
    """A 2-D tensor quantized with one E8M0 scale per ``block_size`` x ``block_size`` tile (RNE)
    and back: float32 values with ``x``'s shape (NVIDIA's 2-D weight scaling).

    Why: quantizing the result again with ordinary MXFP4 blocks along either dim, in the same
    scale mode, gives it back exactly. A block of 32 inside a tile holds E2M1 values times the
    tile's scale s; with c the block's largest code, every scale mode picks s (c = 4 or 6) or a
    smaller power of two s / 2**j (c <= 3) under which each of the block's values is again on
    the E2M1 grid (the grid's values below 4 times 2**j are grid values). So a weight quantized
    this way is one quantized tensor in both the forward GEMM (blocks along K) and dgrad (blocks
    along N).
    Tiles are cut from the top-left; the dims are zero-padded to whole tiles first. A tile
    holding NaN or Inf dequantizes to NaN, as a block does in ``quantize_mxfp4``."""
    check_float_tensor(x)
    check_block_size(block_size)
    check_choice("scale_mode", scale_mode, SCALE_MODES)
    if x.dim() != 2:
        raise ValueError(f"tile quantization takes a 2-D tensor, got shape {tuple(x.shape)}")
    rows, cols = x.shape
    b = block_size
    padded = torch.nn.functional.pad(x.to(torch.float32), (0, -cols % b, 0, -rows % b))
    tiles = padded.reshape(padded.shape[0] // b, b, padded.shape[1] // b, b)
    amax = tiles.abs().amax(dim=(1, 3), keepdim=True)
    finite = torch.isfinite(amax)
    exp = scale_exponent(torch.where(finite, amax, 0.0), scale_mode)
    scaled = (tiles * pow2_f32(-exp)).clamp(-E2M1_MAX, E2M1_MAX)
    mag = e2m1_magnitude(_round_rne(scaled.abs()))
    vals = torch.where(torch.signbit(scaled), -mag, mag) * pow2_f32(exp)
    vals = torch.where(finite, vals, float("nan"))
    return vals.reshape(padded.shape)[:rows, :cols].contiguous()
