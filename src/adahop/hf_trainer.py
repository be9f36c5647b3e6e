"""Training a converted ``transformers`` model with the Hugging Face ``Trainer``: ``AdaHOPCallback``.

Convert the model first, then build the ``Trainer`` with the callback::

    r = adahop.recipe("adahop_lv2_tail")
    model = LlamaForCausalLM(config)                        # or from_pretrained(...)
    adahop.convert_to_adahop_training(model, config=r.config)
    trainer = Trainer(model=model, args=TrainingArguments(..., bf16=True, gradient_accumulation_steps=2),
                      train_dataset=..., callbacks=[AdaHOPCallback(r.schedule)])
    trainer.train()
    model = adahop.hf.from_pretrained(LlamaForCausalLM, "out/checkpoint-100")   # with its modes

The conversion comes before the ``Trainer`` (before accelerate's ``prepare()``, which the Trainer
calls in ``train()``): the DDP wrapper and the optimizer must see the AdaHOP layers, and
accelerate has no hook to convert a model for a number format of its own (its FP8 backends are a
closed list).

What the callback does, each from one of the Trainer's events:

* **Calibration in the Trainer's own steps.** In one process the layers calibrate in their first
  forwards and backwards and freeze themselves; nothing is needed. With gradient accumulation each
  micro-batch is a forward and backward, so one calibration step (``calibration_steps`` counts
  backward passes, as in ``adahop train``) and one SR call: a run with ``gradient_accumulation_steps
  = 2`` calibrates in half as many optimizer steps, and a layer may freeze between two micro-batches
  of one step (the next runs its frozen modes), as ``adahop train`` does. Under DDP (``torchrun``
  / ``accelerate launch``, several processes) the callback runs the library's ``Calibrator``
  around each micro-batch (its ``before_pass`` at ``on_step_begin`` and ``on_substep_end``, its
  ``after_pass`` at ``on_substep_end`` and ``on_pre_optimizer_step``): the ranks' observations
  are merged after each backward and every rank freezes the same modes, and each rank draws its
  own SR numbers. That needs ``ddp_broadcast_buffers=False`` (an SR counter is a per-rank buffer),
  refused otherwise. FSDP and DeepSpeed through the Trainer are refused: not run with adahop yet.
* **The precision schedule** (``PrecisionSchedule.apply``) at ``on_step_begin``, from the
  Trainer's ``global_step`` and ``max_steps``; the run is checked at ``on_train_begin`` to begin
  its BF16 phase after the calibration.
* **Logging**: each log record gets ``adahop/calibrating_layers`` and, once every layer froze,
  the count of layers per GEMM and mode (``adahop/modes/fprop/iht``, ...), in the logs the
  callbacks after this one see and in ``trainer.state.log_history``; the freeze is logged once
  (``logging``, logger ``adahop.hf_trainer``) with the modes.
* **Checkpoints**: the model's own ``save_pretrained``, which the Trainer calls for each
  checkpoint and in ``save_model``, is made to save as ``adahop.hf.save_pretrained`` does
  (``adahop.hf.install_save_pretrained``: the weights, ``adahop_config.json``,
  ``adahop_modes.json`` once calibrated), so ``adahop.hf.from_pretrained`` loads a checkpoint
  with its modes. ``on_save`` adds ``adahop_state.json`` to the checkpoint: every layer's state
  (calibration so far, modes, SR counter), which ``trainer.train(resume_from_checkpoint=...)``
  restores at ``on_train_begin``, so a resumed run goes on as the uninterrupted one would.

Not supported: gradient checkpointing (a recomputed forward would be observed and counted twice),
refused at ``on_train_begin``. Needs ``pip install "adahop[hf]"`` (transformers, accelerate).
"""

from __future__ import annotations

import json
import logging
import os
import warnings
from collections import Counter
from pathlib import Path

from torch import nn

from adahop.atomic_io import atomic_write_bytes
from adahop.calibration import Calibrator
from adahop.convert import adahop_layers, is_calibrated
from adahop.hf import install_save_pretrained
from adahop.policy import GEMMS
from adahop.schedule import NO_SCHEDULE, PrecisionSchedule

try:
    from transformers import TrainerCallback
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
except ImportError as e:  # pragma: no cover - the hf extra is part of the test install
    raise ImportError('adahop.hf_trainer needs transformers and accelerate: pip install "adahop[hf]"') from e

logger = logging.getLogger(__name__)

STATE_FILE = "adahop_state.json"
STATE_FORMAT = "adahop-trainer-state"
STATE_FORMAT_VERSION = 1


