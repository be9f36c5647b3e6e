"""The training loop: AdamW with warm-up + cosine decay, gradient clipping and accumulation,
optional BF16 autocast, AdaHOP calibration by the library's ``Calibrator``, JSONL logs, a
progress bar, atomic checkpoints and exact resume.

Exact resume: a checkpoint holds everything the next step depends on (model, including the AdaHOP
layers' calibration votes, modes and SR call counters; optimizer; data position; RNG states; the
step). Loading it and continuing gives the same loss sequence, bit for bit on the CPU, as a run
that was never interrupted (tested).

Under torchrun with ``parallel`` ``ddp`` or ``fsdp2`` every rank runs this loop on its rows of the
global batch (``train.distributed``; docs/distributed.md): rank 0 owns the run folder's lock, log
and summary, every rank writes its part of a sharded checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch
from torch import nn

import adahop
from adahop.atomic_io import atomic_write_bytes, ensure_writable_dir
from adahop.calibration import Calibrator
from adahop.config import AdaHOPConfig
from adahop.convert import MIN_FEATURES, check_min_features, size_filter
from adahop.llama.pretrained import check_init
from adahop.modes_io import save_modes
from adahop.oscillation import add_dampening_grad, check_dampening
from adahop.recipes import recipe_name
from adahop.schedule import PrecisionSchedule
from adahop.train.checkpoint import (
    is_sharded,
    latest_checkpoint,
    load_model_state,
    load_sharded,
    load_training_checkpoint,
    read_sharded_state,
    rng_state,
    save_checkpoint,
    save_sharded,
    set_rng_state,
)
from adahop.train.compile import compile_blocks, compile_model
from adahop.train.distributed import PARALLEL_CHOICES, Parallel
from adahop.train.run_folder import RunLock, set_aside_previous_run
from adahop.train.run_log import LOG_NAME, JsonlLog


@dataclass
class TrainConfig:
    """Everything a run needs. Build one with a preset of ``train.recipes``. The AdaHOP numerics
    (recipe, per-GEMM settings, calibration, backend) are one ``AdaHOPConfig``, the same object
    ``convert_to_adahop_training`` takes; the rest is the training side."""

    # what
    adahop: AdaHOPConfig = field(default_factory=AdaHOPConfig)
    model_size: str = "tiny"  # llama.model SIZES; ignored with a pretrained init (its own architecture)
    # the starting weights (llama/pretrained.py): "scratch" (random, of model_size), "smollm2", a
    # .gguf file or a Hugging Face Llama folder; train.run.open_run loads them
    init: str = "scratch"
    corpus_dir: str = "runs/corpus"
    out_dir: str = "runs/debug"
    # how long, how big
    steps: int = 20
    batch_size: int = 4
    grad_accum: int = 1
    # A step that begins with an AdaHOP layer calibrating runs each micro-batch it reads as this
    # many parts of batch_size / calibration_micro_batches sequences (per rank under --parallel),
    # gradients accumulated: the same update up to summation order, with that fraction of the
    # eager BF16 calibration's activations (its memory peak). The layers merge the parts into one
    # observation of the whole micro-batch (adahop.calibration_parts), so the calibration decides
    # and lasts as with 1, and the data is read as with 1. A no-op for recipes that do not calibrate.
    calibration_micro_batches: int = 1
    seq_len: int = 64
    # optimizer (the paper's: AdamW lr 4e-4, eps 1e-8, 200 warm-up steps)
    lr: float = 4e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 200
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    # where and when the run leaves MXFP4: the fields of its adahop.schedule.PrecisionSchedule
    # (``schedule``), which checks them
    bf16_blocks: tuple[int, int] = (0, 0)  # the first and last blocks' linears stay BF16
    # linears whose layer_size (the harmonic mean of in and out features) is below this stay BF16
    # (adahop.convert, 'the size rule')
    min_features: int = MIN_FEATURES
    bf16_phase_start: float | None = None  # fraction of the steps after which bf16_phase_gemms run BF16
    bf16_phase_gemms: tuple[str, ...] = ("fprop", "dgrad", "wgrad")
    # lambda of the oscillation-dampening term lambda * ||W - Q(W)||^2 (adahop.oscillation); 0: off
    oscillation_dampening: float = 0.0
    # machinery
    seed: int = 0  # model initialisation and data order (the SR streams follow adahop.seed)
    device: str = "auto"
    autocast: str = "auto"  # "bf16", "none", or "auto": bf16 on CUDA, none on CPU
    # torch.compile (train/compile.py): "model" (the whole model as one graph), "blocks" (each
    # transformer block), "none", or "auto": the model on CUDA, none elsewhere
    compile: str = "auto"
    cudagraphs: bool = False  # with the model compiled: replay each step as CUDA graphs (reduce-overhead)
    parallel: str = "none"  # "ddp" or "fsdp2" under torchrun (train/distributed.py; batch_size is the global batch)
    # fsdp2: gather each AdaHOP layer's weight as the forward GEMM's MXFP4 operand
    # (adahop.quantized_all_gather): this run's spelling of adahop.quantized_all_gather, either one
    # turns it on (``gathers_quantized``)
    quantized_all_gather: bool = False
    log_every: int = 1
    sync_every: int = 10  # read losses back from the device every this many steps (see train())
    eval_every: int = 0  # 0: only at the end
    eval_batches: int = 8
    # at each evaluation, re-measure the calibrated layers' patterns and modes on held-out batches
    # (adahop.drift): "off", "measure" (log the changes), "apply" (also switch to the new modes)
    drift: str = "off"
    drift_batches: int = 2  # held-out batches per source for each drift measurement
    ckpt_every: int = 0  # 0: only at the end
    keep_checkpoints: int = 2
    progress: bool = True
    extra: dict = field(default_factory=dict)

    @property
    def schedule(self) -> PrecisionSchedule:
        """The run's precision schedule (a ValueError if its fields are not one)."""
        return PrecisionSchedule(bf16_phase_start=self.bf16_phase_start, bf16_phase_gemms=self.bf16_phase_gemms,
                                 bf16_blocks=self.bf16_blocks)

    def with_schedule(self, schedule: PrecisionSchedule) -> TrainConfig:
        """The same config with ``schedule``'s fields."""
        return dataclasses.replace(self, bf16_phase_start=schedule.bf16_phase_start,
                                   bf16_phase_gemms=schedule.bf16_phase_gemms, bf16_blocks=schedule.bf16_blocks)

    @property
    def recipe(self) -> str:
        """The run's recipe as ``adahop train`` names it (``adahop.recipes.recipe_name``): the
        scheduled recipe its numerics and BF16 phase make (adahop_lv2_tail), else its numerics
        recipe, with the phase where it has one of its own. The layers' numerics recipe is
        ``adahop.recipe``."""
        return recipe_name(self.adahop.recipe, self.schedule)

    @property
    def gathers_quantized(self) -> bool:
        """FSDP2 gathers the AdaHOP weights quantized: ``quantized_all_gather`` here or in ``adahop``."""
        return self.quantized_all_gather or self.adahop.quantized_all_gather

    def to_dict(self) -> dict:
        """Plain data for config.json and the checkpoint (``from_dict`` reads it back). "recipe"
        is the run's recipe (``recipe``), for a reader of the file; it is made from the other
        fields, so ``from_dict`` reads it as it reads nothing."""
        d = {"recipe": self.recipe, **{f.name: getattr(self, f.name) for f in fields(self)}}
        d["adahop"] = self.adahop.to_dict()
        d["extra"] = dict(self.extra)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> TrainConfig:
        """A config written by ``to_dict``. Run folders of adahop 0.1.0, whose config held the
        AdaHOP settings as flat fields (recipe, calibration_steps, oe_k, backend), read too."""
        if not isinstance(d, dict):
            raise ValueError(f"a run config is a JSON object, got {type(d).__name__}")
        d = dict(d)
        if "adahop" not in d and "recipe" in d:
            flat = {k: d.pop(k) for k in ("recipe", "calibration_steps", "oe_k", "backend") if k in d}
            q = AdaHOPConfig.from_recipe_name(flat["recipe"], seed=d.get("seed", 0), **{
                k: flat[k] for k in ("calibration_steps", "backend") if k in flat})
            d["adahop"] = q.with_gemm_settings(oe_k=flat["oe_k"]) if "oe_k" in flat else q
        elif "adahop" in d:
            d.pop("recipe", None)  # the run's recipe, made from the other fields (to_dict)
            d["adahop"] = AdaHOPConfig.from_dict(d["adahop"])
        if isinstance(d.get("compile"), bool):  # adahop 0.1.0: True compiled each block
            d["compile"] = "blocks" if d["compile"] else "none"
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown TrainConfig fields {unknown}")
        for name in ("bf16_blocks", "bf16_phase_gemms"):  # JSON lists back to tuples
            if isinstance(d.get(name), list):
                d[name] = tuple(d[name])
        return cls(**d)

    def validate(self) -> None:
        if not isinstance(self.adahop, AdaHOPConfig):
            raise ValueError(f"adahop must be an AdaHOPConfig, got {self.adahop!r}")
        for name in ("steps", "batch_size", "grad_accum", "calibration_micro_batches", "seq_len", "eval_batches",
                     "sync_every"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if self.batch_size % self.calibration_micro_batches:
            raise ValueError(f"calibration_micro_batches must divide batch_size: {self.batch_size} sequences do not "
                             f"split into {self.calibration_micro_batches} equal micro-batches")
        for name in ("warmup_steps", "eval_every", "ckpt_every", "log_every", "keep_checkpoints", "drift_batches"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        for name, ok, allowed in (("lr", lambda v: v > 0, "> 0"), ("min_lr_ratio", lambda v: 0 <= v <= 1, "in [0, 1]"),
                                  ("weight_decay", lambda v: v >= 0, ">= 0"),
                                  ("beta1", lambda v: 0 <= v < 1, "in [0, 1)"),
                                  ("beta2", lambda v: 0 <= v < 1, "in [0, 1)"), ("eps", lambda v: v > 0, "> 0"),
                                  ("grad_clip", lambda v: v > 0, "> 0")):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not ok(v):
                raise ValueError(f"{name} must be a finite number {allowed}, got {v!r}")
        check_init(self.init)
        if self.compile not in COMPILE_CHOICES:
            raise ValueError(f"compile must be one of {COMPILE_CHOICES}, got {self.compile!r}")
        if not isinstance(self.cudagraphs, bool):
            raise ValueError(f"cudagraphs must be a bool, got {self.cudagraphs!r}")
        if self.cudagraphs and self.compile not in ("auto", "model"):
            raise ValueError(f"cudagraphs replays the compiled model: it needs compile 'model' (or 'auto' on a GPU), "
                             f"got compile {self.compile!r}")
        if self.drift not in DRIFT_CHOICES:
            raise ValueError(f"drift must be one of {DRIFT_CHOICES}, got {self.drift!r}")
        if self.drift != "off" and self.drift_batches < 1:
            raise ValueError(f"drift needs drift_batches >= 1, got {self.drift_batches}")
        if self.drift != "off" and not self.adahop.adaptive:
            raise ValueError(f"drift re-measures calibrated layers: recipe {self.recipe!r} does not calibrate")
        if self.drift == "apply" and self.parallel != "none":
            raise ValueError("drift 'apply' re-decides each rank's modes on its own: not with --parallel "
                             "(use 'measure')")
        if self.parallel not in PARALLEL_CHOICES:
            raise ValueError(f"parallel must be one of {PARALLEL_CHOICES}, got {self.parallel!r}")
        if self.autocast not in ("auto", "bf16", "none"):
            raise ValueError(f"autocast must be 'auto', 'bf16' or 'none', got {self.autocast!r}")
        schedule = self.schedule  # its fields checked
        check_min_features(self.min_features)
        check_dampening(self.oscillation_dampening)
        if self.oscillation_dampening and self.parallel == "fsdp2":
            raise ValueError("oscillation_dampening reads whole weights: not with --parallel fsdp2 (use ddp)")
        schedule.check_run(self.steps, self.adahop.calibration_steps if self.adahop.adaptive else None,
                           self.grad_accum)
        device = resolve_device(self.device)
        if self.gathers_quantized:
            from adahop.quantized_all_gather import check_config

            check_config(self.parallel, self.adahop, resolve_compile(self, device))
        # The backend is first asked for at the first MXFP4 step, after the BF16 calibration:
        # one that cannot run on this device is refused here, before any work.
        # (bf16 runs no MXFP4 GEMM: there a known backend is not asked to run.)
        from adahop.ops.backends import unavailable_reason

        if self.adahop.backend != "auto":
            reason = unavailable_reason(self.adahop.backend, device)
            if reason is not None and self.adahop.recipe != "bf16":
                raise ValueError(reason)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up to ``lr`` over ``warmup_steps``, then cosine decay to ``min_lr_ratio * lr``
    at the last step. ``step`` counts from 0."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def resolve_device(name: str) -> torch.device:
    """``auto`` (a CUDA GPU if there is one, else the CPU), ``cpu``, ``cuda`` or ``cuda:N``;
    a device this machine does not have is a ValueError saying so."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ValueError(f"unknown device {name!r}; use auto, cpu, cuda or cuda:N")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r}: this machine has no usable CUDA GPU (torch {torch.__version__}, "
                             f"CUDA build {torch.version.cuda or 'none'}); use --device cpu or auto")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {name!r}: there are {torch.cuda.device_count()} CUDA GPUs (cuda:0 ...)")
    return dev


COMPILE_CHOICES = ("auto", "model", "blocks", "none")
DRIFT_CHOICES = ("off", "measure", "apply")


def resolve_compile(cfg: TrainConfig, device: torch.device) -> str:
    """What ``cfg.compile`` compiles on ``device``: "auto" is the whole model on CUDA (measured
    faster there than per-block compile for every recipe, docs/results.md) and nothing on the CPU
    (minutes of compiling for a debug run). CUDA graphs need a GPU: a ValueError elsewhere."""
    mode = cfg.compile
    if mode == "auto":
        mode = "model" if device.type == "cuda" else "none"
    if cfg.cudagraphs and (device.type != "cuda" or mode != "model"):
        raise ValueError(f"cudagraphs needs the model compiled on a CUDA device, got compile {mode!r} on {device}")
    return mode


def make_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices only (not on norms, biases or the embedding). On CUDA the
    fused implementation (the whole update in one multi-tensor kernel per group of parameters
    rather than a pass per operation; torchtitan's default; 14 ms less per 1B step on the H200);
    on the CPU torch's default."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 and "embedding" not in name else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    fused = all(p.is_cuda for group in groups for p in group["params"]) or None
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=fused)


def _progress(total: int, initial: int, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)


class StopTraining(Exception):  # noqa: N818  (a signal, not an error)
    """Raised by an ``on_step`` hook to end the run after the current step, with no checkpoint
    and no final evaluation (a benchmark that has measured what it wanted, early stopping)."""


# Fields that may change when a run resumes: where and how it runs, not what it computes.
# (``adahop.backend`` may change too: every backend gives the reference's quantized bits, and
# their GEMMs differ only in accumulation order.)
# (``parallel`` may change between ddp and fsdp2: their sharded checkpoints are the same format.)
# (``quantized_all_gather`` and ``adahop.quantized_all_gather`` may change: it gathers the operand the
# layer would quantize, bit for bit.)
# (``adahop.share_input`` may change: the layers that read one x give the same bits either way;
# so may ``adahop.wgrad_input``: x quantized in the forward or the backward, the same bits.)
# (``init`` may not: it names what the run's weights started from. A resumed run's weights are
# the checkpoint's, loaded over the freshly loaded pretrained ones.)
RESUMABLE_CHANGES = ("out_dir", "corpus_dir", "device", "compile", "cudagraphs", "progress", "log_every", "sync_every",
                     "eval_every", "eval_batches", "ckpt_every", "keep_checkpoints", "extra", "parallel",
                     "drift_batches", "quantized_all_gather")


def resume_conflicts(saved: dict, cfg: TrainConfig) -> list[str]:
    """The settings of ``cfg`` that differ from the checkpoint's config ``saved`` (as the
    checkpoint holds it) and would make the resumed run a different run (anything but
    ``RESUMABLE_CHANGES``). A custom policy function is compared by the name it was saved under."""
    a, b = TrainConfig.from_dict(saved).to_dict(), cfg.to_dict()
    a["adahop"]["policy_fn"] = (saved.get("adahop") or {}).get("policy_fn")
    # ("recipe" is made from adahop.recipe and the BF16 phase, which are compared themselves)
    out = [f"{k}: {a[k]!r} -> {b[k]!r}" for k in a
           if k not in RESUMABLE_CHANGES and k not in ("adahop", "recipe") and a[k] != b[k]]
    resumable = {"backend": None, "share_input": None, "quantized_all_gather": None, "wgrad_input": None}
    qa, qb = dict(a["adahop"], **resumable), dict(b["adahop"], **resumable)
    out += [f"adahop.{k}: {qa[k]!r} -> {qb[k]!r}" for k in qa if qa[k] != qb[k]]
    return out


def train(
    cfg: TrainConfig,
    *,
    model: nn.Module,
    train_batches,
    eval_fn: Callable[[nn.Module], dict] | None = None,
    resume: bool = True,
    stop_after: int | None = None,
    on_step: Callable[[int, nn.Module], None] | None = None,
) -> dict:
    """Train ``model`` (already converted by the caller or not: this function converts it with
    ``cfg.adahop`` if it holds no AdaHOP layer) on ``train_batches`` (an iterator of
    ``(inputs, targets)`` LongTensors with ``state_dict``/``load_state_dict``).

    The run folder ``cfg.out_dir`` is checked writable and locked for this process first
    (``run_folder``). With ``resume``, its latest checkpoint is continued, if its config matches
    (``resume_conflicts``); a run that has already finished is left as it is (the summary it
    wrote comes back with ``"already_finished": True``). Without, the files of a run already
    there are moved into ``previous-N/`` (``run_folder.set_aside_previous_run``) and the run
    starts in a clean folder.

    ``stop_after``: stop after that many steps of this call (to test interruption).
    ``on_step(step, model)``: called after each optimizer step (``step`` counts from 1), before
    the step's evaluation and checkpoint; raising ``StopTraining`` there ends the run after that
    step without a checkpoint (the summary says ``"stopped": True``). Returns a summary: losses
    per step, final eval, tokens/s, peak memory."""
    cfg.validate()
    out = ensure_writable_dir(cfg.out_dir)
    par = Parallel.start(cfg.parallel, resolve_device(cfg.device))
    lock = None
    try:
        error = None
        try:
            par.check_same_settings(cfg.to_dict())  # one rank's other --lr or --out: every rank stops here
            par.check_batch(cfg.batch_size, cfg.calibration_micro_batches)
            if par.is_main:  # one owner of the folder; the other ranks write only their checkpoint parts
                lock = RunLock(out).acquire()
                moved = set_aside_previous_run(out, new_run=not resume)
                if moved is not None:
                    print(f"{out} held another run: its files are moved to {moved}, and this run starts in a "
                          "clean folder", file=sys.stderr)
        except (ValueError, OSError) as e:
            error = e
        par.agree(error)
        return _train(cfg, out, par, model=model, train_batches=train_batches, eval_fn=eval_fn, resume=resume,
                      stop_after=stop_after, on_step=on_step)
    finally:
        if lock is not None:
            lock.release()
        par.close()


class _NoLog:
    """The log of a rank other than 0: rank 0 writes the run's log."""

    def write(self, record: dict) -> None:
        pass

    def records(self) -> list[dict]:
        return []


def _open_checkpoint(found, cfg: TrainConfig, par: Parallel):
    """``(saved config, step, state)`` of the checkpoint ``found``: a single-process checkpoint
    loaded whole, or a sharded one's ``state.json`` (its tensors load once the model is built)."""
    if is_sharded(found) != par.distributed:
        if par.distributed:
            raise ValueError(f"{found} was written by a run without --parallel: resume it without --parallel, "
                             "or give a new --out (or --no-resume)")
        raise ValueError(f"{found} is a sharded checkpoint of a --parallel run: resume it under torchrun with "
                         "--parallel (torchrun --nproc-per-node 1 works too), or give a new --out (or --no-resume)")
    if par.distributed:
        meta = read_sharded_state(found)
        return meta["config"], meta["step"], meta
    state = load_training_checkpoint(found)
    return state["config"], state["step"], state


def _layer_states(model: nn.Module) -> dict:
    """The AdaHOP layers' extra state without the SR call counters (those are per rank)."""
    return {fqn: {k: v for k, v in layer.get_extra_state().items() if k != "calls"}
            for fqn, layer in adahop.adahop_layers(model).items()}


def _load_sharded_state(model, opt, train_batches, found, par: Parallel) -> int:
    """Load a sharded checkpoint on every rank; returns its step."""
    meta = load_sharded(found, model=model, optimizer=opt, par=par)
    ranked = meta["rank_state"]
    saved_world = meta["world_size"]
    for fqn, layer in adahop.adahop_layers(model).items():
        if fqn not in meta["layers"]:
            raise ValueError(f"{found} has no AdaHOP state for layer {fqn!r}")
        calls = int(ranked["sr_calls"][fqn])
        if saved_world != par.world:  # rank 0's counter -> the count of calls, then this world's layout
            calls = -(-calls // saved_world) * par.world
        layer.set_extra_state({**meta["layers"][fqn], "calls": calls})
    train_batches.load_state_dict(ranked["data"])
    set_rng_state(ranked["rng"])
    return meta["step"]


def _train(cfg, out, par: Parallel, *, model, train_batches, eval_fn, resume, stop_after, on_step) -> dict:
    device = par.device if par.distributed else resolve_device(cfg.device)
    use_bf16 = cfg.autocast == "bf16" or (cfg.autocast == "auto" and device.type == "cuda")
    ckpt_dir = out / "checkpoints"
    state = saved_step = None
    error = None
    try:
        found = latest_checkpoint(ckpt_dir) if resume else None
        if found is not None:
            saved_config, saved_step, state = _open_checkpoint(found, cfg, par)
            conflicts = resume_conflicts(saved_config, cfg)
            if conflicts:
                raise ValueError(f"{found} belongs to a run with other settings ({'; '.join(conflicts)}); "
                                 "give the same settings to resume it, or a new --out (or --no-resume to start over)")
    except ValueError as e:
        error = e
    par.agree(error)
    if state is not None and saved_step >= cfg.steps and (out / "summary.json").is_file():
        summary = json.loads((out / "summary.json").read_text())
        return {**summary, "losses": [], "already_finished": True}
    torch.manual_seed(cfg.seed)

    if not adahop.adahop_layers(model):
        adahop.convert_to_adahop_training(model, config=cfg.adahop,
                                          module_filter_fn=cfg.schedule.module_filter(model, cfg.min_features))
        size_rule = size_filter(cfg.min_features)
        by_size = [n for n, m in model.named_modules() if type(m) is nn.Linear and not size_rule(m, n)]
        if by_size and par.is_main:
            print(f"{len(by_size)} linear layers stay BF16 by the size rule (layer_size < {cfg.min_features}): "
                  f"{', '.join(by_size[:4])}{', ...' if len(by_size) > 4 else ''}", file=sys.stderr)
    model.to(device).train()
    compile_mode = resolve_compile(cfg, device)
    if compile_mode == "model":
        compile_model(model, **({"mode": "reduce-overhead"} if cfg.cudagraphs else {}))
    elif compile_mode == "blocks":
        compile_blocks(model)
    par.shard_model(model, bf16=use_bf16, quantized_all_gather=cfg.gathers_quantized)  # FSDP2: before the optimizer
    opt = make_optimizer(model, cfg)

    start_step = 0
    if state is not None and par.distributed:
        start_step = _load_sharded_state(model, opt, train_batches, found, par)
    elif state is not None:
        load_model_state(model, state["model"], found)
        opt.load_state_dict(state["optimizer"])
        train_batches.load_state_dict(state["data"])
        set_rng_state(state["rng"])
        start_step = state["step"]
    calibrator = Calibrator(model, micro_batches=cfg.calibration_micro_batches,
                            checked_at=f"after loading {found}" if state is not None else "at the start of training")
    forward = par.wrap(model)
    main = par.is_main
    log = JsonlLog(out / LOG_NAME, start_step if state is not None else None) if main else _NoLog()
    if main:
        write_text_atomic(out / "config.json", json.dumps(cfg.to_dict(), indent=1))

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    bar = _progress(cfg.steps, start_step, cfg.progress and main)
    tokens_per_step = cfg.batch_size * cfg.grad_accum * cfg.seq_len
    losses, t_start, steps_done = [], time.perf_counter(), 0
    step = start_step
    last_ckpt = found if state is not None else None
    # Steps whose loss and gradient norm are still on the device. Reading them back is a host-
    # device sync; doing it every step would keep the host from queueing the next step's kernels
    # while the GPU works, so they are read every ``sync_every`` steps (and before any
    # evaluation, checkpoint or the end). Every step still gets its own log record.
    # Each step's report is ``Parallel.step_report``: every rank's loss and gradient check.
    pending: list[tuple[dict, torch.Tensor]] = []
    t_window = time.perf_counter()
    hint = f"{cfg.recipe}, lr {cfg.lr:g}"

    def flush(evaluate: bool = False) -> None:
        """Read the pending steps back (one sync), check them, then evaluate (``evaluate``: into
        the last step's record, outside the timed window) and log them."""
        nonlocal t_window
        if not pending:
            return
        values = torch.stack([report for _, report in pending]).tolist()
        rate = len(pending) * tokens_per_step / max(time.perf_counter() - t_window, 1e-9)
        kept = f"the last checkpoint, {last_ckpt}, is kept" if last_ckpt else "no checkpoint was written"
        step_losses = [par.check_finite(v, record["step"], kept, hint) for (record, _), v in zip(pending, values)]
        if evaluate:
            pending[-1][0]["eval"] = eval_fn(model)
        for (record, _), loss_val, v in zip(pending, step_losses, values):
            record.update(loss=loss_val, grad_norm=v[-1], tok_per_s=rate)
            losses.append(loss_val)
            if cfg.log_every and (record["step"] % cfg.log_every == 0 or record["step"] == cfg.steps):
                log.write(record)
        if bar is not None:
            bar.set_postfix(loss=f"{step_losses[-1]:.4f}", tok_s=f"{rate:.0f}")
            bar.update(len(pending))
        pending.clear()
        t_window = time.perf_counter()

    stop = False
    schedule = cfg.schedule
    try:
        while step < cfg.steps:
            changed = schedule.apply(model, step, cfg.steps)
            if changed:  # not again on a resume after the switch: the modes are in the checkpoint
                flush()  # the earlier steps' records first (one sync, once per run)
                log.write({"step": step, "bf16_phase": {"gemms": list(cfg.bf16_phase_gemms), "layers": len(changed)}})
            lr = lr_at(step, cfg)
            for group in opt.param_groups:
                group["lr"] = lr
            opt.zero_grad(set_to_none=True)
            par.start_step()
            gathered_before = par.all_gathered()
            loss_sum = torch.zeros((), device=device)
            # The calibration protocol (adahop.calibration): a step that begins calibrating runs each
            # micro-batch as calibration_micro_batches parts; every forward's SR numbers are this
            # rank's; the ranks' observations are merged after each backward, the layers frozen
            # from them. Calibration is host state, the same on every rank (merged), so no rank
            # runs more forwards (and collectives) than another.
            with calibrator.step(step + 1) as cal_step:
                passes = cfg.grad_accum * cal_step.parts
                for micro in range(cfg.grad_accum):
                    inputs, targets = par.shard(*next(train_batches))
                    inputs, targets = inputs.to(device), targets.to(device)
                    for part, (part_inputs, part_targets) in enumerate(cal_step.split(inputs, targets)):
                        last_part = micro == cfg.grad_accum - 1 and part == cal_step.parts - 1
                        with par.no_sync(forward, last_micro_batch=last_part):
                            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16):
                                logits = forward(part_inputs)
                            loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), part_targets.flatten())
                            (loss / passes).backward()
                        loss_sum += loss.detach()
            add_dampening_grad(model, cfg.oscillation_dampening, torch.bfloat16 if use_bf16 else torch.float32)
            grad_norm = par.clip_grad_norm(model.parameters(), cfg.grad_clip)
            opt.step()
            gathered = par.all_gathered()
            step += 1
            steps_done += 1
            if on_step is not None:
                try:
                    on_step(step, model)
                except StopTraining:
                    stop = True
                stop = par.any(stop)  # a hook that stops one rank stops them all
            record = {"step": step, "loss": None, "lr": lr, "grad_norm": None,
                      "tokens": step * tokens_per_step, "tok_per_s": None,
                      "calibrated": adahop.is_calibrated(model)}
            if gathered is not None:  # FSDP2: the step's all-gathers, and the bytes this rank sent in them
                record["all_gather"] = {"gathers": gathered[0] - gathered_before[0],
                                        "bytes": gathered[1] - gathered_before[1]}
            pending.append((record, par.step_report(loss_sum / passes, grad_norm)))
            if stop:
                break
            last = step == cfg.steps or (stop_after is not None and steps_done >= stop_after)
            do_eval = bool(cfg.eval_every and step % cfg.eval_every == 0 and eval_fn is not None and step < cfg.steps)
            do_ckpt = bool(cfg.ckpt_every and step % cfg.ckpt_every == 0) or last
            if do_eval or do_ckpt or len(pending) >= cfg.sync_every:
                flush(evaluate=do_eval)  # raises before a checkpoint could hold a non-finite step
            if do_ckpt and par.distributed:
                last_ckpt = save_sharded(
                    ckpt_dir, step, model=model, optimizer=opt, par=par, keep=cfg.keep_checkpoints,
                    state={"step": step, "config": cfg.to_dict(), "layers": _layer_states(model)},
                    rank_state={"data": train_batches.state_dict(), "rng": rng_state(),
                                "sr_calls": {fqn: layer.calls for fqn, layer in adahop.adahop_layers(model).items()}})
            elif do_ckpt:
                last_ckpt = save_checkpoint(ckpt_dir, step, {
                    "step": step, "model": model.state_dict(), "optimizer": opt.state_dict(),
                    "data": train_batches.state_dict(), "rng": rng_state(), "config": cfg.to_dict(),
                }, keep=cfg.keep_checkpoints)
            if stop_after is not None and steps_done >= stop_after:
                break
        flush()
    finally:
        if bar is not None:
            bar.close()
    elapsed = time.perf_counter() - t_start
    eval_result = None
    finished = step == cfg.steps and not stop
    if finished and eval_fn is not None:
        # (a run resumed at its last step took none here: the layers learn which GEMMs the phase
        # switched, which drift leaves to it; their modes are switched already)
        schedule.apply(model, step, cfg.steps)
        # a run killed after its final evaluation was logged, before its summary: not again
        logged = next((r["final_eval"] for r in log.records() if "final_eval" in r and r["step"] == step), None)
        if not par.any(logged is not None):  # every rank evaluates (a sharded model needs them all)
            eval_result = final_eval(model, eval_fn)
            log.write({"step": step, "final_eval": eval_result})
        else:
            eval_result = logged
    summary = {
        "recipe": cfg.recipe, "model_size": cfg.model_size, "steps": step, "losses": losses, "stopped": stop,
        "tokens_per_s": steps_done * tokens_per_step / elapsed if steps_done and elapsed > 0 else None,
        "peak_memory_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        "final_eval": eval_result,
    }
    if finished and main:
        if adahop.is_calibrated(model):  # save_modes' format (with a measured policy's OE k); none while calibrating
            save_modes(model, out / "modes.json")
        write_text_atomic(out / "summary.json",
                          json.dumps({k: v for k, v in summary.items() if k != "losses"}, indent=1))
    par.barrier()  # the summary is written before any rank returns
    return summary


def final_eval(model: nn.Module, eval_fn: Callable[[nn.Module], dict]) -> dict:
    """``eval_fn(model)`` after the last step, the layers' modes kept as trained: modes it changes
    there (``--drift apply``) would train no step, and the run's modes.json and final checkpoint
    (written before) say the modes it trained with. The changes are in its report."""
    trained = {fqn: (layer.modes, layer.patterns, layer.oe_ks) for fqn, layer in adahop.adahop_layers(model).items()}
    result = eval_fn(model)
    for fqn, layer in adahop.adahop_layers(model).items():
        modes, patterns, oe_ks = trained[fqn]
        if modes is not None and (layer.modes, layer.patterns, layer.oe_ks) != trained[fqn]:
            layer.set_modes(modes, patterns, oe_ks=oe_ks)
    return result


def write_text_atomic(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())
