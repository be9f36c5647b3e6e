"""The output error of one GEMM under every strategy, against a float64 product.

A linear layer's three GEMMs, in the NT form ``mxfp4_gemm`` takes them (the layer passes exactly
these; ``layer_gemms`` reads them from ``gemm_geometry.GEOMETRY``; x_TK activation, w_NK weight,
g_TN output gradient):

    GEMM    C              A  (given as, contraction dim)    B  (given as, contraction dim)
    fprop   y  [T, N]      x_TK, dim 1 (K)                   w_NK, dim 1 (K): B = w^T
    dgrad   dx [T, K]      g_TN, dim 1 (N)                   w_NK, dim 0 (N): B = w
    wgrad   dw [N, K]      g_TN, dim 0 (T): A = g^T          x_TK, dim 0 (T): B = x

Strategies (``strategy_names``), all with the library's numerics: MXFP4 blocks of 32 along the
contraction dim, ``even`` scales, round-to-nearest-even on both operands, the ``reference``
backend (docs/method.md, 'MXFP4', 'Strategy per GEMM', 'Outlier extraction (OE)'):

    bf16              both operands rounded to BF16, float32 accumulation (Lv2's (col, col) mode)
    mxfp4             naive MXFP4 of both operands
    iht               block Hadamard (32) along the contraction dim, then MXFP4
    iht_rs            the same with random signs (Tseng et al.), the signs seed a converted layer
                      of that name would use
    iht+oe_left@k     the k rows of A with the largest L2 norm in BF16, the rest IHT + MXFP4
    iht+oe_right@k    the same for the k columns of B

``mxfp4``, ``iht`` and ``iht_rs`` run through ``linear.make_gemm_plan`` + ``linear.mxfp4_gemm``.
The OE strategies are not run again per k: outlier extraction zeroes outer slices (rows of A,
columns of B) and MXFP4 scales blocks along the contraction dim only, so the other slices
quantize exactly as in plain IHT. OE's output is therefore IHT's output with the k extracted
slices replaced by their BF16 product, and its squared error is IHT's minus IHT's error on those
slices plus BF16's error on them. (``tests/test_analyze.py`` checks this against ``mxfp4_gemm`` in
the OE mode.) OE-left in wgrad is computed too, although a layer cannot run it (it would need X
in BF16, which the forward does not keep): the study marks it, policies never get it.

SQNR = 10 log10(||C||^2 / ||C - C_hat||^2) in dB, C the float64 product of the float32 operands.
"High-precision share": the share of the GEMM's FLOPs that run in BF16, k/M for OE-left (M rows
of A), k/Nc for OE-right, 1 for bf16; OE's MXFP4 GEMM still runs in full, with zeroed slices.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from adahop.config import GemmConfig
from adahop.formats.rng import mix_seeds
from adahop.gemm_geometry import GEOMETRY
from adahop.linear import GEMM_INDEX, make_gemm_plan, mxfp4_gemm
from adahop.ops.backends import ReferenceBackend

BASE_MODES = ("mxfp4", "iht", "iht_rs")  # the quantized products each GEMM runs
OE_SIDES = ("oe_left", "oe_right")
DEFAULT_OE_KS = (16, 64)
BLOCK_SIZE = 32
HADAMARD_SIZE = 32


def check_oe_ks(oe_ks: Iterable[int]) -> tuple[int, ...]:
    ks = tuple(oe_ks)
    if not ks or any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in ks):
        raise ValueError(f"OE k values must be one or more ints >= 1, got {list(ks)!r}")
    return tuple(sorted(set(ks)))


def oe_strategy(side: str, k: int) -> str:
    return f"iht+{side}@{k}"


def strategy_names(oe_ks: Sequence[int] = DEFAULT_OE_KS) -> tuple[str, ...]:
    """Every strategy the study measures, in report order."""
    ks = check_oe_ks(oe_ks)
    return ("bf16", *BASE_MODES, *(oe_strategy(s, k) for s in OE_SIDES for k in ks))


def strategy_of_mode(mode: str, oe_k: int) -> str:
    """The strategy that runs a policy's mode (``policy.GEMM_MODES``) with OE k = ``oe_k``."""
    if mode in ("iht+oe_left", "iht+oe_right"):
        return oe_strategy(mode.split("+", 1)[1], oe_k)
    return mode


