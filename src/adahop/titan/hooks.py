"""The torchtitan integration's parts that need no torchtitan: which linears are converted, and
the optimizer hook that runs the precision schedule (testable on any module tree with
torchtitan's names)."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path

import torch.distributed as dist
from torch import nn

from adahop.convert import LM_HEAD_NAMES, adahop_layers, is_calibrated
from adahop.modes_io import load_modes, save_modes
from adahop.schedule import PrecisionSchedule

# A linear of transformer block i: torchtitan's fqns "layers.<i>.attention.qkv_linear.wqkv",
# "layers.<i>.attention.wo", "layers.<i>.feed_forward.w1", ...
_BLOCK_LINEAR = re.compile(r"^layers\.(\d+)\.")


def is_block_linear(fqn: str, n_layers: int | None = None, bf16_blocks: tuple[int, int] = (0, 0)) -> bool:
    """Whether the converter turns the linear at ``fqn`` into an AdaHOP linear: a linear of a
    transformer block (``layers.<i>.``), not an LM head by name (``lm_head``, ``output``,
    ``head``: torchtitan's LM head is the model's ``lm_head``, outside the blocks anyway), not an
    MoE router's gate (``...router.gate``: its small GEMM picks the experts, kept exact as the
    LM head is), and not in the first or last blocks ``bf16_blocks`` keeps in BF16 (``n_layers``
    needed then)."""
    m = _BLOCK_LINEAR.match(fqn)
    if m is None or fqn.rsplit(".", 1)[-1] in LM_HEAD_NAMES or ".router." in f".{fqn}.":
        return False
    first, last = bf16_blocks
    if first or last:
        if n_layers is None:
            raise ValueError("bf16_blocks needs the model's number of blocks (n_layers)")
        block = int(m.group(1))
        if block < first or block >= n_layers - last:
            return False
    return True


def optimizer_step(optimizer) -> int:
    """The optimizer steps done so far, read from the optimizer's own state (so that a run
    resumed from a checkpoint reads the resumed count): the per-parameter ``step`` that Adam,
    AdamW and most torch optimizers keep (0 before the first step). torchtitan's
    ``OptimizersContainer`` holds its optimizers in ``.optimizers`` (its own state is empty):
    they are read."""
    inner = getattr(optimizer, "optimizers", None)
    for opt in (optimizer,) if inner is None else inner:
        for state in opt.state.values():
            step = state.get("step") if isinstance(state, dict) else None
            if step is not None:
                return int(step)
        if opt.state:
            raise ValueError(f"{type(opt).__name__} keeps no per-parameter 'step': the AdaHOP precision schedule "
                             "cannot tell the step (use AdamW, torchtitan's default)")
    return 0


class AdaHOPHook:
    """``ModelSpec.post_optimizer_build_fn`` for an AdaHOP model: torchtitan's trainer calls
    ``hook(optimizers, model_parts, parallel_dims)`` once the optimizer is built. It

    - loads ``modes_file`` when it exists (a resumed run: torchtitan's checkpoints hold tensors
      only, so the calibrated modes live beside them in this file, ``adahop.save_modes``' format);
    - unless ``calibrator`` (the loop runs an ``adahop.Calibrator``: ``AdaHOPTrainer``), refuses
      a data-parallel run (``parallel_dims`` dp_replicate x dp_shard above 1) whose layers still
      calibrate: torchtitan's own training loop runs no Calibrator, so each rank would calibrate
      on its own rows and could freeze other modes than its peers (calibrate in one process
      first, its ``modes_file`` then loads on every rank; or use a fixed recipe);
    - registers an optimizer step pre-hook calling ``schedule.apply(part, step, total_steps)``
      before every step (``step``: the steps done, ``optimizer_step``), and a post-hook writing
      ``modes_file`` (rank 0) once every layer is calibrated.

    ``total_steps`` is the run's length the schedule is laid over; a step at or past it raises
    (the schedule would have begun its BF16 phase at the wrong step)."""

    def __init__(self, schedule: PrecisionSchedule, total_steps: int, modes_file: str | os.PathLike | None = None,
                 *, calibrator: bool = False):
        if not isinstance(schedule, PrecisionSchedule):
            raise ValueError(f"schedule must be a PrecisionSchedule, got {type(schedule).__name__}")
        if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 1:
            raise ValueError(f"total_steps must be an int >= 1, got {total_steps!r}")
        self.schedule = schedule
        self.total_steps = total_steps
        self.modes_file = None if modes_file is None else Path(modes_file)
        self.switched: list[str] = []  # the layers the last step switched to BF16 (for logs and tests)
        self.saved = False
        self.calibrator = calibrator  # True: the loop runs an adahop.Calibrator (AdaHOPTrainer)

    def __call__(self, optimizers, model_parts: Iterable[nn.Module], parallel_dims=None) -> None:
        parts = list(model_parts)
        if not any(adahop_layers(part) for part in parts):
            raise ValueError("the model has no AdaHOP layer: convert it with adahop.titan.linear.AdaHOPConverter")
        if self.modes_file is not None:
            if len(parts) != 1:
                raise ValueError(f"modes_file holds one model's modes; this run has {len(parts)} model parts "
                                 "(pipeline parallelism): pass modes_file=None")
            if self.modes_file.is_file():
                load_modes(parts[0], self.modes_file)
                self.saved = True
        if not self.calibrator:
            check_data_parallel(parts, parallel_dims)

        def before_step(optimizer, args, kwargs):
            step = optimizer_step(optimizer)
            if step >= self.total_steps:
                raise ValueError(f"step {step + 1} is past the {self.total_steps} steps the AdaHOP precision schedule "
                                 "was made for: give the hook the run's training.steps")
            self.switched = [fqn for part in parts for fqn in self.schedule.apply(part, step, self.total_steps)]

        def after_step(optimizer, args, kwargs):
            if self.modes_file is None or self.saved or not is_calibrated(parts[0]):
                return
            if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
                self.modes_file.parent.mkdir(parents=True, exist_ok=True)
                save_modes(parts[0], self.modes_file)
            self.saved = True

        optimizers.register_step_pre_hook(before_step)
        optimizers.register_step_post_hook(after_step)


def data_parallel_degree(parallel_dims) -> int:
    """The ranks that train on different rows: torchtitan's ``ParallelDims`` dp_replicate x
    dp_shard (1 without ``parallel_dims``)."""
    if parallel_dims is None:
        return 1
    replicate = max(1, int(getattr(parallel_dims, "dp_replicate", 1) or 1))
    shard = max(1, int(getattr(parallel_dims, "dp_shard", 1) or 1))
    return replicate * shard


def check_data_parallel(model_parts: list[nn.Module], parallel_dims) -> None:
    """A ValueError for a data-parallel run whose AdaHOP layers still calibrate (``AdaHOPHook``)."""
    degree = data_parallel_degree(parallel_dims)
    if degree == 1:
        return
    calibrating = [fqn for part in model_parts for fqn, m in adahop_layers(part).items() if m.calibrating]
    if calibrating:
        raise ValueError(f"data parallelism of degree {degree} with {len(calibrating)} AdaHOP layers still "
                         f"calibrating (e.g. {calibrating[0]!r}): torchtitan's loop runs no adahop.Calibrator, so "
                         "the ranks would calibrate apart. Calibrate in one process first, or use a fixed recipe "
                         "(mxfp4, mxfp4_iht, tseng, bf16)")
