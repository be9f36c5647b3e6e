"""MXFP4 encode/decode reference and its constants (bottom layer: imports only torch)."""

from adahop.formats.mxfp4 import (
    E2M1_GRID,
    ROUNDINGS,
    SCALE_MODES,
    MXFP4Tensor,
    dequantize_mxfp4,
    fake_quantize_mxfp4,
    quantize_mxfp4,
)

__all__ = [
    "E2M1_GRID",
    "ROUNDINGS",
    "SCALE_MODES",
    "MXFP4Tensor",
    "dequantize_mxfp4",
    "fake_quantize_mxfp4",
    "quantize_mxfp4",
]
