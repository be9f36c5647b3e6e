"""Data-parallel training under torchrun: the process group, rank and world, and the checks that
stop every rank together (docs/distributed.md).

One ``Parallel`` object per run says where this process stands (rank, world size, device) and
does the few things data parallelism adds to the trainer:

* ``wrap`` (DDP) / ``shard_model`` (FSDP2: ``fully_shard`` per block, bf16 or float32
  parameters, float32 reductions; optionally the AdaHOP weights gathered as fprop's MXFP4 operand,
  ``adahop.quantized_all_gather``) / ``clip_grad_norm``. Under FSDP2 ``all_gathered`` counts the
  all-gathers and the bytes this rank sends in them (the run log's ``all_gather`` per step).
* ``shard``: the global batch of ``batch_size`` sequences is the same on every rank (every rank
  draws it from the same seeded iterator); rank r trains on rows ``[r*B/W, (r+1)*B/W)``. The
  data position is therefore global, the same on every rank, and resumes on any world size.
* the calibration protocol (the split into parts, each rank's stochastic-rounding numbers, the
  merge of the ranks' observations, the freeze, the check that every rank holds the same modes)
  is the library's ``adahop.Calibrator`` (adahop/calibration.py), over the default process group.
* ``step_report`` / ``check_finite``: each rank's loss and whether its own gradient (before the
  all-reduce, seen by a DDP communication hook) was finite are gathered every step and read
  back with the losses; a non-finite one on any rank stops every rank at the same step with
  ``NonFiniteError`` naming the rank and the step.
* ``agree``: a setup error on one rank (a locked folder, a checkpoint of another run) reaches
  every rank, instead of leaving the others waiting in their next collective.

``Parallel.single(device)`` is the one-process case; its methods cost nothing.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import os
import warnings
from dataclasses import dataclass, field
from datetime import timedelta

import torch
from torch import nn

from adahop.calibration import RankMismatchError

PARALLEL_CHOICES = ("none", "ddp", "fsdp2")
LAUNCH = "torchrun --nproc-per-node N -m adahop.cli train --parallel {mode} ..."
TIMEOUT_ENV = "ADAHOP_DIST_TIMEOUT_S"  # the process group's timeout for a collective (default torch's)


class LaunchError(ValueError):
    """The launch does not fit the run (no torchrun, a batch that does not split): every rank
    raises it alike."""

    all_ranks = True  # the CLI prints it once, on rank 0


class NonFiniteError(FloatingPointError):
    """A rank saw a non-finite loss or gradient: every rank raises it at the same step."""

    all_ranks = True


class StoppedByAnotherRank(ValueError):
    """Another rank failed during setup (mostly on bad input: a locked folder, a checkpoint of
    another run); that rank reports its own error."""

    quiet = True  # the CLI prints nothing for it: the failing rank has printed the reason


def launch_env() -> tuple[int, int, int] | None:
    """``(rank, world_size, local_rank)`` from torchrun's environment, None outside torchrun."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_RANK", rank))
    except ValueError:
        raise ValueError(f"RANK={os.environ['RANK']!r}, WORLD_SIZE={os.environ['WORLD_SIZE']!r}: "
                         "torchrun sets them to integers") from None
    return rank, world, local


def check_launch(parallel: str, batch_size: int | None = None, calibration_micro_batches: int = 1) -> None:
    """The launch matches ``parallel``: ``ddp``/``fsdp2`` under torchrun (or in a process group
    the caller made), ``none`` not in a world of several processes; ``batch_size`` (the global
    batch) splits evenly over the ranks, and each rank's rows into ``calibration_micro_batches``.
    A ValueError says what to do otherwise."""
    import torch.distributed as dist

    if parallel not in PARALLEL_CHOICES:
        raise LaunchError(f"parallel must be one of {PARALLEL_CHOICES}, got {parallel!r}")
    initialized = dist.is_available() and dist.is_initialized()
    env = launch_env()
    world = dist.get_world_size() if initialized else (env[1] if env else 1)
    if parallel == "none":
        if world > 1:
            raise LaunchError(f"this process is one of {world} (torchrun or a process group) but --parallel is "
                             "none: each would train the same run into the same folder; add --parallel ddp")
        return
    if not initialized and env is None:
        raise LaunchError(f"--parallel {parallel} runs one process per device under torchrun, which sets RANK and "
                         f"WORLD_SIZE (not set here): launch it as `{LAUNCH.format(mode=parallel)}`")
    if batch_size is not None:
        check_split(batch_size, world, calibration_micro_batches)


