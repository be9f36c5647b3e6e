"""Outlier-pattern detector (the AdaHOP reference's statistic, made scale-invariant;
docs/method.md, 'Outlier patterns and their detection').

A 2-D operand (X as [T, K], W as [N, K], G as [T, N]; more dims are flattened into rows) is
**row**-wise when a few rows carry the large values, **col**-wise when a few columns do, and
**none** otherwise. On the tensor scaled by a power of two to an absolute maximum in [0.5, 1)
(``unit_scaled``), in float32:

    r = unbiased variance of each row            c = unbiased variance of each column
    cv_row = std(r) / mean(r) / sqrt(2 / max(C - 1, 1))     (0 when mean(r) = 0)
    cv_col = std(c) / mean(c) / sqrt(2 / max(R - 1, 1))     (0 when mean(c) = 0)

The normalisation is the coefficient of variation of a chi-square variance estimate with C-1
degrees of freedom, so an i.i.d. Gaussian tensor scores about 1 on both. Then

    cv_row > tau * cv_col  -> "row";   cv_col > tau * cv_row  -> "col";   else "none"

with tau = 2. The reference adds an absolute 1e-8 to mean(r), so its scores shrink with the
tensor's scale (a gradient of a mean loss over many tokens is small) and labels change once a
tensor is small enough; the power-of-two scaling is exact, so scores and labels do not depend on
the scale (to float32 rounding for a factor that is not a power of two), and no square under- or
overflows. An all-zero tensor scores (0, 0): "none". A tensor with fewer than 2 rows or columns,
or any NaN/Inf, is "none" (nothing can be said about it) and its scores are NaN.

Each statistic is computed on the tensor's device and stays there (``all_finite``,
``unit_scaled_exponent``, ``score_tensor``, ``label_of``, ``share_tensor``: tensors, no data-dependent
Python branch), so that calibration observes every layer at every step without waiting for the
device (``patterns.calibration``). The functions that return Python numbers (``outlier_scores``,
``classify_scores``, ``topk_energy_share``, ``detect_outlier_pattern``, ...) read those tensors
back once, at their end. The device versions compute what the host arithmetic on ``.item()``
values computed, bit for bit: float64 where it was Python floats, a division by a 0-d tensor
where it divided Python floats.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from adahop.formats.mxfp4 import check_float_tensor

PATTERNS = ("row", "col", "none")
DEFAULT_TAU = 2.0


@dataclass(frozen=True)
class OutlierScores:
    cv_row: float
    cv_col: float


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """View a tensor as 2-D [rows, last dim] (leading dims flattened)."""
    check_float_tensor(t, "t")
    if t.dim() == 1:
        return t.reshape(1, -1)
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])  # not -1: fails on 0 columns


def all_finite(t: torch.Tensor) -> torch.Tensor:
    """0-d bool tensor: ``t`` holds no NaN or Inf (on t's device: nothing is read back)."""
    return torch.isfinite(t).all()


def is_finite(t: torch.Tensor) -> bool:
    """``all_finite`` read back to the host."""
    return bool(all_finite(t))


def unit_scaled(m: torch.Tensor) -> torch.Tensor:
    """Finite ``m`` in float32, multiplied by the power of two that brings its largest absolute
    value into [0.5, 1): only exponents change (exact, but for elements that end below float32's
    normal range), and every statistic of a ratio of its squares is then free of its scale and
    safe from under- and overflow. An all-zero (or empty) ``m`` stays zero."""
    return unit_scaled_exponent(m)[0]


def unit_scaled_exponent(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(unit_scaled(m), e)`` with ``m = unit_scaled(m) * 2**e``, ``e`` a 0-d int64 tensor on m's
    device (0 for an all-zero or empty ``m``; meaningless for a non-finite one): what statistics
    of several tensors need to be brought to one scale (``rescale``). Nothing is read back: the
    exponent is ``frexp`` of the absolute maximum, on the device."""
    if m.numel() == 0:
        return m.to(torch.float32), torch.zeros((), dtype=torch.int64, device=m.device)
    lo, hi = torch.aminmax(m)  # one pass, no |m| temporary
    amax = torch.where(hi > -lo, hi, -lo).double()  # max(-lo, hi), exact in float64
    e = torch.frexp(amax).exponent.to(torch.int64)  # amax = f * 2**e, 0.5 <= f < 1 (e = 0 for 0)
    if m.dtype == torch.float64:  # scaled before the cast: a float64 beyond float32's range is fine
        return rescale(m, -e).to(torch.float32), e
    return rescale(m.to(torch.float32), -e), e


def _pow2(e: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """2**e for an integer tensor ``e`` in ``dtype``, as the Python float ``2.0**e`` cast to it
    (0 or a subnormal below its range, Inf above): made from float64 bits (e clamped to
    float64's normal range, which every caller's e lies in)."""
    bits = (e.to(torch.int64).clamp(-1022, 1023) + 1023) << 52
    return bits.view(torch.float64).to(dtype)


def rescale(v: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """``v * 2**e`` for float32 or float64 ``v`` and an integer tensor ``e`` (0-d, on v's
    device), exact but for results below the normal range: one multiply by 2**e where it is a
    normal number of v's dtype (then times 1), else two, by 2**(e // 2) and 2**(e - e // 2)."""
    lo, hi = (-126, 127) if v.dtype == torch.float32 else (-1022, 1023)
    first = torch.where((e >= lo) & (e <= hi), e, torch.div(e, 2, rounding_mode="floor"))
    return v * _pow2(first, v.dtype) * _pow2(e - first, v.dtype)


def unit_rows(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` as 2-D rows (``as_rows``), detached and ``unit_scaled``; None if it holds NaN or Inf."""
    m = as_rows(t).detach()
    return unit_scaled(m) if is_finite(m) else None


def _const(value: float, like: torch.Tensor) -> torch.Tensor:
    """A float64 0-d tensor on like's device. (Dividing by it divides; CUDA multiplies by the
    reciprocal of a Python float divisor, which may differ in the last bit.)"""
    return torch.full((), value, dtype=torch.float64, device=like.device)


def _cv(v: torch.Tensor) -> torch.Tensor:
    """Coefficient of variation std / mean of non-negative ``v`` (float64, 0-d); 0 when every
    value is 0 (no spread at all)."""
    mean, std = v.mean().double(), v.std().double()
    return torch.where(mean > 0, std / mean, 0.0)


def scores_of(m: torch.Tensor | None) -> OutlierScores:
    """The scores of a ``unit_rows`` tensor (None: non-finite)."""
    if m is None or m.shape[0] < 2 or m.shape[1] < 2:
        return OutlierScores(math.nan, math.nan)
    return scores_of_variances(m.var(dim=1), m.var(dim=0))


def score_tensor(row_var: torch.Tensor, col_var: torch.Tensor) -> torch.Tensor:
    """``[cv_row, cv_col]`` (float64, on the device) from a tensor's row variances ([rows]) and
    column variances ([cols]); NaN with fewer than 2 rows or columns."""
    rows, cols = row_var.numel(), col_var.numel()
    if rows < 2 or cols < 2:
        return torch.full((2,), math.nan, dtype=torch.float64, device=row_var.device)
    cv_row = _cv(row_var) / _const(math.sqrt(2.0 / max(cols - 1, 1)), row_var)
    cv_col = _cv(col_var) / _const(math.sqrt(2.0 / max(rows - 1, 1)), col_var)
    return torch.stack((cv_row, cv_col))


def scores_of_variances(row_var: torch.Tensor, col_var: torch.Tensor) -> OutlierScores:
    """``score_tensor`` read back: what ``scores_of`` computes, for statistics gathered in parts
    (``patterns.observation``)."""
    return OutlierScores(*score_tensor(row_var, col_var).tolist())


def outlier_scores(t: torch.Tensor) -> OutlierScores:
    """The detector's (cv_row, cv_col) for a tensor; NaN when undefined (see module doc)."""
    return scores_of(unit_rows(t))


def label_of(scores: torch.Tensor, tau: float = DEFAULT_TAU) -> torch.Tensor:
    """The index in ``PATTERNS`` (0-d int64, on the device) of the label of ``score_tensor``'s
    ``[cv_row, cv_col]``: "row" when cv_row > tau * cv_col, "col" when cv_col > tau * cv_row, else
    "none" (also for NaN scores). Products, not the reference's ratios with an added 1e-8: both
    scores are scale-free already, and (0, 0) is simply "none"."""
    cv_row, cv_col = scores[0], scores[1]
    finite = torch.isfinite(scores).all()
    row = finite & (cv_row > tau * cv_col)
    col = finite & (cv_col > tau * cv_row)
    return torch.where(row, PATTERNS.index("row"), torch.where(col, PATTERNS.index("col"), PATTERNS.index("none")))


def classify_scores(scores: OutlierScores, tau: float = DEFAULT_TAU) -> str:
    """``label_of`` for scores held on the host."""
    t = torch.tensor([scores.cv_row, scores.cv_col], dtype=torch.float64)
    return PATTERNS[int(label_of(t, tau))]


def check_patterns(patterns) -> dict[str, str]:
    """Validate a layer's patterns ``{"x": .., "w": .., "g": ..}``, each one of ``PATTERNS``."""
    if not isinstance(patterns, dict) or set(patterns) != {"x", "w", "g"}:
        raise ValueError(f"patterns must map exactly x, w and g to one of {PATTERNS}, got {patterns!r}")
    for role in ("x", "w", "g"):
        if patterns[role] not in PATTERNS:
            raise ValueError(f"pattern of {role} must be one of {PATTERNS}, got {patterns[role]!r}")
    return {r: patterns[r] for r in ("x", "w", "g")}


def check_tau(tau: float) -> float:
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not tau > 0:
        raise ValueError(f"tau must be a positive number, got {tau!r}")
    return float(tau)


def detect_outlier_pattern(t: torch.Tensor, *, tau: float = DEFAULT_TAU) -> str:
    """Classify ``t`` as "row", "col" or "none" (see the module doc)."""
    return classify_scores(outlier_scores(t), check_tau(tau))


def slice_energies(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Squared L2 norms of the rows and of the columns of 2-D ``m``."""
    sq = m.square()
    return sq.sum(dim=1), sq.sum(dim=0)


def share_tensor(row_e: torch.Tensor, col_e: torch.Tensor, k: int) -> torch.Tensor:
    """``[row share, column share]`` of ``topk_energy_share`` (float32, on the device) from the
    slice energies of a ``unit_rows`` tensor; NaN when empty or all zero."""
    if row_e.numel() == 0 or col_e.numel() == 0:
        return torch.full((2,), math.nan, dtype=torch.float32, device=row_e.device)
    total = row_e.sum()
    share_r = row_e.topk(min(k, row_e.numel())).values.sum() / total
    share_c = col_e.topk(min(k, col_e.numel())).values.sum() / total
    return torch.where(total != 0, torch.stack((share_r, share_c)), math.nan)


def shares_of(row_e: torch.Tensor, col_e: torch.Tensor, k: int) -> tuple[float, float]:
    """``share_tensor`` read back."""
    return tuple(share_tensor(row_e, col_e, k).tolist())


def topk_energy_share(t: torch.Tensor, k: int) -> tuple[float, float]:
    """Share of the squared norm held by the k largest rows, and by the k largest columns: what
    outlier extraction with k slices would move to the BF16 path. Scale-free (``unit_scaled``);
    NaN for non-finite, all-zero and empty tensors."""
    m = unit_rows(t)
    if m is None or m.numel() == 0:
        return (math.nan, math.nan)
    return shares_of(*slice_energies(m), k)
