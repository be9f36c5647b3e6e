"""Hadamard transforms and ``OperandSpec``, how one GEMM operand is quantized (imports only formats)."""

from adahop.transforms.hadamard import (
    DEFAULT_HADAMARD_SIZE,
    HADAMARD_SIZES,
    block_hadamard,
    hadamard_matrix,
    inverse_block_hadamard,
    random_signs,
)

__all__ = [
    "DEFAULT_HADAMARD_SIZE",
    "HADAMARD_SIZES",
    "block_hadamard",
    "hadamard_matrix",
    "inverse_block_hadamard",
    "random_signs",
]
