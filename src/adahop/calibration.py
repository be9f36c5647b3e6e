"""Calibration from any training loop: a ``Calibrator`` around each optimizer step runs the
calibration protocol of ``adahop train``, in one process or over the ranks of a data-parallel
loop (DDP, FSDP2: docs/distributed.md, 'Calibration in a loop of your own').

    calibrator = adahop.Calibrator(model, micro_batches=2)   # after converting (and loading) the model
    for inputs, targets in batches:
        with calibrator.step() as step:
            for x, y in step.split(inputs, targets):       # each rank's rows, in step.parts parts
                loss = loss_fn(ddp_model(x), y) / step.parts
                loss.backward()
        optimizer.step(); optimizer.zero_grad()

What it owns (``patterns.calibration`` holds the statistics themselves):

* **The split into parts.** While any layer calibrates, each micro-batch runs as ``micro_batches``
  parts (the eager BF16 calibration's activation memory / parts); the layers merge the parts of a
  micro-batch into one observation of the whole (``convert.calibration_parts``), so the
  calibration decides and lasts as unsplit. Once calibrated, a step runs whole (``step.parts``
  is 1).
* **The stochastic-rounding accounting** (every step, also after calibration). Rank r of W draws
  the call numbers r, r + W, r + 2W, ... of each layer (a layer's SR seed is a hash of its config
  seed, its name and that number; linear.py): the ranks' rounding errors are independent, each
  rank's is reproducible, and together they are the stream one process with W-fold gradient
  accumulation draws. The parts of a micro-batch whose layers all calibrate with BF16 GEMMs are
  one call (they draw no bits); any other part is a call of its own. The first forward is
  checked: a layer called twice in one forward would draw numbers of another rank's stream.
* **The cross-rank merge** (W > 1). The layers do not freeze themselves
  (``freeze_when_calibrated = False``); each forward's observations are recorded apart (on the
  device), and after the backward every rank's (votes, running sums, finite counts) are read back
  (one read for all layers), gathered (one all-gather over ``process_group``) and added to the
  merged state in rank order, so every rank holds the same numbers. A backward pass of each rank
  counts, as a micro-batch does under accumulation. (So a data-parallel calibration step waits
  for the device once, at its end, where one process waits only at the freeze.)
* **The freeze.** A layer whose merged count reaches ``calibration_steps`` votes its patterns and
  takes its modes on every rank from the same numbers; the ranks' modes, patterns and calibration
  state are then compared (``RankMismatchError`` on every rank if they differ, as at the start).
  Under a policy over the whole model (loss_aware) every layer is merged first, and the layers
  freeze together once all are complete (``calibration_group``).

With one process (no process group, or a group of one) the layers calibrate and freeze on their
own and only the split is left to do; the same loop runs either way.

A loop that runs its forwards and backwards itself, where no ``split`` can go around them (the
Hugging Face ``Trainer``, driven from its callbacks: adahop.hf_trainer), calls ``before_pass()``
before each micro-batch's forward and ``after_pass(step)`` after its backward: the same
accounting and merge, each micro-batch whole (one part).

A DDP wrapper must not broadcast rank 0's buffers before each forward (``broadcast_buffers=False``,
``forward_sync_buffers=False`` from torch 2.13): a layer's SR counter is a buffer and is per rank.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Mapping

import torch
from torch import nn

from adahop.calibration_group import CalibrationGroup
from adahop.convert import adahop_layers, calibration_parts, is_calibrated
from adahop.patterns.calibration import TENSOR_ROLES, LayerCalibration, read_calibrations


class RankMismatchError(ValueError):
    """Ranks hold different calibrated modes (or calibration state): every rank raises it."""

    all_ranks = True  # every rank raises it alike: a launcher prints it once (adahop's CLI: rank 0)


# ---- merging calibration states ---------------------------------------------------------------------
def _add_stat(total, part):
    """A running sum plus another: numbers, element-wise lists (a profile), None (none yet)."""
    if part is None:
        return total
    if total is None:
        return list(part) if isinstance(part, list) else part
    if isinstance(total, list) != isinstance(part, list) or (isinstance(part, list) and len(part) != len(total)):
        raise RankMismatchError(f"calibration statistics of different shapes cannot be merged: {total!r}, {part!r}")
    return [a + b for a, b in zip(total, part)] if isinstance(part, list) else total + part


def add_calibration(total: LayerCalibration, part: LayerCalibration) -> None:
    """Add ``part``'s votes, sums and finite counts into ``total`` (what a layer would hold had it
    observed both). The sums are added in the order the caller gives: every rank adds the
    ranks' parts in rank order, so every rank gets the same numbers."""
    for role in TENSOR_ROLES:
        t, p = total.tensors[role], part.tensors[role]
        for k, v in p.votes.items():
            t.votes[k] = t.votes.get(k, 0) + v
        for k, v in p.sums.items():
            t.sums[k] = _add_stat(t.sums.get(k), v)
        for k, v in p.finite_counts.items():
            t.finite_counts[k] = t.finite_counts.get(k, 0) + v


