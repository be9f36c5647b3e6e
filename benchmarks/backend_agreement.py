"""Does a converted model train the same on two backends? One recipe, model, corpus, seed and
number of steps, trained once per backend (default: ``reference``, the numerics' definition,
and ``auto``, the fastest this device has). The report compares the training losses step by
step, and the held-out losses.

The backends quantize to the same bits (codes, scales; the kernel tests check this). They differ
only in the GEMM's fp32 accumulation order: FP8 tensor cores for ``hopper_fp8``, a float32
matmul of the dequantized operands for ``reference``. The calibration steps run in BF16 and are
the same on both. Past them, a difference cannot stay at rounding size for the whole run:
- a changed last bit in a bf16 output can flip an MXFP4 rounding downstream;
- training carries any perturbation forward, as it does a different data order.
So the report gives the loss difference per window of steps. The yardstick is the gap between
recipes (MXFP4 against BF16: hundredths of a nat here), which it must stay well below.

    python benchmarks/backend_agreement.py --corpus runs/corpus --out runs/agree \\
        --preset h200 --steps 300 --recipe adahop_lv2 --backends reference hopper_fp8

(``--report-only`` compares runs already made, e.g. by ``adahop train --backend B --out
runs/agree/B`` side by side on one GPU; a run cut short is compared over the steps it logged.)

Writes ``agreement.md`` and ``agreement.json`` (the table and every step's losses) and
``loss_curves.png`` (the curves, and each backend's loss minus the first's), and one run folder
per backend.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from common import environment, environment_line, print_environment

import adahop
from adahop import cli
from adahop.config import BACKEND_CHOICES
from adahop.train.recipes import PRESETS
from adahop.train.run_log import read_log
from adahop.train.trainer import TrainConfig


def windows(first: int, last: int, parts: int) -> list[tuple[int, int]]:
    """``[first, last]`` cut into at most ``parts`` consecutive step ranges of near-equal size."""
    n = last - first + 1
    if n <= 0:
        return []
    parts = min(parts, n)
    bounds = [first + round(i * n / parts) for i in range(parts + 1)]
    return [(bounds[i], bounds[i + 1] - 1) for i in range(parts)]


def compare(losses: dict[str, dict[int, float]], calibration_steps: int, parts: int = 5) -> list[dict]:
    """Per window of steps, for each backend after the first: the mean and the largest absolute
    difference of its training loss from the first backend's, and the mean signed difference.
    The calibration steps are a window of their own."""
    names = list(losses)
    base = losses[names[0]]
    steps = sorted(set.intersection(*(set(v) for v in losses.values())))
    if not steps:
        raise ValueError("the runs have no logged step in common")
    last = steps[-1]
    spans = ([(1, calibration_steps)] if calibration_steps else []) + windows(calibration_steps + 1, last, parts)
    rows = []
    for lo, hi in spans:
        at = [s for s in steps if lo <= s <= hi]
        if not at:
            continue
        row = {"steps": (lo, hi), "calibration": hi <= calibration_steps}
        for name in names[1:]:
            d = [losses[name][s] - base[s] for s in at]
            row[name] = {"mean_abs": sum(map(abs, d)) / len(d), "max_abs": max(map(abs, d)), "mean": sum(d) / len(d)}
        rows.append(row)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", required=True, help="corpus folder made by adahop data")
    p.add_argument("--out", required=True, help="folder of the run folders (one per backend) and the report")
    p.add_argument("--preset", default="h200", choices=list(PRESETS), help="training preset (default: %(default)s)")
    p.add_argument("--recipe", default="adahop_lv2", choices=[r for r in adahop.RECIPES if r != "bf16"],
                   help="the recipe trained on every backend (default: %(default)s)")
    p.add_argument("--backends", nargs="+", default=["reference", "auto"], choices=BACKEND_CHOICES,
                   help="backends to train on; every difference is to the first (default: reference auto)")
    p.add_argument("--steps", type=int, default=None, help="training steps (default: the preset's)")
    p.add_argument("--seed", type=int, default=None, help="seed of every run (default: the preset's)")
    p.add_argument("--calibration-steps", type=int, default=None, help="BF16 calibration steps (default: the preset's)")
    p.add_argument("--batch-size", type=int, default=None, help="sequences per step (default: the preset's)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the preset's)")
    p.add_argument("--device", default=None, help="default: the preset's (a GPU when there is one)")
    p.add_argument("--windows", type=int, default=5, help="windows of steps after calibration in the table")
    p.add_argument("--report-only", action="store_true",
                   help="only compare the runs already in OUT/<backend> (e.g. trained side by side, or cut short)")
    args = p.parse_args(argv)
    env = environment("backend_agreement.py", argv)
    print_environment(env)
    if len(set(args.backends)) < 2:
        p.error(f"--backends needs two different backends, got {args.backends}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    runs = {}
    for backend in args.backends:
        run = out / backend
        if args.report_only:
            if not (run / "log.jsonl").exists():
                p.error(f"--report-only: no training log in {run}")
            runs[backend] = run
            continue
        train_argv = ["train", "--preset", args.preset, "--recipe", args.recipe, "--corpus", args.corpus,
                      "--out", str(run), "--backend", backend, "--no-progress", "--threads", "0", "--no-resume"]
        for flag, value in (("--steps", args.steps), ("--seed", args.seed),
                            ("--calibration-steps", args.calibration_steps), ("--batch-size", args.batch_size),
                            ("--seq-len", args.seq_len), ("--device", args.device)):
            if value is not None:
                train_argv += [flag, str(value)]
        if cli.main(train_argv) != 0:
            return 2
        runs[backend] = run

    configs = {b: TrainConfig.from_dict(json.loads((r / "config.json").read_text())) for b, r in runs.items()}
    # What must agree: everything the runs train with, but where they run and how they log.
    ignored = ("out_dir", "device", "compile", "progress", "log_every", "sync_every", "ckpt_every", "keep_checkpoints")
    described = {b: {**{k: v for k, v in c.to_dict().items() if k not in ignored},
                     "adahop": {**c.adahop.to_dict(), "backend": None}} for b, c in configs.items()}
    differ = sorted(k for k in described[args.backends[0]]
                    if len({json.dumps(d.get(k), sort_keys=True) for d in described.values()}) > 1)
    if differ:
        print(f"the runs differ in {differ}: not comparable", file=sys.stderr)
        return 2
    first = args.backends[0]  # the baseline of every difference
    recipe = configs[first].recipe
    logs = {b: read_log(r) for b, r in runs.items()}
    losses = {b: {rec["step"]: rec["loss"] for rec in log if "loss" in rec} for b, log in logs.items()}
    heldout = {b: next((rec["final_eval"]["loss"] for rec in reversed(log) if rec.get("final_eval")), math.nan)
               for b, log in logs.items()}
    modes = {b: (r / "modes.json").read_text() if (r / "modes.json").exists() else None for b, r in runs.items()}
    # a fixed recipe runs MXFP4 from the first step
    calibration = configs[first].adahop.calibration_steps if configs[first].adahop.adaptive else 0
    rows = compare(losses, calibration, args.windows)

    lines = [f"# {recipe} on {', '.join(args.backends)}: training losses compared", "",
             f"Model `{configs[first].model_size}`, {configs[first].batch_size} x {configs[first].seq_len} "
             f"tokens per step, {max(losses[first])} steps logged, seed {configs[first].seed}, calibration: "
             f"{calibration} steps. Same calibrated modes on every backend: "
             f"{'yes' if len(set(modes.values())) == 1 else 'NO (the comparison below is not of the same GEMMs)'}.", "",
             "| backend | held-out loss | difference to " + first + " |", "|---|---|---|"]
    for b in args.backends:
        lines.append(f"| {b} | {heldout[b]:.4f} | {heldout[b] - heldout[first]:+.4f} |")
    lines += ["", f"Training loss minus {first}'s, per window of steps:", "",
              "| steps | " + " | ".join(f"{b}: mean abs | max abs | mean" for b in args.backends[1:]) + " |",
              "|---|" + "---|---|---|" * (len(args.backends) - 1)]
    for row in rows:
        lo, hi = row["steps"]
        label = f"{lo}-{hi}" + (" (calibration, BF16)" if row["calibration"] else "")
        cells = [f"{row[b]['mean_abs']:.2e} | {row[b]['max_abs']:.2e} | {row[b]['mean']:+.2e}"
                 for b in args.backends[1:]]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", f"Report made on: {environment_line(env)}" + (" (runs made earlier)" if args.report_only else "")]
    report = "\n".join(lines) + "\n"
    (out / "agreement.md").write_text(report)
    (out / "agreement.json").write_text(json.dumps(
        {"recipe": recipe, "env": env, "config": configs[first].to_dict(), "backends": args.backends,
         "heldout": heldout,
         "same_modes": len(set(modes.values())) == 1, "windows": rows,
         "losses": {b: [losses[b][s] for s in sorted(losses[b])] for b in args.backends}}, indent=1))
    from adahop.train.plot import plot_loss_curves

    plot_loss_curves({b: [r for r in logs[b] if "loss" in r] for b in args.backends}, out / "loss_curves.png",
                     title=f"{recipe}: training loss by backend", baseline=first, gap_smooth=10)
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
