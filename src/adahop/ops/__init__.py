"""What runs a GEMM operand's numerics: its reference quantization (``operand``), outlier
extraction's choice of slices (``outliers``), and the backends that quantize operands and run the
MXFP4 GEMMs (``backends``: a registry, one module per backend), behind one dispatch point
(``get_backend``)."""

from adahop.ops.backends import ReferenceBackend, available_backends, get_backend
from adahop.ops.operand import OperandSpec, quantize_operand

__all__ = ["OperandSpec", "ReferenceBackend", "available_backends", "get_backend", "quantize_operand"]