def calibration_logs(model: nn.Module) -> dict[str, int]:
    """What the callback adds to a log record: the layers still calibrating and, once none is,
    the number of layers per GEMM and mode (``adahop/modes/<gemm>/<mode>``)."""
    layers = adahop_layers(model).values()
    logs = {"adahop/calibrating_layers": sum(layer.calibrating for layer in layers)}
    if not logs["adahop/calibrating_layers"]:
        counts = Counter((g, layer.modes[g]) for layer in layers for g in GEMMS)
        logs.update({f"adahop/modes/{g}/{mode}": n for (g, mode), n in sorted(counts.items())})
    return logs


def resumed_folders(args, state) -> list[Path]:
    """Where a resumed run's checkpoint is: ``args.resume_from_checkpoint`` when it names a folder,
    then the Trainer's checkpoint of the resumed step (what ``train(resume_from_checkpoint=True)``
    picks; a path passed to ``train()`` itself is not given to callbacks)."""
    given = args.resume_from_checkpoint
    folders = [Path(given)] if isinstance(given, (str, os.PathLike)) and Path(given).is_dir() else []
    return folders + [checkpoint_folder(args, state)]


def checkpoint_folder(args, state) -> Path:
    """The folder of the Trainer's checkpoint at ``state.global_step`` (``output_dir/checkpoint-N``)."""
    return Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"


