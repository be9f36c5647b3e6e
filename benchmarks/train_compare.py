"""The recipe comparison of the training issue: same model, data, tokens and seed under every
recipe; held-out loss and bits per byte, zero-shot tasks, tokens/s and peak memory; a table
(markdown) and the loss curves (PNG).

On the GPU machine (no network there): build the corpus and export the task files here first,
carry both, then run, e.g.

    adahop data --out .carry/corpus --sources shakespeare gcide python-doc wordnet brown
    python -c "from adahop.train.tasks import export_task_files; export_task_files('.carry/tasks')"
    # on the device, with carry [".carry"]:
    python benchmarks/train_compare.py --corpus .carry/corpus --tasks-dir .carry/tasks --out $OUT/cmp \\
        --preset h200 --steps 1000 --recipes bf16 adahop_lv2

Each recipe is one ``adahop train`` + ``adahop eval`` (so a run interrupted by the 10-minute
command limit resumes from its checkpoint when the same command runs again).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import adahop
from adahop import cli


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--preset", default="h200")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--recipes", nargs="+", default=list(adahop.RECIPES), choices=list(adahop.RECIPES))
    p.add_argument("--tasks", nargs="*", default=["piqa", "hellaswag", "arc_easy", "lambada"])
    p.add_argument("--tasks-dir", default=None)
    p.add_argument("--limit", type=int, default=None, help="first N items of each task")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dirs, evals = [], {}
    for recipe in args.recipes:
        run = out / recipe
        t0 = time.perf_counter()
        train_argv = ["train", "--preset", args.preset, "--recipe", recipe, "--corpus", args.corpus,
                      "--out", str(run), "--no-progress", "--threads", "0"]
        if args.steps:
            train_argv += ["--steps", str(args.steps)]
        if cli.main(train_argv) != 0:
            return 2
        eval_argv = ["eval", "--run", str(run), "--tasks", *args.tasks]
        if args.tasks_dir:
            eval_argv += ["--tasks-dir", args.tasks_dir]
        if args.limit:
            eval_argv += ["--limit", str(args.limit)]
        if cli.main(eval_argv) != 0:
            return 2
        evals[recipe] = json.loads((run / "eval.json").read_text())
        print(f"[{recipe}] {time.perf_counter() - t0:.0f} s", flush=True)
        dirs.append(run)
    table = cli.compare_runs(dirs, out / "loss_curves.png")
    zs = ["| recipe | " + " | ".join(args.tasks) + " | average |", "|---|" + "---|" * (len(args.tasks) + 1)]
    for recipe, ev in evals.items():
        tasks = ev.get("zero_shot", {}).get("tasks", {})
        cells = [f"{100 * tasks[t]['score']:.2f}" if t in tasks else "-" for t in args.tasks]
        avg = ev.get("zero_shot", {}).get("average")
        avg_cell = f"{100 * avg:.2f}" if avg is not None else "-"
        zs.append(f"| {recipe} | " + " | ".join(cells) + f" | {avg_cell} |")
    report = f"{table}\n\nZero-shot (percent; primary metric per task):\n\n" + "\n".join(zs) + "\n"
    (out / "comparison.md").write_text(report)
    print(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
