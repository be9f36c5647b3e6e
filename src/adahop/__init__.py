"""adahop: LLM training with MXFP4 GEMMs at BF16 quality (AdaHOP, arXiv 2604.02525).

The library, the API a training loop of your own uses (what this module exports, and its
packages), bottom to top: formats (MXFP4) and gemm_geometry -> transforms (Hadamard, the operand
spec) -> patterns (detection, calibration) -> policy (strategy tables) -> kernels (Triton) and ops
(the dispatch: a registry of backends, reference, triton, hopper_fp8, native_mx) -> config -> layer
(the plan, the GEMMs, the torch.library ops) -> linear (the module) -> convert, modes_io, drift, hf,
calibration (the ``Calibrator``), quantized_all_gather (FSDP2), oscillation -> schedule (BF16 phase
and blocks) -> recipes (numerics + schedule, ``adahop.recipe``) and hf_trainer (the Hugging Face
Trainer's callback; imported on its own, it needs transformers) and titan (torchtitan: imported by
nothing here, its modules that import torchtitan only on demand); atomic_io (safe file writes) and
safe_paths below all.

The harness, the ``adahop`` program built on the library and not needed to use it, bottom to top:
data (sources, tokenizers, corpus, zero-shot tasks) -> llama (adahop's Llama, pretrained weights)
-> train (the trainer) -> analyze (the outlier study) -> cli. The library never imports the
harness (tests/test_layout.py).
"""

from adahop.calibration import Calibrator
from adahop.config import RECIPES, AdaHOPConfig, GemmConfig
from adahop.convert import (
    adahop_layers,
    calibration_parts,
    convert_to_adahop_training,
    finish_calibration,
    is_calibrated,
)
from adahop.formats.mxfp4 import MXFP4Tensor, dequantize_mxfp4, fake_quantize_mxfp4, quantize_mxfp4
from adahop.linear import AdaHOPLinear
from adahop.modes_io import load_modes, save_modes
from adahop.patterns.detect import detect_outlier_pattern
from adahop.policy import modes_from_patterns
from adahop.recipes import Recipe, recipe
from adahop.schedule import PrecisionSchedule
from adahop.transforms.hadamard import block_hadamard, inverse_block_hadamard

__version__ = "0.1.0"

__all__ = [
    "RECIPES",
    "AdaHOPConfig",
    "AdaHOPLinear",
    "Calibrator",
    "GemmConfig",
    "MXFP4Tensor",
    "PrecisionSchedule",
    "Recipe",
    "adahop_layers",
    "block_hadamard",
    "convert_to_adahop_training",
    "dequantize_mxfp4",
    "detect_outlier_pattern",
    "fake_quantize_mxfp4",
    "calibration_parts",
    "finish_calibration",
    "inverse_block_hadamard",
    "is_calibrated",
    "load_modes",
    "modes_from_patterns",
    "quantize_mxfp4",
    "recipe",
    "save_modes",
]
