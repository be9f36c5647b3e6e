"""The AdaHOP linear layer's machinery below the module (``linear.AdaHOPLinear``), one concept a file:

* ``plan``: the plan of a layer call (each GEMM's mode and operand quantization, the backend),
  and ``numerics_key``, the string that describes a layer's GEMMs to the ops;
* ``gemms``: the three GEMMs (fprop; dgrad and wgrad) as plain functions, ``mxfp4_gemm`` one of them;
* ``ops``: the GEMMs as ``torch.library`` custom ops with their autograd (``adahop::linear_forward``,
  ``adahop::linear_backward``);
* ``grouped``: the forwards of layers that read one activation in one op, quantizing it once
  (``adahop::linear_group_forward``).

Each reads the GEMMs' geometry (operands, contraction and OE outer dims) from
``gemm_geometry.GEOMETRY``, and runs the quantizations and GEMMs on a backend of ``ops.backends``.
Importing this package registers the custom ops.
"""

from adahop.layer import grouped, ops  # noqa: F401  (registers the custom ops)
from adahop.layer.gemms import PLAIN_MODES, backward_gemms, forward_gemms, forward_weight, mxfp4_gemm
from adahop.layer.grouped import group_numerics_key, input_key, quantize_input
from adahop.layer.ops import run_backward, run_forward
from adahop.layer.plan import GemmPlan, LayerPlan, layer_plan, make_gemm_plan, numerics_key

__all__ = ["PLAIN_MODES", "GemmPlan", "LayerPlan", "backward_gemms", "forward_gemms", "forward_weight",
           "group_numerics_key", "input_key", "layer_plan", "make_gemm_plan", "mxfp4_gemm", "numerics_key",
           "quantize_input", "run_backward", "run_forward"]