def runnable_fp4_strategies(gemm: str, oe_k: int) -> tuple[str, ...]:
    """The 4-bit strategies a layer can run for ``gemm`` with OE k = ``oe_k``: the ceiling's
    candidates (wgrad has no OE-left, see the module doc)."""
    left = () if gemm == "wgrad" else (oe_strategy("oe_left", oe_k),)
    return ("mxfp4", "iht", *left, oe_strategy("oe_right", oe_k))


@dataclass(frozen=True)
class GemmOperands:
    """One GEMM of a layer in ``mxfp4_gemm``'s NT form (see the module doc)."""

    gemm: str
    a: torch.Tensor
    a_dim: int
    b: torch.Tensor
    b_dim: int

    def a_matrix(self) -> torch.Tensor:
        """A as [M, Kc]."""
        return self.a if self.a_dim == 1 else self.a.t()

    def b_matrix(self) -> torch.Tensor:
        """B as [Kc, Nc]."""
        return self.b.t() if self.b_dim == 1 else self.b

    @property
    def shape(self) -> tuple[int, int, int]:
        """(M, Kc, Nc)."""
        m, kc = self.a_matrix().shape
        return m, kc, self.b_matrix().shape[1]

    @property
    def flops(self) -> int:
        m, kc, nc = self.shape
        return 2 * m * kc * nc


def layer_gemms(x_TK: torch.Tensor, w_NK: torch.Tensor, g_TN: torch.Tensor) -> dict[str, GemmOperands]:
    """The three GEMMs of ``y = x w^T`` as the layer feeds them to ``mxfp4_gemm``."""
    tensors = {"x": x_TK, "w": w_NK, "g": g_TN}
    return {name: GemmOperands(name, tensors[gm.a.role], gm.a.dim, tensors[gm.b.role], gm.b.dim)
            for name, gm in GEOMETRY.items()}


def signs_seed(layer_name: str, gemm: str, seed: int = 0) -> int:
    """The random-signs seed a converted layer named ``layer_name`` uses for ``gemm``
    (``AdaHOPLinear._make_static_plan``: mix_seeds(seed, crc32(name), gemm index, 2))."""
    return mix_seeds(seed, zlib.crc32(layer_name.encode()), GEMM_INDEX[gemm], 2)


def base_plan(mode: str, signs: int):
    """The ``GemmPlan`` of a base mode: RNE on both operands, blocks and Hadamard of 32."""
    cfg = GemmConfig(mode="mxfp4" if mode == "mxfp4" else "iht", hadamard_size=HADAMARD_SIZE,
                     random_signs=mode == "iht_rs", a_rounding="rne", b_rounding="rne", scale_mode="even",
                     block_size=BLOCK_SIZE)
    return make_gemm_plan(cfg.mode, cfg, sr_seeds=(None, None), signs_seed=signs)


def as_bf16(t: torch.Tensor) -> torch.Tensor:
    """``t`` rounded to BF16, kept in float32 (so a matmul accumulates in float32)."""
    return t.to(torch.bfloat16).to(torch.float32)


def sqnr_db(signal: float, error: float) -> float:
    """10 log10(signal / error); +inf for no error, NaN for no signal."""
    if not signal > 0:
        return math.nan
    return math.inf if error <= 0 else 10.0 * math.log10(signal / error)


