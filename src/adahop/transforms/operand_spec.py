"""How one GEMM operand is quantized: ``OperandSpec``, the one description of an operand's numerics
from the layer's plan (``layer.plan.make_gemm_plan``, from a ``GemmConfig``) down into the reference
(``ops.operand.quantize_operand``) and the Triton kernels (``kernels.quantize``,
``kernels.quantize_both``).

The operand is zero-padded along its contraction dim K to a multiple of ``alignment`` (the block
and the Hadamard size, both powers of two), transformed there ([random signs +] block Hadamard,
``transforms.hadamard``) and quantized to MXFP4 (``formats.mxfp4``). A spec is checked once, when
it is made; what the kernels need beyond its fields (the padded length, the Hadamard's stages and
norm, whether rounding draws random bits) are its properties, so no other layer re-derives or
re-checks them. The kernels add one limit of their own: blocks of 32.

It sits here, below both ``kernels`` and ``ops``, so that the kernels take it without importing
the dispatch layer; ``ops.operand`` re-exports it.
"""

from __future__ import annotations

from dataclasses import dataclass

from adahop.formats.mxfp4 import DEFAULT_BLOCK_SIZE, ROUNDINGS, SCALE_MODES, check_block_size, check_choice
from adahop.formats.rng import SRStream, check_seed
from adahop.transforms.hadamard import HADAMARD_NORM, HADAMARD_SIZES


@dataclass(frozen=True)
class OperandSpec:
    """How one GEMM operand is quantized (module doc); checked when made, one line per mistake."""

    block_size: int = DEFAULT_BLOCK_SIZE
    scale_mode: str = "even"
    rounding: str = "rne"
    hadamard_size: int | None = None  # None: no transform (naive MXFP4)
    signs_seed: int | None = None  # random +-1 signs before the Hadamard (Tseng et al.)
    # seed of stochastic rounding (required for rounding="sr", unused by "rne"): an int, or an
    # SRStream (the seed chain's state on the device)
    sr_seed: int | SRStream | None = None

    def __post_init__(self):
        check_block_size(self.block_size)
        check_choice("scale_mode", self.scale_mode, SCALE_MODES)
        check_choice("rounding", self.rounding, ROUNDINGS)
        if self.hadamard_size is not None and self.hadamard_size not in HADAMARD_SIZES:
            raise ValueError(f"hadamard_size must be one of {HADAMARD_SIZES} or None, got {self.hadamard_size!r}")
        if self.signs_seed is not None:
            if self.hadamard_size is None:  # the reference signs only what it transforms
                raise ValueError("signs_seed needs a hadamard_size: the random signs are part of the transform")
            check_seed(self.signs_seed, "signs_seed")
        if self.sr_seed is None:
            if self.rounding == "sr":
                raise ValueError("rounding 'sr' needs an sr_seed: an int in [0, 2**32) or an SRStream")
        elif not isinstance(self.sr_seed, SRStream):
            check_seed(self.sr_seed, "sr_seed")

    @property
    def alignment(self) -> int:
        """What K is zero-padded to a multiple of: the block and the Hadamard size."""
        return max(self.block_size, self.hadamard_size or 1)

    def padded(self, n: int) -> int:
        """The length of a quantized row of ``n`` elements: ``n`` up to a multiple of ``alignment``."""
        return -(-n // self.alignment) * self.alignment

    @property
    def stochastic(self) -> bool:
        """Whether rounding draws random bits (``sr_seed``'s)."""
        return self.rounding == "sr"

    @property
    def log2_hadamard(self) -> int:
        """The butterfly's number of stages: log2 of the Hadamard size, 0 without a transform."""
        return (self.hadamard_size or 1).bit_length() - 1

    @property
    def hadamard_norm(self) -> float:
        """The transform's final factor, 1/sqrt(size) rounded to float32; 1 without a transform."""
        return HADAMARD_NORM[self.hadamard_size] if self.hadamard_size else 1.0
