"""Which outer slices outlier extraction (OE) takes: the k with the largest L2 norm.

OE ranks the outer slices of a GEMM operand (A's rows or B's columns) by their L2 norm over
the contraction dim, in float32, and computes the k largest in high precision. The rule, shared
by every backend so that they pick the same slices: the k largest norms, NaN above +inf, ties at
the k-th norm broken by the lower index; indices returned sorted. ``largest_k`` is the
reference (a stable sort); ``kernels.topk`` computes the same set in one launch, which the
Triton backends use. The reference's norms are ``torch.linalg.vector_norm`` (``outer_norms``);
where a Triton quantize kernel reads the operand anyway, it sums the norms itself (the same
norms up to the order of the float additions: ``ops.backends.triton``), else those backends
take ``outer_norms`` too (docs/method.md, 'Outlier extraction (OE)').
"""

from __future__ import annotations

import torch


def outer_norms(t: torch.Tensor, outer_dim: int) -> torch.Tensor:
    """float32 L2 norms of the slices of 2-D ``t`` along ``outer_dim`` (over the other dim)."""
    return torch.linalg.vector_norm(t, dim=1 - outer_dim, dtype=torch.float32)


def largest_k(values: torch.Tensor, k: int) -> torch.Tensor:
    """Sorted int64 indices of the ``min(k, n)`` largest of 1-D ``values`` (the rule above)."""
    k = min(k, values.numel())
    return torch.sort(values, descending=True, stable=True).indices[:k].sort().values


def topk_outer(t: torch.Tensor, outer_dim: int, k: int) -> torch.Tensor:
    """Sorted indices of the k slices of 2-D ``t`` along ``outer_dim`` with the largest L2 norm
    (k clamped to the dim): the reference selection."""
    return largest_k(outer_norms(t, outer_dim), k)
