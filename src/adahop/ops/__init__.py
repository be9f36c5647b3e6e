"""Operand quantization and MXFP4 GEMMs behind one dispatch point (``get_backend``)."""

from adahop.ops.backends import ReferenceBackend, available_backends, get_backend
from adahop.ops.operand import OperandSpec, quantize_operand

__all__ = ["OperandSpec", "ReferenceBackend", "available_backends", "get_backend", "quantize_operand"]
