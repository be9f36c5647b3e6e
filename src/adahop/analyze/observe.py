"""Per-tensor statistics of one step: the detector's label and scores, and the same at unit RMS.

``tensor_stats`` gives what calibration records (``patterns.calibration.observe_tensor``: the
label, ``cv_row``, ``cv_col``, the energy share of the top-k rows and columns) plus:

- ``rms`` and ``absmax`` of the tensor;
- ``pattern_unit_rms``, ``cv_row_unit_rms``, ``cv_col_unit_rms``: the detector on the tensor
  divided by its RMS. The detector adds an absolute ``1e-8`` to a variance (docs/method.md,
  'Outlier patterns and their detection'), so a tensor of small values (the gradient of a loss
  averaged over many tokens) scores lower than the same tensor scaled up, and its label can
  change. At unit RMS the ``1e-8`` is negligible: where the two labels differ, the raw label is
  an artefact of the tensor's scale. Calibration uses the raw label; the study reports both.
"""

from __future__ import annotations

import math

import torch

from adahop.patterns.calibration import observe_tensor
from adahop.patterns.detect import as_rows, classify_scores, outlier_scores

STAT_FIELDS = ("pattern", "cv_row", "cv_col", "row_energy_topk", "col_energy_topk", "rms", "absmax",
               "pattern_unit_rms", "cv_row_unit_rms", "cv_col_unit_rms")


def is_finite(t: torch.Tensor) -> bool:
    return bool(torch.isfinite(t).all())


def tensor_stats(t: torch.Tensor, *, tau: float, k: int) -> dict:
    """The statistics above for ``t`` (viewed as 2-D rows x last dim). The caller skips
    non-finite tensors (their scores would be NaN)."""
    m = as_rows(t).detach().to(torch.float32)
    obs = observe_tensor(m, tau=tau, k=k)
    rms = m.square().mean().sqrt().item() if m.numel() else math.nan
    unit = outlier_scores(m / rms) if rms > 0 else outlier_scores(m)
    return {
        "pattern": obs.pattern, "cv_row": obs.cv_row, "cv_col": obs.cv_col,
        "row_energy_topk": obs.row_energy_topk, "col_energy_topk": obs.col_energy_topk,
        "rms": rms, "absmax": m.abs().max().item() if m.numel() else math.nan,
        "pattern_unit_rms": classify_scores(unit, tau), "cv_row_unit_rms": unit.cv_row, "cv_col_unit_rms": unit.cv_col,
    }