def layer_state(layer) -> dict:
    """What must agree across ranks: modes, patterns, the calibration (while calibrating)."""
    return {"modes": None if layer.modes is None else dict(layer.modes),
            "patterns": None if layer.patterns is None else dict(layer.patterns),
            "calibration": None if layer.calibration is None or not layer.calibrating
            else layer.calibration.to_dict()}


# ---- the calibrator -----------------------------------------------------------------------------------
class Calibrator:
    """The calibration protocol of ``model``'s AdaHOP layers around each optimizer step (module
    doc). Make it once the model is converted (and a checkpoint loaded), before the first step,
    and run every training step through ``step()``, also after calibration (the SR accounting).

    ``process_group``: the ranks that train on different rows (a ``torch.distributed`` group);
    None: the default group if ``torch.distributed`` is initialized, else one process.
    ``micro_batches``: the parts each micro-batch of a calibrating step runs as.
    ``checked_at``: said by the error if the ranks' modes differ already (after a load, say)."""

    def __init__(self, model: nn.Module, process_group=None, *, micro_batches: int = 1,
                 checked_at: str = "at the start of training"):
        if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
            raise ValueError(f"micro_batches must be an int >= 1, got {micro_batches!r}")
        import torch.distributed as dist

        if process_group is None and dist.is_available() and dist.is_initialized():
            process_group = dist.group.WORLD
        self.model = model
        self.micro_batches = micro_batches
        self.group = process_group
        self.world = 1 if process_group is None else dist.get_world_size(process_group)
        self.rank = 0 if process_group is None else dist.get_rank(process_group)
        self.steps = 0  # steps run through step() (numbers the freeze's step in messages)
        self._layers = dict(sorted(adahop_layers(model).items()))
        # Layers under a policy over the whole model that no conversion grouped (built from a
        # config: torchtitan's) freeze together, as convert_to_adahop_training's do.
        ungrouped = [m for m in self._layers.values()
                     if m.config.adaptive and m.config.model_policy is not None and m.calibration_group is None]
        if ungrouped:
            CalibrationGroup(ungrouped)
        self._merged: dict = {}  # layer -> its merged calibration while a forward observes apart
        self._sr_next: dict = {}  # layer -> its next call count n (host side)
        self._sr_checked = False
        self._observed: dict = {}  # layer -> its merged step count after the last merge
        self._pass_counters: dict | None = None  # the SR counters set by before_pass
        if self.world > 1:
            for layer in self._layers.values():
                layer.freeze_when_calibrated = False
            # A counter left at r + (n-1) W + 1 by this rank's last call continues at n (one read per
            # layer here; afterwards the counts are kept on the host, so no step reads the device).
            self._sr_next = {fqn: -(-(layer.calls - self.rank) // self.world) for fqn, layer in self._layers.items()
                             if not layer.runs_plain_linear}
        self.check_modes(checked_at)

    @property
    def distributed(self) -> bool:
        """Several ranks: their observations are merged, their SR numbers interleaved."""
        return self.world > 1

    @contextlib.contextmanager
    def step(self, number: int | None = None) -> Iterator[CalibrationStep]:
        """The context of one optimizer step's forwards and backwards (every micro-batch of it);
        run each through the step's ``split``. ``number``: the step's number in messages (default:
        the steps run through this calibrator, from 1)."""
        self.steps = self.steps + 1 if number is None else number
        parts = 1 if is_calibrated(self.model) else self.micro_batches
        self._observed = self._step_counts()
        yield CalibrationStep(self, parts, self.steps)
        if self.distributed and self._step_counts() != self._observed:
            raise ValueError("an AdaHOP layer observed a forward and backward outside step.split(...): under "
                             "data parallelism each one runs inside it, so that the ranks merge what they observe")

    # ---- a loop that runs its forwards and backwards itself --------------------------------------------
    def before_pass(self) -> None:
        """Before one forward and backward run whole, in a loop that cannot run them inside
        ``step().split`` (a ``transformers.Trainer``, driven from its callbacks: adahop.hf_trainer):
        this rank's SR numbers for the pass, its observations recorded apart. Follow each pass with
        ``after_pass``. (``micro_batches`` does not apply: a pass is one part.)"""
        self._pass_counters = self._align_sr_counters()
        self._observe_apart()

    def after_pass(self, step: int) -> list[str]:
        """After the backward of a pass begun by ``before_pass``: the ranks' observations merged,
        the layers whose calibration is complete frozen (returned; in one process the layers
        freeze themselves, and this returns none). ``step``: the step's number in messages."""
        self._check_sr_counters(self._pass_counters)
        return self._merge(step)

    def check_modes(self, where: str) -> None:
        """Every rank holds the same modes, patterns and calibration state; else every rank
        raises ``RankMismatchError`` naming the first layer that differs."""
        if not self.distributed:
            return
        import torch.distributed as dist

        mine = {fqn: layer_state(layer) for fqn, layer in self._layers.items()}
        gathered = [None] * self.world
        dist.all_gather_object(gathered, mine, group=self.group)
        for r, theirs in enumerate(gathered[1:], start=1):
            for fqn in gathered[0]:
                a, b = gathered[0][fqn], theirs.get(fqn)
                if a != b:
                    what = next((k for k in a if b is None or a[k] != b.get(k)), "layers")
                    raise RankMismatchError(
                        f"the ranks disagree {where}: layer {fqn!r} has {what} {a[what]} on rank 0 and "
                        f"{None if b is None else b[what]} on rank {r}. Every rank must run the same modes (their "
                        "calibration is merged before the freeze); a checkpoint whose ranks differ cannot resume")

    # ---- one forward and backward ---------------------------------------------------------------------
    def _bf16_calibrating(self) -> bool:
        """Every converted layer calibrates, with BF16 GEMMs."""
        layers = self._layers.values()
        return bool(layers) and all(m.calibrating and m.config.calibration_gemms == "bf16" for m in layers)

    def _step_counts(self) -> dict:
        return {fqn: layer.calibration.steps for fqn, layer in self._layers.items() if layer.calibrating}

    def _align_sr_counters(self) -> dict | None:
        """Before a training forward: each layer's call counter to this rank's next number,
        r + n W. Returns the counters set, for ``_check_sr_counters``."""
        if not self.distributed:
            return None
        before = {}
        for fqn, n in self._sr_next.items():
            before[fqn] = self._layers[fqn].calls = n * self.world + self.rank  # a write: no sync
            self._sr_next[fqn] = n + 1
        return before

    def _check_sr_counters(self, before: dict | None) -> None:
        """After the first training forward (one read): a layer called more than once per forward
        would draw numbers of another rank's stream."""
        if not before or self._sr_checked:
            return
        self._sr_checked = True
        for fqn, calls in before.items():
            ran = self._layers[fqn].calls - calls
            if ran > 1:
                warnings.warn(f"{fqn} ran {ran} times in one forward: under data parallelism its stochastic "
                              "rounding then shares random numbers with another rank's", stacklevel=3)
                return

    def _observe_apart(self) -> None:
        """Before a training forward: each calibrating layer records this forward's observations
        apart (a fresh ``LayerCalibration``), its merged state kept here."""
        if not self.distributed:
            return
        self._merged = {}
        for fqn, layer in self._layers.items():
            if layer.calibrating:
                self._merged[fqn] = layer.calibration
                layer.calibration = LayerCalibration()

    def _merge(self, step: int) -> list[str]:
        """After the backward: every rank's new observations (one all-gather) added to the merged
        state in rank order, the layers whose merged count reached ``calibration_steps`` frozen,
        and the ranks checked to agree. Returns the layers frozen now."""
        if not self.distributed or not self._merged:
            return []
        import torch.distributed as dist

        read_calibrations(self._layers[fqn].calibration for fqn in self._merged)  # the forward's one read
        mine = {fqn: self._layers[fqn].calibration.to_dict() for fqn in self._merged}
        gathered = [None] * self.world
        dist.all_gather_object(gathered, mine, group=self.group)
        if any(set(g) != set(mine) for g in gathered):
            raise RankMismatchError(f"the ranks calibrate different layers at step {step}; every rank must convert "
                                    "the same layers with the same config")
        for fqn, total in self._merged.items():
            for part in gathered:
                add_calibration(total, LayerCalibration.from_dict(part[fqn]))
            self._layers[fqn].calibration = total
        # (every layer merged first: a policy over the whole model reads them all when it freezes)
        for fqn in self._merged:
            layer = self._layers[fqn]
            if layer.calibrating and layer.calibration.steps >= layer.config.calibration_steps:
                layer.finish_calibration(wait_for_group=True)
        frozen = [fqn for fqn in self._merged if not self._layers[fqn].calibrating]
        self._merged = {}
        self._observed = self._step_counts()
        if frozen:
            self.check_modes(f"at the freeze in step {step}")
        return frozen


class CalibrationStep:
    """One optimizer step of a ``Calibrator``: ``parts``, what each micro-batch runs as (the
    calibrator's ``micro_batches`` while a layer calibrates when the step begins, else 1), and
    ``split``, which runs a micro-batch's parts."""

    def __init__(self, calibrator: Calibrator, parts: int, number: int):
        self.calibrator, self.parts, self.number = calibrator, parts, number

    def split(self, *batch):
        """The ``parts`` parts of one micro-batch (each argument a tensor, or a dict, list or tuple
        of tensors, split along dim 0), one at a time: a tuple per part, or the part itself for
        one argument. Run the part's forward and backward in the loop's body: around it the
        calibrator aligns the SR counters, and after it merges the ranks' observations (and
        freezes the layers whose calibration is complete). Every part must be run."""
        if not batch:
            raise ValueError("split needs a micro-batch: split(inputs, targets), say")
        chunks = [_chunk(b, self.parts) for b in batch]
        cal = self.calibrator
        one_call = self.parts > 1 and cal._bf16_calibrating()
        counters = None
        with _parts_context(cal.model, self.parts):
            for i, part in enumerate(zip(*chunks)):
                if i == 0 or not one_call:
                    counters = cal._align_sr_counters()
                cal._observe_apart()
                yield part if len(batch) > 1 else part[0]
                cal._check_sr_counters(counters)
                cal._merge(self.number)


def _chunk(value, parts: int) -> list:
    """``value`` (a tensor, or a dict, list or tuple of them) as ``parts`` equal parts along dim 0."""
    if isinstance(value, torch.Tensor):
        if value.dim() == 0 or value.shape[0] % parts:
            raise ValueError(f"a micro-batch of {tuple(value.shape)} does not split into {parts} equal parts "
                             "along dim 0 (its rows must be a multiple of micro_batches)")
        return list(value.chunk(parts))
    if isinstance(value, Mapping):
        split = {k: _chunk(v, parts) for k, v in value.items()}
        return [{k: v[i] for k, v in split.items()} for i in range(parts)]
    if isinstance(value, (list, tuple)):
        split = [_chunk(v, parts) for v in value]
        return [(list if isinstance(value, list) else tuple)(v[i] for v in split) for i in range(parts)]
    raise ValueError(f"split takes tensors, or dicts, lists or tuples of them; got {type(value).__name__}")


@contextlib.contextmanager
def _parts_context(model: nn.Module, parts: int):
    """The context of a micro-batch run as ``parts`` parts (``parts`` > 1): the layers merge
    its parts into one calibration observation (``calibration_parts``), and the model runs
    eagerly. While a layer calibrates a compiled model runs eagerly anyway (its calibration step
    is ``torch.compiler.disable``d); once calibration ends within the step (with several
    micro-batches), its remaining parts would compile the model at their smaller shape, and the
    next step, at the full batch, would compile it again with a dynamic batch dim."""
    if parts == 1:
        yield
        return
    with calibration_parts(model, parts), torch.compiler.set_stance("force_eager"):
        yield
