"""Where does an MXFP4 recipe's loss gap come from? Train the same model under variants of
adahop_lv2 that each change one thing (a GEMM kept in BF16, the gradient rounding, the scale
mode) and compare held-out losses with bf16 and naive mxfp4, several seeds each.

    python benchmarks/ablation.py --corpus runs/corpus --out runs/ablation --preset cpu \\
        --variants bf16 lv2 lv2_fprop_bf16 --seeds 0 1
    python benchmarks/ablation.py --corpus runs/corpus --out runs/ablation --report

On a GPU machine use a GPU preset (``--preset h200``, with ``--threads 0``); the runs of one
call are sequential. Each (variant, seed) is one training run in ``<out>/<variant>-s<seed>``
(resumable); ``--report`` writes ``ablation.md`` over every finished run: each variant's
held-out gap to bf16, paired by seed, per seed and averaged.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

from common import environment, environment_line, print_environment

import adahop
from adahop.policy import GEMMS, table_policy
from adahop.train.recipes import PRESETS


def _lv2_forcing(**forced):
    """adahop_lv2 whose policy output is overridden for some GEMMs (e.g. dgrad="bf16")."""

    def policy(summary):
        modes = table_policy(summary, "lv2")
        modes.update(forced)
        return modes

    return adahop.AdaHOPConfig.from_recipe_name("adahop_lv2", policy_fn=policy)


def _lv2_settings(**changes):
    """adahop_lv2 with GemmConfig fields changed in all three GEMMs."""
    return adahop.AdaHOPConfig.from_recipe_name("adahop_lv2").with_gemm_settings(**changes)


def _lv2_grad_rne(**changes):
    cfg = adahop.AdaHOPConfig.from_recipe_name("adahop_lv2").with_gemm_settings(**changes)
    return cfg.replace(dgrad=dataclasses.replace(cfg.dgrad, a_rounding="rne"),
                       wgrad=dataclasses.replace(cfg.wgrad, a_rounding="rne"))


VARIANTS = {
    "bf16": lambda: adahop.AdaHOPConfig.from_recipe_name("bf16"),
    "mxfp4": lambda: adahop.AdaHOPConfig.from_recipe_name("mxfp4"),
    "lv2": lambda: adahop.AdaHOPConfig.from_recipe_name("adahop_lv2"),
    "lv2_fprop_bf16": lambda: _lv2_forcing(fprop="bf16"),  # only the backward in MXFP4
    "lv2_dgrad_bf16": lambda: _lv2_forcing(dgrad="bf16"),
    "lv2_wgrad_bf16": lambda: _lv2_forcing(wgrad="bf16"),
    "lv2_bwd_bf16": lambda: _lv2_forcing(dgrad="bf16", wgrad="bf16"),  # only the forward in MXFP4
    # The calibration sees the untrained network and gives fprop plain IHT in every layer (125M:
    # 84 of 84), so OE never reaches the forward GEMM: does forcing it there help?
    "lv2_fprop_oe_left": lambda: _lv2_forcing(fprop="iht+oe_left"),  # the k largest tokens of x
    "lv2_fprop_oe_right": lambda: _lv2_forcing(fprop="iht+oe_right"),  # the k largest rows of w
    "lv2_signs_fprop_oe_right": lambda: _lv2_forcing(fprop="iht+oe_right").with_gemm_settings(random_signs=True),
    "lv2_grad_rne": _lv2_grad_rne,  # gradients rounded to nearest instead of stochastically
    "lv2_rceil": lambda: _lv2_settings(scale_mode="rceil"),  # scales that never clip
    "lv2_floor": lambda: _lv2_settings(scale_mode="floor"),  # the OCP MX scale (clips up to 1.75x)
    "lv2_grad_rne_rceil": lambda: _lv2_grad_rne(scale_mode="rceil"),
    "lv2_h128": lambda: _lv2_settings(hadamard_size=128),  # a wider Hadamard in every GEMM
    "lv2_signs": lambda: _lv2_settings(random_signs=True),  # random-sign Hadamard (Tseng et al.)
    "lv2_signs_grad_rne": lambda: _lv2_grad_rne(random_signs=True),
}
# Variants with a BF16 phase (TrainConfig.bf16_phase_start / _gemms, train/precision.py): the
# last fraction of the steps runs the listed GEMMs in BF16 (the higher-precision final phase of
# Chmiel et al., "FP4 All the Way", 2025; NVIDIA's NVFP4 recipe switches the forward alone).
BF16_TAIL = {"lv2_bf16_tail": (0.1, GEMMS), "lv2_bf16_tail25": (0.25, GEMMS),
             "lv2_bf16_fprop_tail": (0.18, ("fprop",))}
VARIANTS.update({name: VARIANTS["lv2"] for name in BF16_TAIL})  # lv2 until the tail


def variant_config(name: str, base: adahop.AdaHOPConfig, seed: int) -> adahop.AdaHOPConfig:
    """Variant ``name`` with the preset's calibration length, backend and OE k per GEMM (they
    scale with the model), and the SR seed ``seed``."""
    q = VARIANTS[name]().replace(calibration_steps=base.calibration_steps, backend=base.backend, seed=seed)
    return q.replace(**{g: dataclasses.replace(q.gemm(g), oe_k=base.gemm(g).oe_k) for g in GEMMS})


def run_one(args, name: str, seed: int, env: dict) -> None:
    from adahop.train.data import load_corpus
    from adahop.train.recipes import preset
    from adahop.train.run import heldout_eval, open_run
    from adahop.train.trainer import train

    out = Path(args.out) / f"{name}-s{seed}"
    overrides = dict(seed=seed, out_dir=str(out), corpus_dir=args.corpus, steps=args.steps, lr=args.lr,
                     progress=False, compile=args.compile)
    base = preset(args.preset, **overrides).adahop
    # train() converts the model with cfg.adahop: the variant's numerics, set as a whole
    if name in BF16_TAIL:
        tail, gemms = BF16_TAIL[name]
        overrides.update(bf16_phase_start=1 - tail, bf16_phase_gemms=gemms)
    cfg = preset(args.preset, adahop=variant_config(name, base, seed), **overrides)
    corpus = load_corpus(cfg.corpus_dir)
    model, batches = open_run(cfg, corpus)

    def eval_fn(m):
        return heldout_eval(m, corpus, seq_len=cfg.seq_len, batch_size=cfg.batch_size, max_batches=cfg.eval_batches)

    summary = train(cfg, model=model, train_batches=batches, eval_fn=eval_fn)
    result = {"variant": name, "seed": seed, "steps": summary["steps"], "heldout_loss": summary["final_eval"]["loss"],
              "last_train_losses": summary["losses"][-50:], "tokens_per_s": summary["tokens_per_s"],
              "peak_memory_bytes": summary["peak_memory_bytes"], "compile": cfg.compile, "env": env}
    # The same weights evaluated with every GEMM in BF16: how much of the gap is the MXFP4
    # forward at evaluation time, and how much is in the trained weights.
    for layer in adahop.adahop_layers(model).values():
        layer.set_modes({gemm: "bf16" for gemm in GEMMS})
    result["heldout_loss_bf16_eval"] = eval_fn(model)["loss"]
    (out / "ablation.json").write_text(json.dumps(result, indent=1))
    print(f"[{name} seed {seed}] held-out {result['heldout_loss']:.4f}, "
          f"BF16 evaluation {result['heldout_loss_bf16_eval']:.4f}", flush=True)


def report(out: Path) -> str:
    """Gaps are paired by seed (a seed fixes the initialisation and the data order, which move the
    loss far more than the numerics do): gap = variant(seed) - bf16(seed), over the seeds that
    both finished."""
    runs = [json.loads(p.read_text()) for p in sorted(out.glob("*/ablation.json"))]
    loss = {(r["variant"], r["seed"]): r["heldout_loss"] for r in runs}
    base = {seed: v for (name, seed), v in loss.items() if name == "bf16"}
    if not base:
        raise SystemExit("no finished bf16 run to compare with")
    lines = ["| variant | seeds | gap to bf16, mean over seeds | gap per seed | held-out loss per seed |",
             "|---|---|---|---|---|"]
    for name in VARIANTS:
        seeds = sorted(seed for (v, seed) in loss if v == name and seed in base)
        if not seeds:
            continue
        gaps = [loss[name, s] - base[s] for s in seeds]
        per_seed = ", ".join(f"s{s}: {g:+.4f}" for s, g in zip(seeds, gaps))
        losses = ", ".join(f"{loss[name, s]:.4f}" for s in seeds)
        lines.append(f"| {name} | {len(seeds)} | {statistics.mean(gaps):+.4f} | {per_seed} | {losses} |")
    table = "\n".join(lines) + "\n"
    # The runs that also evaluated their weights with BF16 GEMMs (older runs did not).
    bf16_eval = {(r["variant"], r["seed"]): r["heldout_loss_bf16_eval"] for r in runs if "heldout_loss_bf16_eval" in r}
    if bf16_eval:
        lines = ["", "Held-out loss with every GEMM in BF16 at evaluation (the same trained weights), gap to the "
                 "bf16 run:", "",
                 "| variant | seeds | gap, MXFP4 evaluation (mean) | gap, BF16 evaluation (mean) "
                 "| BF16-evaluation gap per seed |",
                 "|---|---|---|---|---|"]
        for name in VARIANTS:
            seeds = sorted(seed for (v, seed) in bf16_eval if v == name and seed in base)
            if not seeds or name == "bf16":
                continue
            gaps = [bf16_eval[name, s] - base[s] for s in seeds]
            mx = [loss[name, s] - base[s] for s in seeds]
            per_seed = ", ".join(f"s{s}: {g:+.4f}" for s, g in zip(seeds, gaps))
            lines.append(f"| {name} | {len(seeds)} | {statistics.mean(mx):+.4f} | {statistics.mean(gaps):+.4f} "
                         f"| {per_seed} |")
        table += "\n".join(lines) + "\n"
    machines = sorted({environment_line(r["env"]) for r in runs if "env" in r})
    if machines:
        table += "\nRuns made on: " + " / ".join(machines) + "\n"
    (out / "ablation.md").write_text(table)
    return table


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", default="runs/corpus", help="corpus folder made by adahop data (default: %(default)s)")
    p.add_argument("--out", default="runs/ablation",
                   help="folder of the runs (<variant>-s<seed>, resumable) and ablation.md (default: %(default)s)")
    p.add_argument("--preset", default="cpu", choices=list(PRESETS),
                   help="training preset; a GPU one (h200, h200_125m) on a GPU machine (default: %(default)s)")
    p.add_argument("--steps", type=int, default=None, help="training steps (default: the preset's)")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default: the preset's)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS),
                   help="variants to train (default: all)")
    p.add_argument("--seeds", nargs="+", type=int, default=[0],
                   help="seeds (initialisation, data order and SR draws); gaps are paired by seed (default: 0)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads, 0 for torch's default (default: 1, fastest for the small CPU runs)")
    p.add_argument("--compile", choices=("auto", "model", "blocks", "none"), default="auto",
                   help="adahop train --compile: the whole model, each block or nothing; auto: the model on a GPU "
                        "(default: %(default)s)")
    p.add_argument("--report", action="store_true", help="only write the table of the finished runs")
    args = p.parse_args(argv)
    env = environment("ablation.py", argv)
    print_environment(env)
    out = Path(args.out)
    if not args.report:
        import torch

        if args.threads:
            torch.set_num_threads(args.threads)
        for seed in args.seeds:
            for name in args.variants:
                run_one(args, name, seed, env)
    print(report(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