def check_split(batch_size: int, world: int, calibration_micro_batches: int = 1) -> None:
    """The global batch splits evenly over ``world`` ranks, and each rank's rows into the
    calibration steps' micro-batches (``TrainConfig.calibration_micro_batches``)."""
    if batch_size % world:
        raise LaunchError(f"the global batch of {batch_size} sequences does not split over {world} ranks: "
                          f"give a --batch-size that is a multiple of {world}")
    if (batch_size // world) % calibration_micro_batches:
        raise LaunchError(f"each rank's {batch_size // world} sequences (the global batch of {batch_size} over "
                          f"{world} ranks) do not split into {calibration_micro_batches} calibration micro-batches: "
                          f"give a --batch-size that is a multiple of {world * calibration_micro_batches}")


def _timeout() -> timedelta | None:
    text = os.environ.get(TIMEOUT_ENV)
    if not text:
        return None
    try:
        return timedelta(seconds=float(text))
    except ValueError:
        raise ValueError(f"{TIMEOUT_ENV}={text!r} is not a number of seconds") from None


# ---- the same settings on every rank -----------------------------------------------------------------
# Settings a rank may hold on its own: they change what it shows, not what the run computes.
RANK_LOCAL_SETTINGS = ("progress",)


def _flat(d: dict, prefix: str = "") -> dict:
    """Nested dicts as one dict of dotted names (``adahop.seed``)."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def settings_differences(configs: list[dict]) -> dict[str, list]:
    """The settings (dotted names) whose values differ between the ranks' ``configs``, each with
    every rank's value (None where a rank has no such setting)."""
    flat = [_flat(c) for c in configs]
    names = sorted({k for f in flat for k in f} - set(RANK_LOCAL_SETTINGS))
    return {k: [f.get(k) for f in flat] for k in names if len({json.dumps(f.get(k), default=str) for f in flat}) > 1}


def check_same_settings(config: dict, world: int) -> None:
    """Every rank of the process group was given the same ``config`` (a run config as plain
    data, ``TrainConfig.to_dict``): the ranks all-gather a hash of it, and on a difference the
    configs, and every rank raises ``RankMismatchError`` naming the settings that differ. Ranks
    started with other settings (another --lr, --seed, --steps or --out) would otherwise train on
    as if one run, or stop in a collective that the others never reach."""
    import torch.distributed as dist

    text = json.dumps({k: v for k, v in config.items() if k not in RANK_LOCAL_SETTINGS}, sort_keys=True, default=str)
    digests = [None] * world
    dist.all_gather_object(digests, hashlib.sha256(text.encode()).hexdigest())
    if len(set(digests)) == 1:
        return
    configs = [None] * world
    dist.all_gather_object(configs, json.loads(text))
    diffs = settings_differences(configs)
    said = "; ".join(f"{k}: " + ", ".join(f"rank {r} {v!r}" for r, v in enumerate(values))
                     for k, values in list(diffs.items())[:6])
    more = f"; and {len(diffs) - 6} more" if len(diffs) > 6 else ""
    raise RankMismatchError(f"the ranks were started with different settings ({said}{more}): start every rank "
                            "with the same command line")


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks FSDP2 shards one by one: adahop's ``TransformerBlock``s, else the modules of the
    longest ``nn.ModuleList`` (a Hugging Face decoder's ``layers``, say)."""
    from adahop.llama.model import TransformerBlock

    blocks = [m for m in model.modules() if isinstance(m, TransformerBlock)]
    if blocks:
        return blocks
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    return list(max(lists, key=len)) if lists else []


def _install_gather_meter(model: nn.Module):
    """An ``AllGatherMeter`` on every FSDP2 module of ``model``: FSDP2's own collective, counted
    (``FSDPModule.set_custom_all_gather``, a no-op change of the gather; None where torch lacks it)."""
    from torch.distributed.fsdp import FSDPModule

    if not hasattr(FSDPModule, "set_custom_all_gather"):
        return None
    from adahop.quantized_all_gather import AllGatherMeter

    meter = AllGatherMeter()
    meter.install(model)
    return meter


@dataclass
class Parallel:
    """Where this process stands in the run (see the module doc)."""

    mode: str = "none"
    rank: int = 0
    world: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    owns_group: bool = False
    _grad_bad: torch.Tensor | None = field(default=None, repr=False)
    _gather_meter: object | None = field(default=None, repr=False)  # FSDP2: an AllGatherMeter (shard_model)

    # ---- setup ------------------------------------------------------------------------------------
    @classmethod
    def single(cls, device: torch.device) -> Parallel:
        return cls(device=device)

    @classmethod
    def start(cls, mode: str, device: torch.device) -> Parallel:
        """Join (or, under torchrun, create) the default process group. ``device``: the device
        the run asked for; on CUDA each rank takes GPU ``LOCAL_RANK``."""
        import torch.distributed as dist

        check_launch(mode)
        if mode == "none":
            return cls.single(device)
        owns = False
        env = launch_env()
        if not dist.is_initialized():
            backend = "nccl" if device.type == "cuda" else "gloo"
            kwargs = {"timeout": _timeout()} if _timeout() is not None else {}
            if device.type == "cuda":
                torch.cuda.set_device(env[2])
                kwargs["device_id"] = torch.device("cuda", env[2])
            dist.init_process_group(backend, **kwargs)
            owns = True
        if device.type == "cuda":
            local = env[2] if env is not None else dist.get_rank() % torch.cuda.device_count()
            if device.index is not None and device.index != local:
                warnings.warn(f"--device {device} under {mode}: each rank takes the GPU of its local rank "
                              f"(this one cuda:{local})", stacklevel=2)
            device = torch.device("cuda", local)
            torch.cuda.set_device(device)
        return cls(mode=mode, rank=dist.get_rank(), world=dist.get_world_size(), device=device, owns_group=owns)

    @property
    def distributed(self) -> bool:
        return self.mode != "none"

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def close(self) -> None:
        import torch.distributed as dist

        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self.owns_group = False

    def barrier(self) -> None:
        if self.distributed:
            import torch.distributed as dist

            dist.barrier()

    def agree(self, error: BaseException | None) -> None:
        """Every rank passes its setup error (or None); if any rank has one, every rank raises:
        the failing rank its own error, the others ``StoppedByAnotherRank``."""
        if not self.distributed:
            if error is not None:
                raise error
            return
        import torch.distributed as dist

        mine = None if error is None else f"{type(error).__name__}: {error}"
        gathered = [None] * self.world
        dist.all_gather_object(gathered, mine)
        if error is not None:
            raise error
        failed = [(r, m) for r, m in enumerate(gathered) if m is not None]
        if failed:
            r, m = failed[0]
            raise StoppedByAnotherRank(f"rank {r} stopped the run: {m}")

    def check_same_settings(self, config: dict) -> None:
        """``check_same_settings`` of every rank's run config (nothing in one process)."""
        if self.distributed:
            check_same_settings(config, self.world)

    def check_batch(self, batch_size: int, calibration_micro_batches: int = 1) -> None:
        check_split(batch_size, self.world, calibration_micro_batches)

    # ---- the model --------------------------------------------------------------------------------
    def shard_model(self, model: nn.Module, *, bf16: bool, quantized_all_gather: bool = False) -> dict[str, str]:
        """FSDP2 (before the optimizer is built): ``fully_shard`` on each transformer block, then
        on the whole model (the embedding, the final norm, the head), torchtitan's way; each
        rank keeps 1/W of every parameter and the blocks all-gather theirs for their forward and
        backward. Mixed precision: parameters gathered in bf16 when the run computes in bf16
        (``bf16``: autocast, by default on CUDA), float32 otherwise; gradients reduced in float32.

        ``quantized_all_gather``: each AdaHOP layer's weight is gathered as fprop's MXFP4 operand
        once its modes allow (``adahop.quantized_all_gather``). Returns the layers left to FSDP2's
        own gather, with why (empty otherwise)."""
        if self.mode != "fsdp2":
            if quantized_all_gather:
                raise ValueError(f"quantized_all_gather needs parallel 'fsdp2', got {self.mode!r}")
            return {}
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        left = {}
        if quantized_all_gather:
            from adahop import quantized_all_gather as qag

            left = qag.install(model, self.world)
        mesh = init_device_mesh(self.device.type, (self.world,))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=torch.float32)
        for block in transformer_blocks(model):
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        if quantized_all_gather:
            qag.attach(model)
        self._gather_meter = _install_gather_meter(model)
        return left

    def all_gathered(self) -> tuple[int, int] | None:
        """FSDP2's all-gathers of the parameters so far, and the bytes this rank sent in them (each
        one's input: every rank sends as much, and each gather delivers ``world`` times that to
        every rank); None without FSDP2, or on a torch whose FSDP2 takes no custom all-gather."""
        meter = self._gather_meter
        return None if meter is None else (meter.calls, meter.bytes)

    def clip_grad_norm(self, parameters, max_norm: float) -> torch.Tensor:
        """``clip_grad_norm_``; under FSDP2 the norm of the sharded gradients is a DTensor whose
        full value (one all-reduce) scales every shard."""
        if self.mode != "fsdp2":
            return torch.nn.utils.clip_grad_norm_(parameters, max_norm)
        from torch.distributed.tensor import DTensor

        parameters = [p for p in parameters if p.grad is not None]
        total = torch.nn.utils.get_total_norm([p.grad for p in parameters], 2.0)
        if isinstance(total, DTensor):
            total = total.full_tensor()
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total)
        return total

    def wrap(self, model: nn.Module) -> nn.Module:
        """The module the forward runs through: ``model`` itself, or under DDP its wrapper, whose
        communication hook records whether this rank's gradient was finite before the all-reduce."""
        if self.mode != "ddp":
            return model
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        from torch.nn.parallel import DistributedDataParallel

        # No buffer sync before each forward: DDP would copy rank 0's buffers into every rank, and an
        # AdaHOP layer's SR counter may be a buffer that must stay per rank (adahop.Calibrator sets
        # it before each forward, so the sync at construction does no harm). A decoder's other
        # buffers (RoPE tables) are constants. (torch 2.13 renamed the option.)
        params = inspect.signature(DistributedDataParallel.__init__).parameters
        no_sync = {"forward_sync_buffers": False} if "forward_sync_buffers" in params else {"broadcast_buffers": False}
        ddp = DistributedDataParallel(model, device_ids=[self.device.index] if self.device.type == "cuda" else None,
                                      **no_sync)
        self._grad_bad = torch.zeros((), dtype=torch.float32, device=self.device)

        def checked_allreduce(flag, bucket):
            flag.add_((~torch.isfinite(bucket.buffer()).all()).float())  # stays on the device: no sync
            return allreduce_hook(None, bucket)

        ddp.register_comm_hook(self._grad_bad, checked_allreduce)
        return ddp

    def no_sync(self, module: nn.Module, last_micro_batch: bool):
        """DDP all-reduces the gradient once per step, after the last micro-batch."""
        if self.mode == "ddp" and not last_micro_batch:
            return module.no_sync()
        return contextlib.nullcontext()

    def shard(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's rows of a global batch."""
        if not self.distributed:
            return inputs, targets
        rows = inputs.shape[0]
        if rows % self.world:
            raise ValueError(f"a batch of {rows} rows does not split over {self.world} ranks")
        n = rows // self.world
        return inputs[self.rank * n:(self.rank + 1) * n], targets[self.rank * n:(self.rank + 1) * n]

    # ---- the per-step check -----------------------------------------------------------------------
    def start_step(self) -> None:
        if self._grad_bad is not None:
            self._grad_bad.zero_()

    def step_report(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
        """``[loss_0, grad_bad_0, ..., loss_{W-1}, grad_bad_{W-1}, grad_norm]`` on the device (one
        all-gather per step, no host sync); read back with the losses (``check_finite``)."""
        flag = self._grad_bad if self._grad_bad is not None else torch.zeros((), device=loss.device)
        local = torch.stack((loss.float(), flag.float()))
        if self.world > 1:
            import torch.distributed as dist

            parts = [torch.empty_like(local) for _ in range(self.world)]
            dist.all_gather(parts, local)
            local = torch.cat(parts)
        return torch.cat((local, grad_norm.float().reshape(1)))

    def check_finite(self, values: list[float], step: int, kept: str, hint: str) -> float:
        """The global loss of a ``step_report`` read back; a ``NonFiniteError`` (the same on every
        rank) if any rank's loss or gradient was not finite."""
        import math

        losses, bad = values[0:-1:2], values[1:-1:2]
        grad_norm = values[-1]
        if self.world == 1:
            if not math.isfinite(losses[0]):
                raise FloatingPointError(f"training diverged: the loss is {losses[0]} at step {step} ({hint}); "
                                         f"{kept}. A lower --lr or a longer warm-up may help")
            if not math.isfinite(grad_norm):
                raise FloatingPointError(f"training diverged: the gradient norm is {grad_norm} at step {step} "
                                         f"({hint}); {kept}. A lower --lr or a longer warm-up may help")
            return losses[0]
        seen = [f"rank {r}: " + ", ".join(
            ([f"loss {v}"] if not math.isfinite(v) else []) + (["a non-finite gradient"] if b else []))
            for r, (v, b) in enumerate(zip(losses, bad)) if not math.isfinite(v) or b]
        if seen or not math.isfinite(grad_norm):
            what = "; ".join(seen) if seen else f"the reduced gradient norm is {grad_norm}"
            raise NonFiniteError(f"training diverged at step {step} ({what}); every rank stops ({hint}); {kept}. "
                                 "A lower --lr or a longer warm-up may help")
        return sum(losses) / len(losses)

    def any(self, flag: bool) -> bool:
        """True on every rank if ``flag`` is True on any (a hook's StopTraining, say)."""
        if self.world == 1:
            return flag
        import torch.distributed as dist

        t = torch.tensor([float(flag)], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())
