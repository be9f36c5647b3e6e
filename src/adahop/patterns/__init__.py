"""Outlier-pattern detection and calibration (imports formats)."""

from adahop.patterns.calibration import TENSOR_ROLES, LayerCalibration, observe_tensor
from adahop.patterns.detect import PATTERNS, detect_outlier_pattern, outlier_scores

__all__ = [
    "PATTERNS",
    "TENSOR_ROLES",
    "LayerCalibration",
    "detect_outlier_pattern",
    "observe_tensor",
    "outlier_scores",
]
