"""Training speed per recipe: steady tokens/s, ms/step, time to the first step, peak memory and
the first losses, with BF16 measured before and after the other recipes in the same call, and
torchao's float8 training as a peer.

    python benchmarks/bench_train_speed.py --corpus runs/corpus --preset h200_125m --model-size 1b \\
        --recipes adahop_lv2 --compile model --steps 30 60 --calibration-steps 10

The 1B comparison with torchao's float8 (one H100 or H200, torchao 0.17.0 on torch 2.11; 64 x 512
tokens per step, the preset's), in calls of about 6 to 8 minutes each so that every ratio,
to bf16 and to torchao tensorwise, is within one call (the third: adahop_lv2 with the row bounds
and with the exact row maxima; the fourth: wgrad's x packed and recomputed):

    python benchmarks/bench_train_speed.py --corpus runs/corpus --preset h200_125m --model-size 1b \\
        --steps 32 38 --run-steps 39 --calibration-steps 10 --calibration-micro-batches 4 --memory-snapshot \\
        --recipes torchao_float8_tensorwise torchao_float8_rowwise mxfp4
    python benchmarks/bench_train_speed.py --corpus runs/corpus --preset h200_125m --model-size 1b \\
        --steps 32 38 --run-steps 39 --calibration-steps 10 --calibration-micro-batches 4 --memory-snapshot \\
        --recipes torchao_float8_tensorwise adahop_lv2 adahop_lv2_tail
    python benchmarks/bench_train_speed.py --corpus runs/corpus --preset h200_125m --model-size 1b \\
        --steps 32 38 --run-steps 39 --calibration-steps 10 --calibration-micro-batches 4 --memory-snapshot \\
        --recipes torchao_float8_tensorwise adahop_lv2 --row-bounds both
    python benchmarks/bench_train_speed.py --corpus runs/corpus --preset h200_125m --model-size 1b \
        --steps 32 38 --run-steps 39 --calibration-steps 10 --calibration-micro-batches 4 --memory-snapshot \
        --recipes torchao_float8_tensorwise adahop_lv2 --wgrad-input both

The timed steps are 33 to 38 and step 39's memory is recorded: --run-steps 39 begins
adahop_lv2_tail's BF16 phase after step 31, so its row times the phase (the last 18% of adahop
train's default run) and adahop_lv2's row the steps before it. Every run's learning rate is still
warming up there (200 warm-up steps), as it would be at the preset's length.

Each recipe trains through ``adahop.train.trainer.train`` (the same model, data and optimizer as
``adahop train``; compiled whole, by blocks or not at all, with --cudagraphs in CUDA graphs) in
its own process, so that its peak memory and compile state are its own. The sequence is bf16, the
--recipes, bf16: BF16's own speed drifts by a few percent over a call, so each ratio is given
against both BF16 runs. --recipes takes adahop train's recipes and the torchao peers:

- ``torchao_float8_tensorwise``, ``torchao_float8_rowwise``: the bf16 run (recipe bf16: adahop
  converts nothing) with its linears converted by ``torchao.float8.convert_to_float8_training``
  (``Float8LinearConfig.from_recipe_name``) before ``train``: every linear adahop's conversion
  would take (not the LM head; the size rule's --min-features as for adahop) whose dims are
  multiples of 16. torchao is a dependency of this benchmark alone (``pip install torchao``),
  imported only for these runs; its float8 GEMMs need a GPU of compute capability >= 8.9;
- ``adahop_lv2_tail`` (adahop train's default): adahop_lv2 with the forward GEMM in BF16 from 82%
  of the run's steps (--run-steps N: after floor(0.82 N) steps). The row says whether the measured
  steps ran before the phase or in it; a phase that would begin among them is refused.

Per run:

- steady tokens/s and ms/step over the steps after P0 up to P1 (``--steps P0 P1``; the device
  synchronised at both edges, from the trainer's ``on_step`` hook), which must lie after the
  calibration (BF16 steps of the adaptive recipes) and the compilation of the MXFP4 steps;
- the time from the call of ``train`` to the end of the first step (model to the device,
  compilation of the first step);
- peak device memory (``torch.cuda.max_memory_allocated``): of the whole run up to P1, which
  includes the calibration (eager, BF16 GEMMs: the adaptive recipes' peak at large sizes; see
  --calibration-micro-batches), and of the steady steps after P0 up to P1 alone (not with
  --cudagraphs: a replay allocates nothing, its memory is the graphs' pool, made when they were
  recorded, and the allocator counts none of it once the peak is reset, so it would read as the
  parameters and optimizer state alone);
- the training loss of every step, each converted layer's modes and how many layers run each mode per GEMM;
- with ``--share-input both``, each adahop recipe twice: the layers that read one activation
  quantizing it once (the library's default, ``AdaHOPConfig.share_input``), then each its own;
- with ``--row-bounds both``, each adahop recipe twice: the e4m3 operands' row exponents from
  bounds taken by PyTorch ops (``layer.bounds``: one pass, the library's default on hopper_fp8),
  then from the exact row maxima (two passes; ``--row-bounds off`` alone);
- with ``--wgrad-input both``, each adahop recipe twice: wgrad's x packed by the forward and kept
  (the library's default, ``AdaHOPConfig.wgrad_input``), then quantized by the backward from x,
  which the compiled step recomputes instead of keeping (``--wgrad-input recompute`` alone);
- with ``--profile-steps N``: device time per step over N steps after P1 (CUDA kernels from
  ``torch.profiler``; on the CPU, self CPU time per op), and the top kernels;
- with ``--memory-snapshot`` (CUDA): the device memory of the next step, recorded with
  ``torch.cuda.memory._record_memory_history``, at its peak by kind: parameters, gradients,
  optimizer state, the tensors saved for the backward by dtype and shape, the rest by allocation
  site (benchmarks/memory_profile.py), in the row and printed after the table;
  --memory-pickle-dir keeps the snapshots.

The run stops after the last measured step (the hook raises ``StopTraining``: no checkpoint is
written), whatever the run's length (the learning rate schedule is the preset's, or --run-steps
long). The trainer writes its log into a temporary folder (or --run-dir), removed after each run.
Rows go to --out (JSONL, default runs/bench/bench_train_speed.jsonl), one per run with the
environment; a Markdown table is printed last: per run tokens/s against the first and the last
bf16 run and the torchao tensorwise run, and peak memory against the first bf16 run's. On the
CPU: ``--preset debug --model-size tiny --no-compile`` with a small corpus.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from pathlib import Path

import torch
from common import default_out, environment, print_environment, script_parser
from memory_profile import StepMemory, markdown

DEFAULT_RECIPES = ("adahop_lv2",)
# Peers: the same model, data, optimizer, autocast and compilation as bf16, with its linears
# converted by torchao's float8 training (``convert_to_float8_training``) in the named recipe
PEERS = {"torchao_float8_tensorwise": "tensorwise", "torchao_float8_rowwise": "rowwise"}


# ---- one run (in its own process) ---------------------------------------------------------------------------
def last_step(args) -> int:
    """The last step a run trains: P1, the profiled steps, the memory-recorded step."""
    return args.steps[1] + args.profile_steps + int(args.memory_snapshot)


def run_config(args, recipe: str, run_dir):
    """The TrainConfig of one run: the preset with this call's overrides, --run-steps long or long
    enough to reach the last measured step (the learning-rate schedule is the preset's, or over
    that many steps if the preset is shorter); a torchao peer trains recipe bf16 (its float8 is
    torchao's conversion, ``convert_peer``). Raises ValueError for a request this machine cannot
    run, and for a BF16 phase (adahop_lv2_tail) that would begin inside the measured steps."""
    from adahop.train.recipes import preset
    from adahop.train.trainer import resolve_device

    cfg = preset(args.preset, recipe="bf16" if recipe in PEERS else recipe, model_size=args.model_size,
                 calibration_steps=args.calibration_steps, calibration_micro_batches=args.calibration_micro_batches,
                 batch_size=args.batch_size, seq_len=args.seq_len, device=args.device, steps=args.run_steps,
                 out_dir=str(run_dir), corpus_dir=args.corpus, progress=False, compile=args.compile,
                 cudagraphs=args.cudagraphs, min_features=args.min_features,
                 eval_every=0, ckpt_every=0)
    cfg = dataclasses.replace(cfg, steps=max(cfg.steps, last_step(args)),
                              adahop=cfg.adahop.replace(
                                  share_input=args.share_input != "off",
                                  # (both: the parent checks the packed one; each worker gets its own)
                                  wgrad_input="packed" if args.wgrad_input == "both" else args.wgrad_input))
    cfg.validate()  # a device this machine lacks, a backend it cannot run: one line
    window_phase(cfg, recipe, args.steps[0], last_step(args))
    if args.memory_snapshot:
        require_memory_device(resolve_device(cfg.device))
    return cfg


def require_memory_device(device: torch.device) -> None:
    """--memory-snapshot records the CUDA caching allocator's history."""
    if device.type != "cuda":
        raise ValueError(f"--memory-snapshot records the CUDA allocator: it needs a CUDA device, this run's is "
                         f"{device}")


def window_phase(cfg, recipe: str, p0: int, last: int) -> str | None:
    """Where the measured steps (after P0 up to ``last``) lie against the run's BF16 phase
    (adahop_lv2_tail: the forward in BF16 from 82% of the steps): "before" it, "in" it (it began
    at least one step before P0, so its recompilation is not timed), or None (no phase). A phase
    beginning among them is a ValueError: the window would mix two step kinds."""
    switch = None if cfg.adahop.recipe == "bf16" else cfg.schedule.switch_step(cfg.steps)
    if switch is None:
        return None
    if switch >= last:
        return "before"
    if switch < p0:
        return "in"
    raise ValueError(f"{recipe}'s BF16 phase begins after step {switch} of the run's {cfg.steps}, inside the measured "
                     f"steps {p0 + 1}..{last}: give --run-steps (the phase begins after floor("
                     f"{cfg.bf16_phase_start} x run steps)) so that it begins before P0 = {p0}, or after step {last}")


# ---- the torchao float8 peers ----------------------------------------------------------------------------------
def torchao_float8():
    """``(torchao.__version__, Float8LinearConfig, convert_to_float8_training)``; a ValueError
    naming ``pip install torchao`` without it (a benchmark-only dependency, imported here only)."""
    try:
        import torchao
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as e:
        raise ValueError(f"the torchao float8 peers need torchao (pip install torchao): {e}") from None
    return torchao.__version__, Float8LinearConfig, convert_to_float8_training


def require_float8_device(device: torch.device) -> None:
    """torchao's float8 GEMMs (torch._scaled_mm) need a CUDA GPU of compute capability >= 8.9."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
        have = (f"capability {'.'.join(map(str, torch.cuda.get_device_capability(device)))}"
                if device.type == "cuda" else str(device))
        raise ValueError(f"the torchao float8 peers need a CUDA GPU of compute capability >= 8.9 (Ada, Hopper or "
                         f"later); this run's device is {have}")


def float8_filter(keep):
    """The linears torchao converts: those adahop's conversion would (``keep``: the LM head and
    the size rule's small layers stay BF16) whose dims are multiples of 16 (torchao's float8
    GEMMs need them)."""
    def accept(mod: torch.nn.Module, fqn: str) -> bool:
        return (isinstance(mod, torch.nn.Linear) and mod.in_features % 16 == 0 and mod.out_features % 16 == 0
                and keep(mod, fqn))

    return accept


def convert_peer(model, recipe: str, cfg, device: torch.device) -> dict:
    """Convert ``model`` (built as for bf16, still on the host) to torchao's float8 training with
    the peer's recipe, before ``train``: the trainer then finds no AdaHOP layer and converts, with
    recipe bf16, the linears torchao left (``F.linear``, as in the bf16 run). Returns the row's
    fields."""
    version, config_class, convert = torchao_float8()
    require_float8_device(device)
    accept = float8_filter(cfg.schedule.module_filter(model, cfg.min_features))
    before = {fqn for fqn, m in model.named_modules() if type(m) is torch.nn.Linear}
    convert(model, config=config_class.from_recipe_name(PEERS[recipe]), module_filter_fn=accept)
    converted = sorted(before - {fqn for fqn, m in model.named_modules() if type(m) is torch.nn.Linear})
    return {"torchao": version, "float8_recipe": PEERS[recipe], "float8_layers": len(converted)}


def measure(args, recipe: str) -> dict:
    """Train ``recipe`` up to its last measured step and measure it (see the module docstring)."""
    import adahop.train.trainer as trainer
    from adahop.data.corpus import load_corpus
    from adahop.ops.backends import get_backend
    from adahop.ops.backends.hopper_fp8 import HopperFP8Backend
    from adahop.train.run import open_run
    from adahop.train.trainer import StopTraining, resolve_device, train

    # the switch benchmarks use (ops.backends.hopper_fp8): this worker's process only
    HopperFP8Backend.takes_row_bounds = args.row_bounds != "off"
    p0, p1 = args.steps
    n_prof = args.profile_steps
    memory_step = p1 + n_prof + 1 if args.memory_snapshot else None
    run_dir = Path(tempfile.mkdtemp(prefix=f"speed_{recipe}_", dir=args.run_dir))
    make_optimizer = trainer.make_optimizer
    try:
        cfg = run_config(args, recipe, run_dir)
        device = resolve_device(cfg.device)
        corpus = load_corpus(cfg.corpus_dir)
        model, batches = open_run(cfg, corpus)
        peer = convert_peer(model, recipe, cfg, device) if recipe in PEERS else {}
        cuda = device.type == "cuda"

        def sync():
            if cuda:
                torch.cuda.synchronize(device)

        state: dict = {}

        def on_step(step, _model):
            if step == 1:
                sync()
                state["first_step_s"] = time.perf_counter() - state["t_start"]
            if step == p0:
                sync()
                state["t0"] = time.perf_counter()
                if cuda:  # the peak so far, then the steady steps' own from here
                    state["peak_before_p0"] = torch.cuda.max_memory_allocated(device)
                    torch.cuda.reset_peak_memory_stats(device)
            if step == p1:
                sync()
                state["window_s"] = time.perf_counter() - state["t0"]
                since_p0 = torch.cuda.max_memory_allocated(device) if cuda else None
                state["steady_peak_bytes"] = None if args.cudagraphs else since_p0
                state["peak_bytes"] = max(state["peak_before_p0"], since_p0) if cuda else None
                if n_prof:
                    activity = torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU
                    state["prof"] = torch.profiler.profile(activities=[activity])
                    state["prof"].start()
            if n_prof and step == p1 + n_prof:
                sync()
                state["prof"].stop()
                state.update(profile_summary(state.pop("prof"), n_prof, cuda))
            if memory_step is not None and step in (memory_step - 1, memory_step) and "memory_error" not in state:
                try:
                    record_memory(step == memory_step)
                except Exception as e:  # the run's speed is measured already: its row keeps it, with this error
                    traceback.print_exc()
                    state["memory_error"] = f"{type(e).__name__}: {e}"
            if step == last_step(args):
                raise StopTraining  # measured: no checkpoint (15 GB at 1B), no final evaluation

        def record_memory(stop: bool):
            """Start recording the memory of the next step, or stop and summarise it."""
            if not stop:
                state["memory"] = StepMemory(device)
                state["memory"].start()
                return
            state["memory_profile"], snapshot = state.pop("memory").stop(model, state["optimizer"])
            if args.memory_pickle_dir:
                path = Path(args.memory_pickle_dir) / f"{recipe}_{uuid.uuid4().hex[:8]}.pickle"
                with path.open("wb") as f:
                    pickle.dump(snapshot, f)
                state["memory_pickle"] = str(path)

        def capture_optimizer(*a, **kw):  # the optimizer the trainer builds: its state is a kind of memory
            state["optimizer"] = make_optimizer(*a, **kw)
            return state["optimizer"]

        trainer.make_optimizer = capture_optimizer
        state["t_start"] = time.perf_counter()
        summary = train(cfg, model=model, train_batches=batches, resume=False, on_step=on_step)
        if "window_s" not in state:
            raise RuntimeError(f"the run stopped at step {summary['steps']}, before P1 = {p1}")
        tokens_per_step = cfg.batch_size * cfg.grad_accum * cfg.seq_len
        s_per_step = state["window_s"] / (p1 - p0)
        row = {
            "recipe": recipe, **peer, "preset": args.preset, "model_size": cfg.model_size, "compile": args.compile,
            "cudagraphs": args.cudagraphs,
            "device": str(device),  # where the MXFP4 GEMMs ran (bf16 and the torchao peers run none)
            "backend": None if cfg.adahop.recipe == "bf16" else get_backend(cfg.adahop.backend, device).name,
            "run_steps": cfg.steps, "bf16_phase_start": cfg.bf16_phase_start,
            "window_phase": window_phase(cfg, recipe, p0, last_step(args)),
            "batch_size": cfg.batch_size,
            "seq_len": cfg.seq_len, "grad_accum": cfg.grad_accum, "tokens_per_step": tokens_per_step,
            "calibration_steps": cfg.adahop.calibration_steps if cfg.adahop.adaptive else 0,
            "calibration_micro_batches": cfg.calibration_micro_batches, "min_features": cfg.min_features,
            "share_input": cfg.adahop.share_input,
            "row_bounds": HopperFP8Backend.takes_row_bounds, "wgrad_input": cfg.adahop.wgrad_input,
            "window": [p0, p1], "steady_tokens_per_s": tokens_per_step / s_per_step,
            "ms_per_step": 1e3 * s_per_step, "first_step_s": state["first_step_s"],
            "peak_memory_bytes": state["peak_bytes"], "steady_peak_memory_bytes": state["steady_peak_bytes"],
            "losses": summary["losses"],
        }
        row["mode_counts"] = mode_counts(model)
        row["modes"] = layer_modes(model)
        if n_prof:
            row.update(profile_steps=n_prof, **{k: state[k] for k in ("profiled", "device_ms_per_step", "top")})
        if memory_step is not None:
            row.update(memory_step=memory_step, memory_profile=state.get("memory_profile"),
                       memory_pickle=state.get("memory_pickle"), memory_error=state.get("memory_error"))
        return row
    finally:
        trainer.make_optimizer = make_optimizer
        shutil.rmtree(run_dir, ignore_errors=True)


def layer_modes(model) -> dict[str, dict[str, str] | None]:
    """Each converted layer's modes by GEMM (None while it calibrates): which layers, e.g. of
    which width, keep x in BF16 for a BF16 wgrad."""
    from adahop.convert import adahop_layers

    return {fqn: None if layer.modes is None else dict(layer.modes) for fqn, layer in adahop_layers(model).items()}


def mode_counts(model) -> dict[str, dict[str, int]]:
    """How many converted layers run each mode, per GEMM (the frozen modes; a layer still
    calibrating counts as "calibrating"): what a run's memory and speed follow from, e.g. its BF16
    wgrads keep x in BF16 for the backward."""
    from adahop.convert import adahop_layers
    from adahop.policy import GEMMS

    counts: dict[str, dict[str, int]] = {gemm: {} for gemm in GEMMS}
    for layer in adahop_layers(model).values():
        for gemm in GEMMS:
            mode = "calibrating" if layer.modes is None else layer.modes[gemm]
            counts[gemm][mode] = counts[gemm].get(mode, 0) + 1
    return counts


def profile_summary(prof, steps: int, cuda: bool) -> dict:
    """Device time per step and the 30 largest entries. On CUDA (only the CUDA activity is
    recorded) each entry is a kernel or a copy, so they add up to the device's busy time; on
    the CPU each op's self time."""
    if cuda:
        events = [e for e in prof.key_averages() if e.device_time_total > 0]
        time_of = lambda e: e.device_time_total  # noqa: E731
    else:
        events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
        time_of = lambda e: e.self_cpu_time_total  # noqa: E731
    events.sort(key=lambda e: -time_of(e))
    return {
        "profiled": "cuda kernels" if cuda else "cpu op self time",
        "device_ms_per_step": sum(time_of(e) for e in events) / 1e3 / steps,
        "top": [[e.key[:80], round(time_of(e) / 1e3 / steps, 3), e.count // steps] for e in events[:30]],
    }


# ---- the sequence of runs ----------------------------------------------------------------------------------
def sequence(recipes: list[str], share_input: str = "on", row_bounds: str = "on",
             wgrad_input: str = "packed") -> list[tuple[str, str, str, str]]:
    """(recipe, --share-input, --row-bounds, --wgrad-input) of each run: bf16, the other recipes in
    order (with ``both``, each adahop recipe with x quantized once per group, then per layer; with
    bounds, then without; x packed, then recomputed; a torchao peer once), bf16."""
    shares = ("on", "off") if share_input == "both" else (share_input,)
    bounds = ("on", "off") if row_bounds == "both" else (row_bounds,)
    inputs = ("packed", "recompute") if wgrad_input == "both" else (wgrad_input,)
    adahop = [(s, b, w) for s in shares for b in bounds for w in inputs]
    plain = ("off", "on", "packed")
    return [("bf16", *plain),
            *[(r, *setting) for r in recipes if r != "bf16" for setting in ([plain] if r in PEERS else adahop)],
            ("bf16", *plain)]


def run_worker(argv: list[str], recipe: str, timeout: float | None) -> dict:
    """``measure(recipe)`` in a fresh process of this script; its row, or an ``error`` row."""
    with tempfile.TemporaryDirectory() as tmp:
        row_file = Path(tmp) / "row.json"
        cmd = [sys.executable, os.path.abspath(__file__), *argv, "--worker", recipe, "--row-file", str(row_file)]
        t0 = time.perf_counter()
        try:
            rc = subprocess.run(cmd, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            return {"recipe": recipe, "error": f"timed out after {timeout:g} s", "wall_s": time.perf_counter() - t0}
        wall = time.perf_counter() - t0
        if rc != 0 or not row_file.exists():
            return {"recipe": recipe, "error": f"worker exited with status {rc}", "wall_s": wall}
        return {**json.loads(row_file.read_text()), "wall_s": wall}


def ratio(a, b):
    return a / b if a and b else None


def run_name(r: dict) -> str:
    """A run's name in the table: the recipe, with x shared, the torchao version of a peer, the
    BF16 phase's part the measured steps ran in."""
    name = r["recipe"]
    if r.get("torchao"):
        name += f" (torchao {r['torchao']})"
    elif r.get("share_input") and r["recipe"] != "bf16":
        name += " (x shared)"
    if r.get("row_bounds") is False and r["recipe"] != "bf16":
        name += " (exact row maxima)"
    if r.get("wgrad_input") == "recompute" and r["recipe"] != "bf16":
        name += " (wgrad's x recomputed)"
    if r.get("window_phase") == "in":
        name += ", in its BF16 phase"
    elif r.get("window_phase") == "before":
        name += ", before its BF16 phase"
    return name


def table(rows: list[dict]) -> str:
    """Markdown: one line per run; tokens/s against the first and the last bf16 run and the
    first torchao tensorwise peer, peak memory against the first bf16 run's."""
    ok = [r for r in rows if "error" not in r]
    bf16 = [r for r in ok if r["recipe"] == "bf16"]
    tensorwise = [r for r in ok if r["recipe"] == "torchao_float8_tensorwise"]
    first = bf16[0]["steady_tokens_per_s"] if bf16 else None
    last = bf16[-1]["steady_tokens_per_s"] if len(bf16) > 1 else None
    peer = tensorwise[0]["steady_tokens_per_s"] if tensorwise else None
    bf16_peak = bf16[0]["peak_memory_bytes"] if bf16 else None
    head = ["run", "recipe", "tokens/s", "vs bf16 (first)", "vs bf16 (last)", "vs torchao tensorwise", "ms/step",
            "first step", "peak memory", "steady peak memory", "peak vs bf16", "device ms/step", "loss at P1"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    gib = lambda v: "-" if v is None else f"{v / 2**30:.2f} GiB"  # noqa: E731
    for i, r in enumerate(rows, 1):
        if "error" in r:
            lines.append(f"| {i} | {r['recipe']} | {r['error']} |" + " |" * (len(head) - 3))
            continue
        tps = r["steady_tokens_per_s"]
        p1 = r["window"][1]
        loss = r["losses"][p1 - 1] if len(r["losses"]) >= p1 else None
        lines.append(
            f"| {i} | {run_name(r)} | {tps:.0f} | {fmt(ratio(tps, first), '.3f')} | {fmt(ratio(tps, last), '.3f')} "
            f"| {fmt(ratio(tps, peer), '.3f')} | {r['ms_per_step']:.1f} | {r['first_step_s']:.1f} s "
            f"| {gib(r['peak_memory_bytes'])} | {gib(r.get('steady_peak_memory_bytes'))} "
            f"| {fmt(ratio(r['peak_memory_bytes'], bf16_peak), '.3f')} "
            f"| {fmt(r.get('device_ms_per_step'), '.1f')} | {fmt(loss, '.4f')} |")
    if first and last:
        lines.append(f"\nbf16 drift over the call: last / first = {last / first:.3f}")
    return "\n".join(lines)


# ---- command line ---------------------------------------------------------------------------------------------
def parse_args(argv=None):
    from adahop.llama.model import SIZES
    from adahop.recipes import RECIPE_NAMES
    from adahop.train.recipes import PRESETS

    p = script_parser(__doc__)
    g = p.add_argument_group("what")
    g.add_argument("--recipes", nargs="+", default=list(DEFAULT_RECIPES), choices=[*RECIPE_NAMES, *PEERS],
                   help="recipes timed between the two bf16 runs: adahop's (adahop_lv2_tail: adahop train's default, "
                        "see --run-steps) and the torchao float8 peers (torchao_float8_tensorwise, "
                        "torchao_float8_rowwise: needs torchao and a GPU of compute capability >= 8.9) "
                        "(default: %(default)s)")
    g.add_argument("--preset", default="h200_125m", choices=list(PRESETS),
                   help="training preset: batch, sequence length, optimizer, device (default: %(default)s)")
    g.add_argument("--model-size", default=None, choices=list(SIZES), help="model size (default: the preset's)")
    g.add_argument("--compile", choices=("model", "blocks", "none"), default="model",
                   help="as adahop train --compile: torch.compile the whole model, each transformer block, or "
                        "nothing (default: %(default)s)")
    g.add_argument("--no-compile", dest="compile", action="store_const", const="none", help="--compile none")
    g.add_argument("--cudagraphs", action="store_true",
                   help="with --compile model: replay each step's forward and backward as CUDA graphs "
                        "(torch.compile mode='reduce-overhead')")
    g.add_argument("--corpus", default="runs/corpus", help="corpus folder made by adahop data (default: %(default)s)")
    g.add_argument("--batch-size", type=int, default=None, help="sequences per step (default: the preset's)")
    g.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the preset's)")
    g.add_argument("--device", default=None, help="torch device (default: the preset's)")
    g.add_argument("--min-features", type=int, default=None, metavar="N",
                   help="the size rule: linears whose layer size, 2*in*out/(in+out), is below N stay BF16 (default: "
                        "the preset's, adahop.convert.MIN_FEATURES; 3072 is adahop.convert.HOPPER_MIN_FEATURES)")
    g.add_argument("--row-bounds", choices=("on", "off", "both"), default="on",
                   help="hopper_fp8's e4m3 operands with row exponents from bounds (on: the library's default), "
                        "from the exact row maxima (off), or each adahop recipe both ways (default: %(default)s)")
    g.add_argument("--wgrad-input", choices=("packed", "recompute", "both"), default="packed",
                   help="what a quantized wgrad reads of x (AdaHOPConfig.wgrad_input): packed by the forward (the "
                        "library's default), quantized by the backward (recompute), or each adahop recipe both ways "
                        "(default: %(default)s)")
    g.add_argument("--share-input", choices=("on", "off", "both"), default="on",
                   help="layers that read one activation quantize it once (on: the library's default), per layer "
                        "(off), or each recipe runs both ways (both) (default: %(default)s)")
    g = p.add_argument_group("measurement")
    g.add_argument("--steps", nargs=2, type=int, default=[30, 60], metavar=("P0", "P1"),
                   help="the timed window: steps after P0 up to P1 (default: 30 60)")
    g.add_argument("--calibration-steps", type=int, default=10,
                   help="BF16 calibration steps of the adaptive recipes, before P0 (default: %(default)s)")
    g.add_argument("--calibration-micro-batches", type=int, default=1, metavar="S",
                   help="as adahop train --calibration-micro-batches: the adaptive recipes' calibration steps run "
                        "as S micro-batches of batch/S sequences (for memory; the same calibration); a no-op for "
                        "the other recipes (default: %(default)s)")
    g.add_argument("--run-steps", type=int, default=None, metavar="N",
                   help="the runs' length: the learning-rate schedule's and where adahop_lv2_tail's BF16 phase "
                        "begins (after floor(0.82 N) steps); the runs still stop after the last measured step "
                        "(default: the preset's, or the last measured step if the preset is shorter: the phase "
                        "then lies after the window)")
    g.add_argument("--profile-steps", type=int, default=0,
                   help="profile this many steps after P1 (device time per step, top kernels; default: 0, none)")
    g.add_argument("--memory-snapshot", action="store_true",
                   help="record the device memory of one step after P1 (and the profiled steps) with "
                        "torch.cuda.memory._record_memory_history; its peak by kind (parameters, gradients, "
                        "optimizer state, saved activations by dtype and shape, the rest by allocation site: "
                        "benchmarks/memory_profile.py) goes into the row and is printed (CUDA only)")
    g.add_argument("--memory-pickle-dir", default=None, metavar="DIR",
                   help="with --memory-snapshot: also write each run's snapshot there as a pickle (hundreds of MB "
                        "at 1B; for torch.cuda._memory_viz, or memory_profile.py to summarise again)")
    g.add_argument("--timeout", type=float, default=None,
                   help="seconds each run may take before it is stopped and recorded as an error (default: none)")
    g = p.add_argument_group("output")
    g.add_argument("--out", default=str(default_out("bench_train_speed")),
                   help="JSONL file the rows are appended to, one per run (default: %(default)s)")
    g.add_argument("--run-dir", default=None,
                   help="folder for each run's trainer output (its log), removed after the run "
                        "(default: the system's temporary folder)")
    g = p.add_argument_group("internal")
    g.add_argument("--worker", default=None, metavar="RECIPE",
                   help="measure RECIPE in this process and write its row to --row-file (what each run's process "
                        "is started with)")
    g.add_argument("--row-file", default=None, help="where --worker writes its row (JSON)")
    args = p.parse_args(argv)
    p0, p1 = args.steps
    if not 1 <= p0 < p1:
        p.error(f"--steps P0 P1 needs 1 <= P0 < P1, got {p0} {p1}")
    if args.calibration_steps < 1 or args.calibration_micro_batches < 1 or args.profile_steps < 0:
        p.error("--calibration-steps and --calibration-micro-batches must be >= 1 and --profile-steps >= 0")
    if args.calibration_steps >= p0:
        p.error(f"the timed window must start after the calibration: --calibration-steps {args.calibration_steps} "
                f">= P0 = {p0}")
    if args.cudagraphs and args.compile != "model":
        p.error("--cudagraphs needs --compile model")
    if args.run_steps is not None and args.run_steps < last_step(args):
        p.error(f"--run-steps {args.run_steps} ends before the last measured step, {last_step(args)}")
    if args.memory_snapshot and args.cudagraphs:
        p.error("--memory-snapshot with --cudagraphs would see no step's allocations (a replay allocates nothing)")
    if args.memory_pickle_dir and not args.memory_snapshot:
        p.error("--memory-pickle-dir needs --memory-snapshot")
    if args.worker is not None and args.row_file is None:
        p.error("--worker needs --row-file")
    return args


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.worker is not None:
        try:
            row = measure(args, args.worker)
        except ValueError as e:  # a bad request (device, corpus): one line
            print(f"bench_train_speed.py: {e}", file=sys.stderr)
            return 2
        Path(args.row_file).write_text(json.dumps(row))
        for name, ms, count in row.get("top", [])[:12]:
            print(f"    {ms:8.3f} ms x{count:<4d} {name}")
        return 0
    env = environment("bench_train_speed.py", argv)
    print_environment(env)
    try:  # refuse a request that cannot run here before starting any run
        from adahop.data.corpus import load_corpus

        for folder in (args.run_dir, args.memory_pickle_dir):
            if folder:
                Path(folder).mkdir(parents=True, exist_ok=True)
        for recipe in dict.fromkeys(r for r, *_ in sequence(args.recipes, args.share_input)):
            run_config(args, recipe, args.run_dir or tempfile.gettempdir())
        if any(r in PEERS for r in args.recipes):
            from adahop.train.trainer import resolve_device

            print(f"torchao {torchao_float8()[0]}")
            require_float8_device(resolve_device(run_config(args, "bf16", tempfile.gettempdir()).device))
        load_corpus(args.corpus, verify=False)
    except (ValueError, OSError) as e:
        print(f"bench_train_speed.py: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    call = uuid.uuid4().hex[:12]  # the runs of one call share it (their ratios belong together)
    rows = []
    for i, (recipe, share_input, row_bounds, wgrad_input) in enumerate(
            sequence(args.recipes, args.share_input, args.row_bounds, args.wgrad_input), 1):
        print(f"[{i}] {recipe} ...", flush=True)
        settings = ["--share-input", share_input, "--row-bounds", row_bounds, "--wgrad-input", wgrad_input]
        row = {**run_worker([*argv, *settings], recipe, args.timeout), "call": call, "run": i}
        rows.append(row)
        with out.open("a") as f:
            f.write(json.dumps({"benchmark": "bench_train_speed", **row, "env": env}) + "\n")
        if "error" in row:
            print(f"[{i}] {recipe}: {row['error']}", flush=True)
        else:
            print(f"[{i}] {recipe}: {row['steady_tokens_per_s']:.0f} tokens/s, {row['ms_per_step']:.1f} ms/step, "
                  f"first step {row['first_step_s']:.1f} s, wall {row['wall_s']:.0f} s", flush=True)
    print(f"\nrows appended to {out} (call {call})\n")
    print(table(rows))
    for i, r in enumerate(rows, 1):
        if r.get("memory_error"):
            print(f"\n{i}. {run_name(r)}: the memory snapshot failed: {r['memory_error']}")
        if r.get("memory_profile"):
            print("\n" + markdown(r["memory_profile"], title=f"{i}. {run_name(r)}: memory at the peak of step "
                                                              f"{r['memory_step']}"))
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
