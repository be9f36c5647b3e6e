"""Where and when the training run leaves MXFP4: BF16 blocks and a BF16 phase.

Two training-side options of ``TrainConfig`` (the per-GEMM numerics stay in ``AdaHOPConfig``):

- ``bf16_blocks = (first, last)``: the linears of the first ``first`` and the last ``last``
  transformer blocks are not converted and run as BF16 ``nn.Linear``. NVIDIA's NVFP4 recipe keeps
  about 16% of its linears in BF16 this way (the first 2 and the last 8 blocks of a 12B model),
  torchtitan's NVFP4 converter the last 15% of the blocks.
- ``bf16_phase_start = f`` with ``bf16_phase_gemms``: once ``floor(f * steps)`` steps are done,
  the listed GEMMs of every converted layer switch to BF16 for the rest of the run. Switching the
  forward alone for the last ~18% of the tokens took NVIDIA's MXFP4-vs-BF16 gap from 1.5% to
  0.5% of the loss ("most of the gap comes from forward-pass quantization").

The switch is a pure function of the step and the config, applied before the step runs, and the
switched modes are the layers' own state (in the checkpoint): a run killed before the switch
resumes and switches at the same step; one killed after it resumes switched. The first switched
step must come after the calibration (``validate_schedule``), so that no layer is still choosing
its modes when the phase begins.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

from torch import nn

from adahop.convert import MIN_FEATURES, adahop_layers, default_module_filter
from adahop.policy import GEMMS

_BLOCK = re.compile(r"^layers\.(\d+)\.")


def check_bf16_blocks(value) -> tuple[int, int]:
    """``(first, last)``, two ints >= 0 (a JSON list reads too)."""
    if (not isinstance(value, (tuple, list)) or len(value) != 2
            or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in value)):
        raise ValueError(f"bf16_blocks must be (first, last), two ints >= 0, got {value!r}")
    return int(value[0]), int(value[1])


def check_bf16_phase(start, gemms) -> tuple[float | None, tuple[str, ...]]:
    """``start``: None (no phase) or a fraction in (0, 1); ``gemms``: a non-empty subset of
    fprop, dgrad, wgrad."""
    if start is not None and (isinstance(start, bool) or not isinstance(start, (int, float))
                              or not math.isfinite(start) or not 0 < start < 1):
        raise ValueError(f"bf16_phase_start must be None or a fraction of the steps in (0, 1), got {start!r}")
    if (not isinstance(gemms, (tuple, list)) or not gemms or len(set(gemms)) != len(gemms)
            or any(g not in GEMMS for g in gemms)):
        raise ValueError(f"bf16_phase_gemms must be a non-empty subset of {GEMMS}, got {gemms!r}")
    return (None if start is None else float(start)), tuple(gemms)


def block_filter(model: nn.Module, bf16_blocks: tuple[int, int], min_features: int = MIN_FEATURES):
    """The ``module_filter_fn`` that converts what the default filter converts (at the size rule's
    ``min_features``), except the linears of the first and last blocks ``bf16_blocks`` names. The
    blocks are the model's ``layers`` (adahop's Llama; fqns ``layers.<i>.``)."""
    first, last = bf16_blocks
    default = default_module_filter(model, min_features=min_features)
    if first == last == 0:
        return default
    blocks = getattr(model, "layers", None)
    if not isinstance(blocks, nn.ModuleList):
        raise ValueError("bf16_blocks needs a model whose transformer blocks are its `layers` ModuleList "
                         f"(adahop's Llama); {type(model).__name__} has none")
    n = len(blocks)
    if first + last > n:
        raise ValueError(f"bf16_blocks {bf16_blocks} keeps more blocks in BF16 than the model has ({n})")
    kept = set(range(first)) | set(range(n - last, n))

    def keep(mod: nn.Module, fqn: str) -> bool:
        m = _BLOCK.match(fqn)
        return default(mod, fqn) and not (m and int(m.group(1)) in kept)

    return keep


def phase_switch_step(steps: int, start: float | None) -> int | None:
    """The number of completed steps after which the BF16 phase begins, ``floor(start * steps)``
    (None: no phase). ``start`` counts as the decimal it prints as (0.82 is 41/50), so that
    0.82 of 300 steps is 246, not the 245 of float arithmetic (0.82 * 300 = 245.99999999999997)."""
    return None if start is None else math.floor(_decimal(start) * steps)


def _decimal(start: float) -> Fraction:
    return Fraction(repr(float(start)))


def calibrated_after(calibration_steps: int, grad_accum: int) -> int:
    """The optimizer steps the calibration takes: a calibration step is a backward pass."""
    return math.ceil(calibration_steps / grad_accum)


def fewest_steps_for_phase(start: float, calibration_steps: int, grad_accum: int) -> int:
    """The fewest steps of a run whose BF16 phase from ``start`` begins after the calibration:
    the least n with floor(start * n) >= calibrated_after, i.e. ceil(calibrated_after / start)."""
    return math.ceil(calibrated_after(calibration_steps, grad_accum) / _decimal(start))


def validate_schedule(steps: int, grad_accum: int, start: float | None, calibration_steps: int | None) -> None:
    """A BF16 phase must begin after the calibration, which ends after ``calibrated_after``
    optimizer steps."""
    k = phase_switch_step(steps, start)
    if k is None or calibration_steps is None:
        return
    if k < calibrated_after(calibration_steps, grad_accum):
        raise ValueError(f"bf16_phase_start {start} begins the BF16 phase after step {k}, before the calibration "
                         f"ends (step {calibrated_after(calibration_steps, grad_accum)}); start it later")


def apply_bf16_phase(model: nn.Module, gemms: tuple[str, ...]) -> list[str]:
    """Switch ``gemms`` of every converted layer to BF16, keeping its other modes. Returns the
    layers that changed (none when they were switched already: a resumed run)."""
    changed = []
    for fqn, layer in adahop_layers(model).items():
        if layer.calibrating:
            raise ValueError(f"layer {fqn!r} is still calibrating when the BF16 phase begins")
        modes = dict(layer.modes)
        new = {**modes, **{g: "bf16" for g in gemms}}
        if new != modes:
            layer.set_modes(new, layer.patterns)
            changed.append(fqn)
    return changed


# The outer dim each OE mode selects its k high-precision slices from, as a function of the
# GEMM's (T, N, K) (layer_ops: fprop y = x w^T, dgrad dx = g w, wgrad dw = g^T x).
_OE_OUTER = {
    ("fprop", "iht+oe_left"): 0, ("fprop", "iht+oe_right"): 1,
    ("dgrad", "iht+oe_left"): 0, ("dgrad", "iht+oe_right"): 2,
    ("wgrad", "iht+oe_right"): 2,
}


def mxfp4_flop_share(model: nn.Module, tokens: int, calibrating: set[str] | None = None,
                     gemms: tuple[str, ...] = GEMMS) -> float:
    """The share of one training step's linear-layer GEMM FLOPs that run in MXFP4, with the
    modes the layers have now; ``gemms``: of those GEMMs alone (("fprop",): an evaluation's).

    Every ``nn.Linear`` counts, converted or not (an LM head or a BF16 block is high precision),
    each with its three GEMMs of ``2 * tokens * N * K`` FLOPs. A GEMM in an MXFP4 mode counts
    but for its OE slices (k of the outer dim it selects from, in high precision). The layers
    named in ``calibrating`` (default: those calibrating now) count as their calibration runs
    them: nothing in MXFP4 under ``calibration_gemms="bf16"``, all of it under "iht"."""
    from adahop.linear import AdaHOPLinear

    layers = adahop_layers(model)
    if calibrating is None:
        calibrating = {fqn for fqn, layer in layers.items() if layer.calibrating}
    total = low = 0.0
    for fqn, mod in model.named_modules():
        if not isinstance(mod, (nn.Linear, AdaHOPLinear)):
            continue
        n, k = mod.out_features, mod.in_features
        flops = 2.0 * tokens * n * k
        total += len(gemms) * flops
        if not isinstance(mod, AdaHOPLinear):
            continue
        if fqn in calibrating:
            low += len(gemms) * flops if mod.config.calibration_gemms == "iht" else 0.0
            continue
        for gemm in gemms:
            mode = mod.modes[gemm]
            if mode == "bf16":
                continue
            outer = _OE_OUTER.get((gemm, mode))
            hp = 0.0
            if outer is not None:
                size = (tokens, n, k)[outer]
                hp = min((mod.oe_ks or {}).get(gemm, mod.config.gemm(gemm).oe_k), size) / size
            low += flops * (1 - hp)
    return low / total if total else 0.0
