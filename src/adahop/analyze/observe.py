"""Per-tensor statistics of one step: what calibration records, plus the tensor's scale.

``tensor_stats`` gives what calibration records (``patterns.calibration.observe_tensor``: the
label, ``cv_row``, ``cv_col``, the energy share of the top-k rows and columns, and the
quantization statistics of ``patterns.quant_error`` that the measured policy reads) plus ``rms``
and ``absmax`` of the tensor. The detector and the quantization statistics are scale-invariant
(docs/method.md, 'Outlier patterns and their detection'): a small gradient gets the label of the
same tensor scaled up.
"""

from __future__ import annotations

import math

import torch

from adahop.patterns.calibration import TensorObservation, observe_tensor
from adahop.patterns.detect import as_rows
from adahop.patterns.quant_error import PROFILE_DIMS


def is_finite(t: torch.Tensor) -> bool:
    return bool(torch.isfinite(t).all())


def tensor_stats(t: torch.Tensor, *, tau: float, k: int, profile_dims=PROFILE_DIMS) -> tuple[dict, TensorObservation]:
    """The statistics above for ``t`` (viewed as 2-D rows x last dim), and the observation
    calibration would record (``profile_dims``: see ``observe_tensor``). The caller skips
    non-finite tensors (their scores would be NaN)."""
    m = as_rows(t).detach().to(torch.float32)
    obs = observe_tensor(m, tau=tau, k=k, profile_dims=profile_dims)
    rms = m.square().mean().sqrt().item() if m.numel() else math.nan
    stats = {
        "pattern": obs.pattern, "cv_row": obs.cv_row, "cv_col": obs.cv_col,
        "row_energy_topk": obs.row_energy_topk, "col_energy_topk": obs.col_energy_topk,
        "rms": rms, "absmax": m.abs().max().item() if m.numel() else math.nan,
    }
    return stats, obs
