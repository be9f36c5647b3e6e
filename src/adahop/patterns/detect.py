"""Outlier-pattern detector (the AdaHOP reference's statistic; docs/method.md, 'Outlier patterns and
their detection').

A 2-D operand (X as [T, K], W as [N, K], G as [T, N]; more dims are flattened into rows) is
**row**-wise when a few rows carry the large values, **col**-wise when a few columns do, and
**none** otherwise. In float32:

    r = unbiased variance of each row            c = unbiased variance of each column
    cv_row = std(r) / (mean(r) + 1e-8) / sqrt(2 / max(C - 1, 1))
    cv_col = std(c) / (mean(c) + 1e-8) / sqrt(2 / max(R - 1, 1))

The normalisation is the coefficient of variation of a chi-square variance estimate with C-1
degrees of freedom, so an i.i.d. Gaussian tensor scores about 1 on both. Then

    cv_row / (cv_col + 1e-8) > tau  -> "row";  cv_col / (cv_row + 1e-8) > tau -> "col";  else "none"

with tau = 2. A tensor with fewer than 2 rows or columns, or any NaN/Inf, is "none" (nothing can
be said about it) and its scores are NaN.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from adahop.formats.mxfp4 import check_float_tensor

PATTERNS = ("row", "col", "none")
DEFAULT_TAU = 2.0
EPS = 1e-8


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


def outlier_scores(t: torch.Tensor) -> OutlierScores:
    """The detector's (cv_row, cv_col) for a tensor; NaN when undefined (see module doc)."""
    m = as_rows(t).detach().to(torch.float32)
    rows, cols = m.shape
    if rows < 2 or cols < 2 or not bool(torch.isfinite(m).all()):
        return OutlierScores(math.nan, math.nan)
    r = m.var(dim=1)
    c = m.var(dim=0)
    cv_row = (r.std() / (r.mean() + EPS)).item() / math.sqrt(2.0 / max(cols - 1, 1))
    cv_col = (c.std() / (c.mean() + EPS)).item() / math.sqrt(2.0 / max(rows - 1, 1))
    return OutlierScores(cv_row, cv_col)


def classify_scores(scores: OutlierScores, tau: float = DEFAULT_TAU) -> str:
    if not (math.isfinite(scores.cv_row) and math.isfinite(scores.cv_col)):
        return "none"
    if scores.cv_row / (scores.cv_col + EPS) > tau:
        return "row"
    if scores.cv_col / (scores.cv_row + EPS) > tau:
        return "col"
    return "none"


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


def topk_energy_share(t: torch.Tensor, k: int) -> tuple[float, float]:
    """Share of the squared norm held by the k largest rows, and by the k largest columns: what
    outlier extraction with k slices would move to the BF16 path. NaN for non-finite tensors."""
    m = as_rows(t).detach().to(torch.float32)
    total = m.square().sum()
    if m.numel() == 0 or not bool(torch.isfinite(total)) or total.item() == 0:
        return (math.nan, math.nan)
    row_e = m.square().sum(dim=1)
    col_e = m.square().sum(dim=0)
    share_r = row_e.topk(min(k, row_e.numel())).values.sum() / total
    share_c = col_e.topk(min(k, col_e.numel())).values.sum() / total
    return (share_r.item(), share_c.item())