class AdaHOPCallback(TrainerCallback):
    """The ``transformers.TrainerCallback`` that trains a converted model in the ``Trainer``:
    calibration (merged across DDP ranks), the precision ``schedule``, logs, and checkpoints that
    keep the modes (module doc). One per Trainer.

    After training, in optimizer steps done (the Trainer's ``global_step``): ``switched_at``,
    when the BF16 phase began (``schedule.switch_step(max_steps)``; None: not in this run), and
    ``calibrated_at``, when the last layer had frozen (at the end of the step in which it froze;
    None: not in this run)."""

    def __init__(self, schedule: PrecisionSchedule = NO_SCHEDULE):
        if not isinstance(schedule, PrecisionSchedule):
            raise ValueError(f"schedule must be an adahop.PrecisionSchedule (a recipe's .schedule), got {schedule!r}")
        self.schedule = schedule
        self.calibrator: Calibrator | None = None
        self._layers: list = []
        self._calibrating = False  # a layer calibrates (known at each pass's end)
        self.switched_at: int | None = None
        self.calibrated_at: int | None = None

    # ---- start ----------------------------------------------------------------------------------------
    def on_init_end(self, args, state, control, model=None, **kwargs):
        install_save_pretrained(self._converted(model))

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        model = self._converted(model)
        install_save_pretrained(model)  # (again: a callback added after the Trainer's init saw no on_init_end)
        self._check_args(args, model)
        if state.global_step > 0:
            self._restore(model, resumed_folders(args, state), args.world_size)
        self._layers = list(adahop_layers(model).values())
        calibrating = [layer.config.calibration_steps for layer in self._layers if layer.calibrating]
        calibration = max(calibrating) if calibrating else None  # (None: the modes are frozen already)
        self.schedule.check_run(state.max_steps, calibration, args.gradient_accumulation_steps * args.world_size)
        self.calibrator = Calibrator(model, checked_at="at the start of the Trainer's training")
        if self.calibrator.world != args.world_size:
            raise ValueError(f"the Trainer runs {args.world_size} processes but torch.distributed's default group "
                             f"has {self.calibrator.world}: AdaHOPCallback merges the calibration over that group")
        self._calibrating = bool(calibrating)

    @staticmethod
    def _converted(model):
        if model is None or not adahop_layers(model):
            raise ValueError("AdaHOPCallback needs a model converted before the Trainer is built "
                             "(adahop.convert_to_adahop_training(model, config=...)); this one has no AdaHOPLinear")
        return model

    @staticmethod
    def _check_args(args, model) -> None:
        # (the argument is activation_checkpointing from transformers 5, gradient_checkpointing before; the
        # model's layers say it whichever way it was enabled)
        asked = getattr(args, "activation_checkpointing", None) or getattr(args, "gradient_checkpointing", False)
        if asked or any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules()):
            raise ValueError("AdaHOPCallback does not support gradient checkpointing: a recomputed forward would be "
                             "observed and counted as a call of its own; train without gradient_checkpointing")
        if args.fsdp or getattr(args, "deepspeed", None):
            raise ValueError("AdaHOPCallback runs in one process or under DDP; FSDP and DeepSpeed through the Trainer "
                             "are not supported (for FSDP2, see docs/distributed.md: a loop of your own)")
        if args.n_gpu > 1:
            raise ValueError(f"the Trainer would run nn.DataParallel over {args.n_gpu} GPUs in one process, whose "
                             "replicas would share one calibration from several threads; launch one process per GPU "
                             "(torchrun / accelerate launch: DDP)")
        if args.world_size > 1 and args.ddp_broadcast_buffers is not False:
            raise ValueError("under DDP, pass TrainingArguments(ddp_broadcast_buffers=False): an AdaHOP layer's "
                             "stochastic-rounding counter is a buffer of its own on each rank, which DDP would "
                             "overwrite with rank 0's before each forward")

    # ---- each step ------------------------------------------------------------------------------------
    def on_step_begin(self, args, state, control, model=None, **kwargs):
        if self.schedule.apply(model, state.global_step, state.max_steps):
            self.switched_at = state.global_step
            logger.info("adahop: %s, from global step %d on", self.schedule.describe(), state.global_step)
        self.calibrator.before_pass()

    def on_substep_end(self, args, state, control, model=None, **kwargs):
        # between two micro-batches of one optimizer step: the first's backward is done
        self._after_pass(state, model)
        self.calibrator.before_pass()

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self._after_pass(state, model)

    def _after_pass(self, state, model) -> None:
        self.calibrator.after_pass(state.global_step + 1)
        if self._calibrating and not any(layer.calibrating for layer in self._layers):
            self._calibrating = False
            self.calibrated_at = state.global_step + 1  # (the steps done once this one ends)
            logs = calibration_logs(model)
            modes = ", ".join(f"{k.removeprefix('adahop/modes/')}: {n}" for k, n in logs.items() if "/modes/" in k)
            logger.info("adahop: every layer calibrated by the end of step %d; layers per GEMM/mode: %s",
                        self.calibrated_at, modes)

    def on_log(self, args, state, control, logs=None, model=None, **kwargs):
        if logs is None or model is None:
            return
        ours = calibration_logs(model)
        logs.update(ours)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(ours)  # (the Trainer recorded the logs before calling the callbacks)

    # ---- checkpoints ----------------------------------------------------------------------------------
    def on_save(self, args, state, control, model=None, **kwargs):
        if not state.is_world_process_zero:
            return
        folder = checkpoint_folder(args, state)
        if not folder.is_dir():
            warnings.warn(f"AdaHOPCallback: no checkpoint folder {folder} to write {STATE_FILE} into; a run resumed "
                          "from this checkpoint would calibrate afresh", stacklevel=2)
            return
        world = args.world_size
        layers = {}
        for fqn, layer in adahop_layers(model).items():
            entry = layer.get_extra_state()
            # the SR calls of one rank's stream (rank 0's counter, ceil(calls / W)): what every rank resumes from
            entry["passes"] = -(-entry.pop("calls") // world)
            layers[fqn] = entry
        meta = {"format": STATE_FORMAT, "format_version": STATE_FORMAT_VERSION, "world_size": world, "layers": layers}
        atomic_write_bytes(folder / STATE_FILE, (json.dumps(meta, indent=1) + "\n").encode())

    @staticmethod
    def _restore(model: nn.Module, folders: list[Path], world: int) -> None:
        """A resumed run: every layer's state from the checkpoint's ``adahop_state.json``, its SR
        counter where this rank's stream goes on (``Calibrator`` reads it)."""
        file = next((f / STATE_FILE for f in folders if (f / STATE_FILE).is_file()), None)
        if file is None:
            if is_calibrated(model):
                return  # the modes came with the model (adahop.hf.from_pretrained, load_modes)
            looked = " or ".join(str(f / STATE_FILE) for f in folders)
            raise ValueError(f"resuming at a global step > 0 without {looked}: the AdaHOP layers would calibrate "
                             "afresh in the middle of the run; resume from a "
                             "checkpoint AdaHOPCallback saved, in output_dir or named by "
                             "TrainingArguments(resume_from_checkpoint=...)")
        try:
            meta = json.loads(file.read_text())
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"{file} is not valid JSON: {e}") from None
        if not isinstance(meta, dict) or meta.get("format") != STATE_FORMAT or \
                meta.get("format_version") != STATE_FORMAT_VERSION:
            raise ValueError(f"{file} is not an {STATE_FORMAT} file of version {STATE_FORMAT_VERSION}")
        layers = adahop_layers(model)
        if set(meta["layers"]) != set(layers):
            raise ValueError(f"{file} holds other layers than the model's converted ones")
        import torch.distributed as dist

        rank = dist.get_rank() if world > 1 and dist.is_available() and dist.is_initialized() else 0
        for fqn, entry in meta["layers"].items():
            entry = dict(entry)
            passes = int(entry.pop("passes"))
            # the counter this rank's last call left: r + (passes - 1) W + 1 (0 before any call)
            entry["calls"] = max(0, (passes - 1) * world + rank + 1)
            layers[fqn].set_extra_state(entry)
