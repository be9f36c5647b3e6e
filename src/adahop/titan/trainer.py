"""``AdaHOPTrainer``: torchtitan's ``Trainer`` training an AdaHOP model (imports torchtitan:
``pip install "adahop[titan]"``).

It converts the model's block linears (``AdaHOPConverter``) when it is made, from the final
config (command-line flags included), installs ``AdaHOPHook`` (the precision schedule over
``--training.steps``, the modes file) as the model's ``post_optimizer_build_fn``, and runs each
training step through an ``adahop.Calibrator``: each forward and backward of the step inside
the calibrator's ``split``, so that a data-parallel run (FSDP2 or DDP over torchtitan's batch
mesh) merges the ranks' calibration before the freeze and interleaves their stochastic
rounding, as ``adahop train`` does. Its options are ``--adahop.*`` flags (``AdaHOPOptions``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from torchtitan.trainer import Trainer

from adahop.calibration import Calibrator
from adahop.convert import adahop_layers, is_calibrated
from adahop.recipes import recipe as get_recipe
from adahop.titan.hooks import AdaHOPHook
from adahop.titan.linear import AdaHOPConverter


@dataclass(kw_only=True, slots=True)
class AdaHOPOptions:
    recipe: str = "adahop_lv2_tail"
    """An adahop recipe (numerics and precision schedule): adahop_lv2_tail, adahop_lv2, mxfp4, bf16, ..."""
    calibration_steps: int | None = None
    """Calibration steps of an adaptive recipe (None: the recipe's own)."""
    calibration_micro_batches: int = 1
    """Parts each micro-batch of a calibrating step runs as (the calibration's activation memory / parts)."""
    modes_file: str = "adahop_modes.json"
    """Where the calibrated modes are kept, under dump_folder ('' keeps none: a resumed run recalibrates)."""


def _chain(first, second):
    """Two ``post_optimizer_build_fn``s as one (the model's own, then adahop's)."""
    if first is None:
        return second

    def both(optimizers, model_parts, parallel_dims):
        first(optimizers, model_parts, parallel_dims)
        second(optimizers, model_parts, parallel_dims)

    return both


class AdaHOPTrainer(Trainer):
    """torchtitan's ``Trainer`` with the model's block linears in AdaHOP (module doc)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        adahop: AdaHOPOptions = field(default_factory=AdaHOPOptions)

    def __init__(self, config: Config):
        opts = config.adahop
        overrides = {} if opts.calibration_steps is None else {"calibration_steps": opts.calibration_steps}
        r = get_recipe(opts.recipe, **overrides)
        # (grad_accum 1: the calibration ends by calibration_steps optimizer steps at the latest)
        r.check_run(config.training.steps)
        spec = config.model_spec
        spec.model = AdaHOPConverter.Config(recipe=opts.recipe, config_overrides=overrides).build().convert(spec.model)
        modes_file = os.path.join(config.dump_folder, opts.modes_file) if opts.modes_file else None
        self.adahop_hook = AdaHOPHook(r.schedule, config.training.steps, modes_file, calibrator=True)
        spec.post_optimizer_build_fn = _chain(spec.post_optimizer_build_fn, self.adahop_hook)
        self._calibrator: Calibrator | None = None
        self._calibrator_made = False
        self._calibration_step = None
        super().__init__(config)

    def _make_calibrator(self) -> Calibrator | None:
        """The calibrator over the batch mesh (made at the first step: after the checkpoint and
        the modes file are loaded); None with pipeline parallelism, which runs no split."""
        if self.parallel_dims.pp_enabled:
            if any(m.calibrating for part in self.model_parts for m in adahop_layers(part).values()):
                raise ValueError("AdaHOP layers calibrating under pipeline parallelism: calibrate without it "
                                 "first (the modes file then loads), or use a fixed recipe")
            return None
        group = self.parallel_dims.get_mesh("batch").get_group() if self.parallel_dims.dp_enabled else None
        return Calibrator(self.model_parts[0], group, micro_batches=self.config.adahop.calibration_micro_batches)

    def train_step(self, data_iterator):
        if not self._calibrator_made:
            self._calibrator = self._make_calibrator()
            self._calibrator_made = True
        if self._calibrator is None or (not self._calibrator.distributed and is_calibrated(self.model_parts[0])):
            return super().train_step(data_iterator)  # (nothing left for it to do in one process)
        with self._calibrator.step(self.step) as self._calibration_step:
            try:
                return super().train_step(data_iterator)
            finally:
                self._calibration_step = None

    def forward_backward_step(self, *, input_dict, labels, global_valid_tokens):
        step = self._calibration_step
        if step is None:
            return super().forward_backward_step(input_dict=input_dict, labels=labels,
                                                 global_valid_tokens=global_valid_tokens)
        # The loss is the local sum over the global token count: the parts' losses add up.
        loss = None
        for part_inputs, part_labels in step.split(input_dict, labels):
            part_loss = super().forward_backward_step(input_dict=part_inputs, labels=part_labels,
                                                      global_valid_tokens=global_valid_tokens)
            loss = part_loss if loss is None else loss + part_loss
        return loss
