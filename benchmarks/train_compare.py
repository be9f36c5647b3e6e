"""The recipe comparison: the same model, data, tokens and seed under every recipe; held-out
loss and bits per byte, zero-shot tasks, tokens/s and peak memory; a table (Markdown) and the
loss curves (PNG).

    adahop data --out runs/corpus --sources shakespeare gcide python-doc wordnet brown
    python -c "from adahop.data.tasks import export_task_files; export_task_files('runs/tasks')"
    python benchmarks/train_compare.py --corpus runs/corpus --tasks-dir runs/tasks --out runs/compare \\
        --preset h200 --steps 1000 --recipes bf16 adahop_lv2

(On a machine without network, build the corpus and export the task files where there is one,
and copy both over.) Each recipe is one ``adahop train`` + ``adahop eval``, so a run that is
interrupted resumes from its checkpoint when the same command runs again. ``--gpus N`` runs the
recipes as N processes, one per GPU (``CUDA_VISIBLE_DEVICES``), each taking every N-th recipe in
turn, then writes the report over all of them: each run still has a GPU to itself, so its
tokens/s is not shared with another run. ``--per-gpu K`` puts K such processes on each GPU
(every (N*K)-th recipe each): the quality results are the same, the runs finish sooner in total,
and their tokens/s are shared (measure speed with one process per GPU, or with
benchmarks/bench_train_speed.py):

    python benchmarks/train_compare.py --corpus runs/corpus --tasks-dir runs/tasks \\
        --out runs/compare_125m --preset h200_125m --recipes bf16 adahop_lv2 --per-gpu 2

Writes ``comparison.md`` and ``loss_curves.png`` in --out, and one run folder per recipe.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from common import environment, environment_line, print_environment

import adahop
from adahop import cli
from adahop.train.compare import compare_runs
from adahop.train.recipes import PRESETS


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", required=True, help="corpus folder made by adahop data")
    p.add_argument("--out", required=True, help="folder of the run folders (one per recipe) and the report")
    p.add_argument("--preset", default="h200", choices=list(PRESETS), help="training preset (default: %(default)s)")
    p.add_argument("--steps", type=int, default=None, help="training steps (default: the preset's)")
    p.add_argument("--seed", type=int, default=None, help="override the preset's seed (every recipe the same)")
    p.add_argument("--recipes", nargs="+", default=list(adahop.RECIPES), choices=list(adahop.RECIPES),
                   help="recipes to train and compare (default: all)")
    p.add_argument("--tasks", nargs="*", default=["piqa", "hellaswag", "arc_easy", "lambada"],
                   help="zero-shot tasks of adahop eval; none: held-out loss only (default: %(default)s)")
    p.add_argument("--tasks-dir", default=None, help="folder of exported task files (adahop eval --tasks-dir)")
    p.add_argument("--limit", type=int, default=None, help="first N items of each task")
    p.add_argument("--eval-batch-size", type=int, default=128, help="adahop eval --batch-size (default: %(default)s)")
    p.add_argument("--compile", choices=("auto", "model", "blocks", "none"), default=None,
                   help="adahop train --compile (default: its own, auto: the whole model on a GPU)")
    p.add_argument("--gpus", type=int, default=1, help="run the recipes in this many processes, one GPU each")
    p.add_argument("--per-gpu", type=int, default=1, help="processes sharing each GPU (shared tokens/s)")
    p.add_argument("--no-report", action="store_true", help="(worker processes) train and evaluate only")
    p.add_argument("--report-only", action="store_true", help="only write the report of the finished runs")
    args = p.parse_args(argv)
    env = environment("train_compare.py", argv)
    print_environment(env)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.report_only:
        return write_report(args, out)
    if args.gpus < 1 or args.per_gpu < 1:
        p.error("--gpus and --per-gpu must be >= 1")
    visible = torch.cuda.device_count()
    if 0 < visible < args.gpus:  # (with no GPU at all every worker runs on the CPU, alike)
        p.error(f"--gpus {args.gpus} needs {args.gpus} visible GPUs, this machine has {visible}: the "
                "workers without one would train on the CPU, whose results are not the GPU's")
    if args.gpus * args.per_gpu > 1:
        return run_parallel(args)
    for recipe in args.recipes:
        run = out / recipe
        t0 = time.perf_counter()
        train_argv = ["train", "--preset", args.preset, "--recipe", recipe, "--corpus", args.corpus,
                      "--out", str(run), "--no-progress", "--threads", "0"]
        if args.steps:
            train_argv += ["--steps", str(args.steps)]
        if args.seed is not None:
            train_argv += ["--seed", str(args.seed)]
        if args.compile:
            train_argv += ["--compile", args.compile]
        if cli.main(train_argv) != 0:
            return 2
        eval_argv = ["eval", "--run", str(run), "--tasks", *args.tasks]
        if args.tasks_dir:
            eval_argv += ["--tasks-dir", args.tasks_dir]
        if args.limit:
            eval_argv += ["--limit", str(args.limit)]
        eval_argv += ["--batch-size", str(args.eval_batch_size)]
        t1 = time.perf_counter()
        if cli.main(eval_argv) != 0:
            return 2
        t2 = time.perf_counter()
        (run / "wall_times.json").write_text(json.dumps({"train_s": t1 - t0, "eval_s": t2 - t1, "env": env}))
        print(f"[{recipe}] train {t1 - t0:.0f} s, eval {t2 - t1:.0f} s", flush=True)
    return 0 if args.no_report else write_report(args, out)


def run_parallel(args) -> int:
    """``gpus * per_gpu`` worker processes, worker i on GPU ``i % gpus`` running every
    (gpus * per_gpu)-th recipe from the i-th; then the report."""
    base = ["--corpus", args.corpus, "--out", args.out, "--preset", args.preset,
            "--eval-batch-size", str(args.eval_batch_size), "--tasks", *args.tasks]
    for flag, value in (("--steps", args.steps), ("--seed", args.seed), ("--tasks-dir", args.tasks_dir),
                        ("--limit", args.limit)):
        if value is not None:
            base += [flag, str(value)]
    if args.compile:
        base += ["--compile", args.compile]
    procs = []
    workers = args.gpus * args.per_gpu
    for i in range(workers):
        mine = args.recipes[i::workers]
        if not mine:
            continue
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(i % args.gpus))
        log = open(Path(args.out) / f"worker{i}.log", "w")
        cmd = [sys.executable, __file__, *base, "--recipes", *mine, "--no-report"]
        procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    codes = [p.wait() for p, _ in procs]
    for _, log in procs:
        log.close()
    report = write_report(args, Path(args.out))
    return report if all(c == 0 for c in codes) else 2


def write_report(args, out: Path) -> int:
    """comparison.md and loss_curves.png over the recipes whose run has an eval.json."""
    dirs, evals = [], {}
    for recipe in args.recipes:
        ev = out / recipe / "eval.json"
        if ev.exists():
            dirs.append(out / recipe)
            evals[recipe] = json.loads(ev.read_text())
    if not dirs:
        print("no finished run to report", file=sys.stderr)
        return 2
    same = ("model_size", "steps", "batch_size", "grad_accum", "seq_len", "seed", "lr")
    configs = {d.name: json.loads((d / "config.json").read_text()) for d in dirs}
    keys = {name: (tuple(c[k] for k in same), c["extra"].get("corpus_id")) for name, c in configs.items()}
    if len(set(keys.values())) > 1:
        print(f"the runs differ in {same} or corpus, not comparable: {keys}", file=sys.stderr)
        return 2
    table = compare_runs(dirs, out / "loss_curves.png")
    zs = ["| recipe | " + " | ".join(args.tasks) + " | average |", "|---|" + "---|" * (len(args.tasks) + 1)]
    for recipe, ev in evals.items():
        tasks = ev.get("zero_shot", {}).get("tasks", {})
        cells = [f"{100 * tasks[t]['score']:.2f}" if t in tasks else "-" for t in args.tasks]
        avg = ev.get("zero_shot", {}).get("average")
        avg_cell = f"{100 * avg:.2f}" if avg is not None else "-"
        zs.append(f"| {recipe} | " + " | ".join(cells) + f" | {avg_cell} |")
    report = f"{table}\n\nZero-shot (percent; primary metric per task):\n\n" + "\n".join(zs) + "\n"
    walls = [json.loads((d / "wall_times.json").read_text()) for d in dirs if (d / "wall_times.json").exists()]
    machines = sorted({environment_line(w["env"]) for w in walls if "env" in w})
    if machines:
        report += "\nRuns made on: " + " / ".join(machines) + "\n"
    (out / "comparison.md").write_text(report)
    print(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