class QuantCache:
    """Quantized operands, so that one tensor feeding several GEMMs is quantized once per
    orientation (x feeds wq, wk and wv; a weight feeds every step). ``persistent`` keys (a
    layer's weight) live until ``clear``; others are keyed by storage and live until
    ``new_step``, since a freed activation's memory is reused by the next step's tensors."""

    def __init__(self, backend=None):
        self.backend = backend or ReferenceBackend()
        self._persistent: dict = {}
        self._step: dict = {}

    def quantize(self, t: torch.Tensor, dim: int, spec, key=None):
        store = self._persistent if key is not None else self._step
        full = (key, dim, spec) if key is not None else (t.data_ptr(), tuple(t.shape), t.stride(), dim, spec)
        q = store.get(full)
        if q is None:
            q = store[full] = self.backend.quantize(t, dim, spec)
        return q

    def new_step(self) -> None:
        self._step.clear()

    def clear(self) -> None:
        self._persistent.clear()
        self._step.clear()


@dataclass
class GemmErrors:
    """What one GEMM gave under every strategy."""

    sqnr_db: dict  # strategy -> dB
    hp_share: dict  # strategy -> share of the GEMM's FLOPs in BF16
    oe_energy_share: dict  # OE strategy -> share of ||C||^2 in its extracted slices
    signal: float  # ||C||^2


def gemm_errors(op: GemmOperands, *, oe_ks: Sequence[int] = DEFAULT_OE_KS, signs: int = 0,
                cache: QuantCache | None = None, weight_key=None) -> GemmErrors:
    """SQNR (dB) of ``op`` under every strategy of ``strategy_names(oe_ks)``. ``weight_key``:
    a persistent cache key for the operand that is the layer's weight (``w_NK``)."""
    cache = cache or QuantCache()
    backend = cache.backend
    a_mat, b_mat = op.a_matrix().float(), op.b_matrix().float()
    m, _, nc = op.shape
    ref = a_mat.double() @ b_mat.double()  # [M, Nc]
    signal = ref.square().sum().item()

    def err_map(c: torch.Tensor) -> torch.Tensor:
        return (ref - c.double()).square()

    e_bf16 = err_map(as_bf16(a_mat) @ as_bf16(b_mat))
    sq, hp = {"bf16": sqnr_db(signal, e_bf16.sum().item())}, {"bf16": 1.0}
    e_iht = None
    for mode in BASE_MODES:
        plan = base_plan(mode, signs)
        a_q = cache.quantize(op.a, op.a_dim, plan.a)
        # B is the weight in fprop and dgrad (the spec and dim tell the orientations apart)
        b_q = cache.quantize(op.b, op.b_dim, plan.b, key=weight_key if op.gemm != "wgrad" else None)
        c = mxfp4_gemm(plan, backend, op.a, op.a_dim, b_q, op.b_dim, a_q=a_q, out_dtype=torch.float32)
        e = err_map(c)
        sq[mode], hp[mode] = sqnr_db(signal, e.sum().item()), 0.0
        if mode == "iht":
            e_iht = e
    share = {}
    total_iht = e_iht.sum().item()
    for side in OE_SIDES:
        # the slices mxfp4_gemm's OE modes select: A's rows (left) or B's columns (right)
        t, t_dim, axis, outer = (op.a, op.a_dim, 1, m) if side == "oe_left" else (op.b, op.b_dim, 0, nc)
        rows_iht, rows_bf16, rows_ref = e_iht.sum(axis), e_bf16.sum(axis), ref.square().sum(axis)
        for k in check_oe_ks(oe_ks):
            idx = backend.select_outer(t, 1 - t_dim, k)
            name = oe_strategy(side, k)
            err = total_iht - rows_iht[idx].sum().item() + rows_bf16[idx].sum().item()
            sq[name] = sqnr_db(signal, max(err, 0.0))
            hp[name] = min(k, outer) / outer
            share[name] = rows_ref[idx].sum().item() / signal if signal > 0 else math.nan
    order = strategy_names(oe_ks)
    return GemmErrors({s: sq[s] for s in order}, {s: hp[s] for s in order}, share, signal)


__all__ = [
    "BASE_MODES",
    "DEFAULT_OE_KS",
    "GemmErrors",
    "GemmOperands",
    "QuantCache",
    "gemm_errors",
    "layer_gemms",
    "runnable_fp4_strategies",
    "signs_seed",
    "sqnr_db",
    "strategy_names",
    "strategy_of_mode",
]
