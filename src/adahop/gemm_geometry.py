"""The geometry of a linear layer's three GEMMs: the one table that the layer (``layer``), the policy,
the analysis and the FLOP accounting read.

A layer computes ``y = x w^T`` with (suffixes name the dims) x_TK the activation (T tokens, K in
features), w_NK the weight, g_TN the output gradient:

    GEMM   C      A      B        contraction  A quantized along  B quantized along  OE-left  OE-right
    fprop  y_TN   x      w^T      K            x dim 1 (K)        w dim 1 (K)        T        N
    dgrad  dx_TK  g      w        N            g dim 1 (N)        w dim 0 (N)        T        K
    wgrad  dw_NK  g^T    x        T            g dim 0 (T)        x dim 0 (T)        N        K

Every GEMM is run in the NT form ``C = A @ B`` with both operands quantized along the contraction
(``ops.operand``). An operand is named by its tensor (``role``: x, w or g) and the dim of that
tensor that is contracted (``dim``); its other dim is the outer one, whose slices outlier extraction
(OE) selects: OE-left takes k rows of A (A's outer dim), OE-right k columns of B (B's outer dim).
OE-left in wgrad would need x in high precision, which the forward does not keep: the policy never
asks for it (``policy.check_modes``).

As fed to the matmul, A is [M, Kc] and B is [Kc, Nc]: A is its tensor transposed where that
tensor is contracted along its dim 0 (wgrad's g^T), B where it is contracted along its dim 1
(fprop's w^T). The policy reads patterns through this (a transposed tensor swaps row and column).
"""

from __future__ import annotations

from dataclasses import dataclass

# The dims of each tensor of the layer, by name: T tokens, N out features, K in features.
ROLE_DIMS = {"x": ("T", "K"), "w": ("N", "K"), "g": ("T", "N")}
LAYER_DIMS = ("T", "N", "K")


@dataclass(frozen=True)
class Operand:
    """One operand of a GEMM: the layer's tensor ``role`` (x, w or g), contracted along its ``dim``."""

    role: str
    dim: int

    @property
    def outer_dim(self) -> int:
        """The dim of the role's tensor that is not contracted: the one OE selects slices of."""
        return 1 - self.dim

    @property
    def contraction(self) -> str:
        """The name (T, N or K) of the contracted dim."""
        return ROLE_DIMS[self.role][self.dim]

    @property
    def outer(self) -> str:
        """The name (T, N or K) of the outer dim."""
        return ROLE_DIMS[self.role][self.outer_dim]


@dataclass(frozen=True)
class GemmGeometry:
    """One GEMM of the layer, ``C = A @ B``: its operands and the output it makes (y, dx or dw)."""

    name: str
    output: str
    a: Operand
    b: Operand

    def __post_init__(self):
        if self.a.contraction != self.b.contraction:
            raise ValueError(f"{self.name}: A and B are contracted along {self.a.contraction} and {self.b.contraction}")

    @property
    def contraction(self) -> str:
        """The name (T, N or K) of the contracted dim."""
        return self.a.contraction

    @property
    def a_transposed(self) -> bool:
        """Whether A ([M, Kc] as fed) is its tensor transposed (contracted along its dim 0)."""
        return self.a.dim == 0

    @property
    def b_transposed(self) -> bool:
        """Whether B ([Kc, Nc] as fed) is its tensor transposed (contracted along its dim 1)."""
        return self.b.dim == 1

    def oe_outer(self, mode: str) -> str | None:
        """The name (T, N or K) of the dim whose k slices ``mode`` computes in high precision:
        A's outer dim for ``iht+oe_left``, B's for ``iht+oe_right``; None for the other modes."""
        if mode == "iht+oe_left":
            return self.a.outer
        if mode == "iht+oe_right":
            return self.b.outer
        return None


GEOMETRY = {
    "fprop": GemmGeometry("fprop", "y", a=Operand("x", 1), b=Operand("w", 1)),
    "dgrad": GemmGeometry("dgrad", "dx", a=Operand("g", 1), b=Operand("w", 0)),
    "wgrad": GemmGeometry("wgrad", "dw", a=Operand("g", 0), b=Operand("x", 0)),
}
GEMMS = tuple(GEOMETRY)  # ("fprop", "dgrad", "wgrad"): the order of every per-GEMM tuple
GEMM_INDEX = {g: i for i, g in enumerate(GEMMS)}  # a GEMM's index in seeds and SR streams
FPROP, DGRAD, WGRAD = (GEOMETRY[g] for g in GEMMS)


def oe_outer_size(gemm: str, mode: str, dims: dict[str, int]) -> int | None:
    """The size of the dim ``gemm`` in ``mode`` selects its OE slices from, given the layer's
    ``dims`` ({"T": tokens, "N": out features, "K": in features}); None where ``mode`` is no OE mode."""
    outer = GEOMETRY[gemm].oe_outer(mode)
    return None if outer is None else dims[outer]
