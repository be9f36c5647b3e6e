"""A precision schedule: where and when a model leaves MXFP4 (BF16 blocks and a BF16 phase).

The per-GEMM numerics are an ``AdaHOPConfig``; a schedule says which layers stay BF16 and when
GEMMs switch to BF16 for the rest of a run. A recipe (``adahop.recipes``) is the two together.

- ``bf16_blocks = (first, last)``: the linears of the first ``first`` and the last ``last``
  transformer blocks are not converted and run as BF16 ``nn.Linear`` (``module_filter``). NVIDIA's
  NVFP4 recipe keeps about 16% of its linears in BF16 this way (the first 2 and the last 8 blocks
  of a 12B model), torchtitan's NVFP4 converter the last 15% of the blocks.
- ``bf16_phase_start = f`` with ``bf16_phase_gemms``: once ``floor(f * total_steps)`` steps are
  done, the listed GEMMs of every converted layer switch to BF16 for the rest of the run
  (``apply``). Switching the forward alone for the last ~18% of the tokens took NVIDIA's
  MXFP4-vs-BF16 gap from 1.5% to 0.5% of the loss ("most of the gap comes from forward-pass
  quantization").

In any training loop, one call before each step::

    schedule.apply(model, step, total_steps)   # step: the optimizer steps done, from 0

The switch is a pure function of the step and the schedule, and the switched modes are the
layers' own state (in a checkpoint's state_dict): a run killed before the switch resumes and
switches at the same step; one killed after it resumes switched (``apply`` then changes nothing).
The first switched step must come after the calibration (``check_run``), so that no layer is
still choosing its modes when the phase begins.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

from torch import nn

from adahop.convert import MIN_FEATURES, adahop_layers, default_module_filter
from adahop.policy import GEMMS

# The names under which models keep their transformer blocks: adahop's Llama, Hugging Face's
# Llama-likes (``model.layers``) and torchtitan's (``layers``, a ModuleDict); GPT-2 (``transformer.h``);
# others' ``blocks``.
BLOCK_CONTAINER_NAMES = ("layers", "h", "blocks")


def check_bf16_blocks(value) -> tuple[int, int]:
    """``(first, last)``, two ints >= 0 (a JSON list reads too)."""
    if (not isinstance(value, (tuple, list)) or len(value) != 2
            or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in value)):
        raise ValueError(f"bf16_blocks must be (first, last), two ints >= 0, got {value!r}")
    return int(value[0]), int(value[1])


def check_bf16_phase(start, gemms) -> tuple[float | None, tuple[str, ...]]:
    """``start``: None (no phase) or a fraction in (0, 1); ``gemms``: a non-empty subset of
    fprop, dgrad, wgrad (a JSON list reads too)."""
    if start is not None and (isinstance(start, bool) or not isinstance(start, (int, float))
                              or not math.isfinite(start) or not 0 < start < 1):
        raise ValueError(f"bf16_phase_start must be None or a fraction of the steps in (0, 1), got {start!r}")
    if (not isinstance(gemms, (tuple, list)) or not gemms or len(set(gemms)) != len(gemms)
            or any(g not in GEMMS for g in gemms)):
        raise ValueError(f"bf16_phase_gemms must be a non-empty subset of {GEMMS}, got {gemms!r}")
    return (None if start is None else float(start)), tuple(gemms)


def phase_switch_step(steps: int, start: float | None) -> int | None:
    """The number of completed steps after which the BF16 phase begins, ``floor(start * steps)``
    (None: no phase). ``start`` counts as the decimal it prints as (0.82 is 41/50), so that
    0.82 of 300 steps is 246, not the 245 of float arithmetic (0.82 * 300 = 245.99999999999997)."""
    return None if start is None else math.floor(_decimal(start) * steps)


def _decimal(start: float) -> Fraction:
    return Fraction(repr(float(start)))


def calibrated_after(calibration_steps: int, grad_accum: int = 1) -> int:
    """The optimizer steps the calibration takes: a calibration step is a backward pass."""
    return math.ceil(calibration_steps / grad_accum)


def fewest_steps_for_phase(start: float, calibration_steps: int, grad_accum: int = 1) -> int:
    """The fewest steps of a run whose BF16 phase from ``start`` begins after the calibration:
    the least n with floor(start * n) >= calibrated_after, i.e. ceil(calibrated_after / start)."""
    return math.ceil(calibrated_after(calibration_steps, grad_accum) / _decimal(start))


def apply_bf16_phase(model: nn.Module, gemms: tuple[str, ...]) -> list[str]:
    """Switch ``gemms`` of every converted layer to BF16, keeping its other modes, its patterns
    and the OE k its policy chose for the GEMMs that stay in MXFP4 (a switched GEMM's k goes: it
    runs no OE). Each layer records the switched GEMMs (``scheduled_bf16``: drift does not count
    them as the policy's). Returns the layers that changed (none when they were switched already:
    a resumed run)."""
    changed = []
    for fqn, layer in adahop_layers(model).items():
        if layer.calibrating:
            raise ValueError(f"layer {fqn!r} is still calibrating when the BF16 phase begins")
        layer.scheduled_bf16 = tuple(gemms)
        modes = dict(layer.modes)
        new = {**modes, **{g: "bf16" for g in gemms}}
        if new != modes:
            oe_ks = {g: k for g, k in (layer.oe_ks or {}).items() if new[g] != "bf16"}
            layer.set_modes(new, layer.patterns, oe_ks=oe_ks or None)
            changed.append(fqn)
    return changed


def transformer_blocks(model: nn.Module) -> list[str]:
    """The fully qualified names of the model's transformer blocks, in order: the children of its
    one non-empty ``nn.ModuleList`` or ``nn.ModuleDict`` named as in ``BLOCK_CONTAINER_NAMES``
    (``layers`` of adahop's Llama and torchtitan's models, ``model.layers`` of Hugging Face's
    Llama-likes, ``transformer.h`` of GPT-2). Raises ValueError naming what it found where that is
    not exactly one."""
    found = [(name, mod) for name, mod in model.named_modules()
             if name.rsplit(".", 1)[-1] in BLOCK_CONTAINER_NAMES and isinstance(mod, (nn.ModuleList, nn.ModuleDict))
             and len(mod) > 0]
    if len(found) != 1:
        what = ", ".join(name for name, _ in found) or "none"
        raise ValueError(f"bf16_blocks needs one list of transformer blocks named {'/'.join(BLOCK_CONTAINER_NAMES)} "
                         f"(a ModuleList or ModuleDict); {type(model).__name__} has {what}")
    prefix, blocks = found[0]
    keys = list(blocks.keys()) if isinstance(blocks, nn.ModuleDict) else [str(i) for i in range(len(blocks))]
    return [f"{prefix}.{key}" for key in keys]


def block_filter(model: nn.Module, bf16_blocks: tuple[int, int], min_features: int = MIN_FEATURES):
    """The ``module_filter_fn`` that converts what the default filter converts (at the size rule's
    ``min_features``), except the linears of the first and last blocks ``bf16_blocks`` names
    (``transformer_blocks``: by position in the model's list of blocks)."""
    first, last = bf16_blocks
    default = default_module_filter(model, min_features=min_features)
    if first == last == 0:
        return default
    blocks = transformer_blocks(model)
    n = len(blocks)
    if first + last > n:
        raise ValueError(f"bf16_blocks {bf16_blocks} keeps more blocks in BF16 than the model has ({n})")
    kept = tuple(f"{name}." for name in blocks[:first] + blocks[n - last:])

    def keep(mod: nn.Module, fqn: str) -> bool:
        return default(mod, fqn) and not fqn.startswith(kept)

    return keep


@dataclass(frozen=True)
class PrecisionSchedule:
    """Where and when a model leaves MXFP4; checked once, when it is made. The default is no
    schedule: every converted GEMM in its recipe's numerics for the whole run."""

    # None: no BF16 phase; else the fraction of the steps after which bf16_phase_gemms run BF16
    bf16_phase_start: float | None = None
    bf16_phase_gemms: tuple[str, ...] = GEMMS
    bf16_blocks: tuple[int, int] = (0, 0)  # the first and last blocks' linears stay BF16

    def __post_init__(self):
        start, gemms = check_bf16_phase(self.bf16_phase_start, self.bf16_phase_gemms)
        object.__setattr__(self, "bf16_phase_start", start)
        object.__setattr__(self, "bf16_phase_gemms", gemms)
        object.__setattr__(self, "bf16_blocks", check_bf16_blocks(self.bf16_blocks))

    @property
    def has_phase(self) -> bool:
        return self.bf16_phase_start is not None

    def describe(self) -> str:
        """The phase in words, e.g. "fprop BF16 from 82%" ("" without one)."""
        if not self.has_phase:
            return ""
        return f"{'/'.join(self.bf16_phase_gemms)} BF16 from {self.bf16_phase_start:.0%}"

    def switch_step(self, total_steps: int) -> int | None:
        """The steps done when the phase begins in a run of ``total_steps`` (None: no phase)."""
        return phase_switch_step(total_steps, self.bf16_phase_start)

    def fewest_steps(self, calibration_steps: int, grad_accum: int = 1) -> int:
        """The fewest steps of a run whose phase begins after ``calibration_steps`` calibration
        steps (backward passes; ``grad_accum`` of them a step); 1 without a phase."""
        if not self.has_phase:
            return 1
        return fewest_steps_for_phase(self.bf16_phase_start, calibration_steps, grad_accum)

    def check_run(self, total_steps: int, calibration_steps: int | None, grad_accum: int = 1) -> None:
        """A ValueError unless the phase of a run of ``total_steps`` begins after the calibration
        (``calibration_steps``; None: the numerics do not calibrate)."""
        k = self.switch_step(total_steps)
        if k is None or calibration_steps is None:
            return
        after = calibrated_after(calibration_steps, grad_accum)
        if k < after:
            raise ValueError(f"bf16_phase_start {self.bf16_phase_start} begins the BF16 phase after step {k}, before "
                             f"the calibration ends (step {after}); start it later, or give at least "
                             f"{self.fewest_steps(calibration_steps, grad_accum)} steps")

    def module_filter(self, model: nn.Module, min_features: int = MIN_FEATURES):
        """The ``module_filter_fn`` for ``convert_to_adahop_training`` that keeps
        ``bf16_blocks`` unconverted (``block_filter``)."""
        return block_filter(model, self.bf16_blocks, min_features)

    def apply(self, model: nn.Module, step: int, total_steps: int) -> list[str]:
        """Call before each optimizer step (``step``: the steps done, from 0): from the phase's
        switch step on, the phase's GEMMs of every converted layer run BF16. Returns the layers
        switched by this call (none before the switch and after it, when they are switched
        already, as in a resumed run)."""
        k = self.switch_step(total_steps)
        if k is None or step < k:
            return []
        return apply_bf16_phase(model, self.bf16_phase_gemms)


NO_SCHEDULE = PrecisionSchedule()
