"""What each recipe's quantized GEMMs cost a pretrained model before any training: its held-out
loss with every converted linear running the recipe's forward, against the same model in BF16.

A model trained from scratch under a recipe learns around its quantization; a pretrained model
meets it all at once, with the outliers it already has. This is the first thing continued
pretraining under a recipe pays, and the part of it that training in the recipe has to win
back. For each recipe the model is loaded again (``--init``: ``smollm2``, a ``.gguf`` file or a
Hugging Face Llama folder), converted, and, for an adaptive recipe, calibrated: its
``--calibration-steps`` forward + backward passes on training windows of the corpus (gradients
dropped, no optimizer step), after which the modes freeze as they would in training. Then the
held-out loss over the first ``--eval-batches`` batches of each source's validation shard
(token-weighted, as the trainer reports it; BF16 autocast on a GPU). ``--layers`` converts only
the linears it names (the rest stay BF16), to find which layers' forward the loss pays for;
``--set-fprop PATTERN=MODE`` runs the forward GEMM of the linears it names in another mode after
the calibration, to find what a policy's choice there costs; ``--hadamard-size``,
``--random-signs`` and ``--scale-mode`` change that setting in every GEMM of every recipe;
``--fprop-mean-bias`` takes the activation's mean out of every forward GEMM's MXFP4 operand and adds
it back as a rank-one GEMV (``AdaHOPConfig.fprop_mean_bias``); ``--fprop-unbias`` scales every
forward GEMM's MXFP4 product by the per-row factors that undo round to nearest's shrink toward
zero (``AdaHOPConfig.fprop_unbias``). ``--output-jitter EPS`` multiplies every converted linear's
output by 1 + EPS: at EPS = 1e-6 the numerics are the same and only low bits move, so the change
of the loss is the noise floor of comparing two forwards (rounding decisions flip and compound).

    python benchmarks/pretrained_forward.py --init smollm2 --corpus runs/corpus_smollm2 \\
        --recipes bf16 mxfp4 mxfp4_iht adahop_lv2 adahop_measured --out runs/pretrained_forward.jsonl

The corpus must be built with the model's tokenizer (``adahop data --tokenizer smollm2``).
"""

from __future__ import annotations

import argparse
import copy
import fnmatch
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from common import environment, load_pretrained, pretrained_corpus, print_environment  # noqa: E402

import adahop  # noqa: E402
from adahop.config import RECIPES  # noqa: E402
from adahop.data.corpus import TokenBatches  # noqa: E402
from adahop.formats.mxfp4 import SCALE_MODES  # noqa: E402
from adahop.policy import GEMM_MODES, QUANT_POLICIES  # noqa: E402
from adahop.train.precision import mxfp4_flop_share  # noqa: E402
from adahop.train.recipes import numerics  # noqa: E402
from adahop.train.run import heldout_eval  # noqa: E402
from adahop.transforms.hadamard import HADAMARD_SIZES  # noqa: E402


def layer_filter(model, patterns: list[str]):
    """The default conversion filter (which keeps e.g. an LM head tied to the embedding in BF16),
    narrowed to the linears whose name matches one of ``patterns``: which layers' forward costs
    the loss."""
    default = adahop.convert.default_module_filter(model)
    return lambda mod, fqn: default(mod, fqn) and any(fnmatch.fnmatchcase(fqn, p) for p in patterns)


def calibrate(model, batches, steps: int, device: torch.device) -> None:
    """``steps`` forward + backward passes in training mode (the adaptive layers observe and then
    freeze); the gradients are dropped and no weight moves."""
    model.train()
    for _ in range(steps):
        inputs, targets = (t.to(device) for t in next(batches))
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(inputs)
        torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten()).backward()
        model.zero_grad(set_to_none=True)
    if not adahop.is_calibrated(model):
        raise RuntimeError("the adaptive layers did not freeze after the calibration steps")


def parse_set_fprop(items: list[str]) -> list[tuple[str, str]]:
    """``PATTERN=MODE`` items as (pattern, mode); ValueError naming what is allowed."""
    out = []
    for item in items:
        pattern, sep, mode = item.rpartition("=")
        if not sep or not pattern or mode not in GEMM_MODES:
            raise ValueError(f"--set-fprop takes PATTERN=MODE with MODE one of {', '.join(GEMM_MODES)}, got {item!r}")
        out.append((pattern, mode))
    return out


def set_fprop(model, rules: list[tuple[str, str]]) -> None:
    """Run the forward GEMM of the converted linears whose name matches a rule's pattern in its
    mode (the later rule wins), the other two GEMMs as they were."""
    layers = adahop.adahop_layers(model)
    for pattern, mode in rules:
        matched = [layer for name, layer in layers.items() if fnmatch.fnmatchcase(name, pattern)]
        if not matched:
            raise SystemExit(f"--set-fprop {pattern}={mode} matches none of the converted linears "
                             f"(named like {', '.join(list(layers)[:3])})")
        for layer in matched:
            oe_ks = {g: k for g, k in (layer.oe_ks or {}).items() if g != "fprop"}
            layer.set_modes({**layer.modes, "fprop": mode}, oe_ks=oe_ks or None)


def jitter_outputs(model, eps: float) -> None:
    """Multiply every converted linear's output by ``1 + eps`` (after the calibration): with eps
    near float32's resolution the numerics are the same but low bits of the activations change,
    and with them some rounding decisions downstream. How far that moves the held-out loss is
    the noise floor of a comparison between two forwards."""
    for layer in adahop.adahop_layers(model).values():
        layer.register_forward_hook(lambda mod, args, out: out * (1 + eps))


def converted_hp_share(model, tokens: int) -> float:
    """The share of the converted linears' forward FLOPs in high precision (BF16 GEMMs and OE's
    slices), OE counted over the ``tokens`` rows of one call: a batch's (batch size x sequence
    length), where OE-left chooses its rows; ``fprop_mxfp4_share`` counts them over one sequence.
    What a policy's high-precision budget is measured against."""
    converted = sum(m.in_features * m.out_features for m in adahop.adahop_layers(model).values())
    every = sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, torch.nn.Linear))
    if not converted:
        return 0.0
    return 1 - mxfp4_flop_share(model, tokens, gemms=("fprop",)) * every / converted


def gemm_settings(args) -> dict:
    """The GemmConfig fields the command line sets in every GEMM of the recipes."""
    out = {"hadamard_size": args.hadamard_size, "scale_mode": args.scale_mode}
    out = {k: v for k, v in out.items() if v is not None}
    if args.random_signs:
        out["random_signs"] = True
    return out


def measure(args, recipe: str, pretrained, corpus, device: torch.device) -> dict:
    """Recipe ``recipe`` on a fresh copy of the ``pretrained`` model (the conversion and the
    calibration change the copy only)."""
    start = time.perf_counter()
    model = copy.deepcopy(pretrained).to(device)
    budgeted = False  # a recipe whose policy has a high-precision budget (--hp-budget)
    if recipe != "bf16":
        cfg = numerics(recipe, calibration_steps=args.calibration_steps, oe_k=args.oe_k).replace(
            backend=args.backend, seed=args.seed)
        cfg = cfg.with_gemm_settings(**gemm_settings(args))
        budgeted = args.hp_budget is not None and cfg.adaptive and cfg.policy in QUANT_POLICIES
        if budgeted:
            cfg = cfg.replace(hp_budget=args.hp_budget)
        if args.fprop_mean_bias:
            cfg = cfg.replace(fprop_mean_bias=True)
        if args.fprop_unbias:
            cfg = cfg.replace(fprop_unbias=True)
        adahop.convert_to_adahop_training(model, config=cfg, module_filter_fn=layer_filter(model, args.layers))
        if not adahop.adahop_layers(model):
            names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)][:3]
            raise SystemExit(f"--layers {' '.join(args.layers)} matches none of the model's linears "
                             f"(named like {', '.join(names)})")
        if cfg.adaptive:
            batches = iter(TokenBatches(corpus, "train", batch_size=args.batch_size, seq_len=args.seq_len,
                                        seed=args.seed))
            calibrate(model, batches, args.calibration_steps, device)
        set_fprop(model, args.set_fprop)
        if args.output_jitter:
            jitter_outputs(model, args.output_jitter)
    result = heldout_eval(model, corpus, seq_len=args.seq_len, batch_size=args.batch_size,
                          max_batches=args.eval_batches)
    modes = {name: layer.modes for name, layer in adahop.adahop_layers(model).items()}
    share = mxfp4_flop_share(model, args.seq_len, gemms=("fprop",))  # the share of the forward's FLOPs
    hp = converted_hp_share(model, args.seq_len * args.batch_size) if recipe != "bf16" else 1.0
    label = recipe + "".join(f" ({p} fprop {m})" for p, m in args.set_fprop if recipe != "bf16")
    if gemm_settings(args) and recipe != "bf16":
        label += " (" + ", ".join(f"{k} {v}" for k, v in gemm_settings(args).items()) + ")"
    if budgeted:
        label += f" (hp_budget {args.hp_budget:g})"
    if args.output_jitter and recipe != "bf16":
        label += f" (outputs x (1 {args.output_jitter:+g}))"
    if args.fprop_mean_bias and recipe != "bf16":
        label += " (fprop mean bias)"
    if args.fprop_unbias and recipe != "bf16":
        label += " (fprop unbias)"
    return {"recipe": recipe, "label": label, "heldout_loss": result["loss"], "tokens": result["tokens"],
            "fprop_mxfp4_share": share, "converted_fprop_hp_share": hp,
            "sources": {s: v["loss"] for s, v in result["sources"].items()},
            "seconds": time.perf_counter() - start, "modes": modes}


def table(rows: list[dict]) -> str:
    base = next((r["heldout_loss"] for r in rows if r["recipe"] == "bf16"), math.nan)
    sources = list(rows[0]["sources"])
    head = ("| recipe | forward FLOPs in MXFP4 | converted forward in high precision | held-out loss | gap to bf16 | "
            + " | ".join(sources) + " |")
    lines = [head, "|" + "---|" * (5 + len(sources))]
    for r in rows:
        per = " | ".join(f"{r['sources'][s]:.4f}" for s in sources)
        lines.append(f"| {r['label']} | {r['fprop_mxfp4_share']:.1%} | {r['converted_fprop_hp_share']:.1%} | "
                     f"{r['heldout_loss']:.4f} | "
                     f"{r['heldout_loss'] - base:+.4f} | {per} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--init", default="smollm2", help="smollm2, a .gguf file or a Hugging Face Llama folder")
    p.add_argument("--corpus", required=True, help="a corpus built with the model's tokenizer")
    p.add_argument("--recipes", nargs="+", default=["bf16", "mxfp4", "mxfp4_iht", "adahop_lv2", "adahop_measured"],
                   help=f"recipes to compare (bf16 first as the baseline); known: {', '.join(RECIPES)}")
    p.add_argument("--layers", nargs="+", default=["*"],
                   help="convert only the linears whose name matches one of these patterns (fnmatch, e.g. "
                        "'*.feed_forward.w2'); the others stay BF16 (default: every linear the recipe converts)")
    p.add_argument("--set-fprop", nargs="+", default=[], metavar="PATTERN=MODE",
                   help="after the calibration, run the forward GEMM of the converted linears whose name matches "
                        f"PATTERN (fnmatch) in MODE, one of {', '.join(GEMM_MODES)} (e.g. '*.wv=mxfp4')")
    p.add_argument("--hadamard-size", type=int, default=None, choices=HADAMARD_SIZES,
                   help="the Hadamard size of every GEMM of the recipes (default: each recipe's, 32)")
    p.add_argument("--random-signs", action="store_true",
                   help="random signs before every GEMM's Hadamard (default: each recipe's, none but tseng's)")
    p.add_argument("--scale-mode", default=None, choices=SCALE_MODES,
                   help="the MXFP4 scale mode of every GEMM (default: each recipe's, even but tseng's)")
    p.add_argument("--fprop-mean-bias", action="store_true",
                   help="take the activation's mean over tokens out of every forward GEMM's MXFP4 operand, added "
                        "back as a rank-one GEMV (AdaHOPConfig.fprop_mean_bias)")
    p.add_argument("--fprop-unbias", action="store_true",
                   help="scale every forward GEMM's MXFP4 product by the per-row factors of x and W that undo round "
                        "to nearest's shrink toward zero (AdaHOPConfig.fprop_unbias)")
    p.add_argument("--output-jitter", type=float, default=0.0, metavar="EPS",
                   help="multiply every converted linear's output by 1 + EPS (e.g. 1e-6): the loss's noise floor under "
                        "bit-level changes (default: none)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per window (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=4, help="windows per batch (default: %(default)s)")
    p.add_argument("--eval-batches", type=int, default=2, help="batches of each source's validation shard")
    p.add_argument("--calibration-steps", type=int, default=3, help="adaptive recipes: forward + backward passes")
    p.add_argument("--oe-k", type=int, default=16, help="OE k of every GEMM (default: %(default)s)")
    p.add_argument("--hp-budget", type=float, default=None,
                   help="the high-precision budget of the measured and loss-aware policies, a share of the GEMM "
                        "FLOPs (default: each recipe's)")
    p.add_argument("--unit-exposure", action="store_true",
                   help="the loss-aware policy's ablation: every layer's loss exposure 1 (the same whole-model "
                        "knapsack over the predicted NSRs, without the loss weighting)")
    p.add_argument("--seed", type=int, default=0, help="calibration windows and SR draws")
    p.add_argument("--backend", default="auto", help="GEMM backend (default: %(default)s)")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    p.add_argument("--out", default=None, help="JSON lines file: one row per recipe, with the environment")
    args = p.parse_args(argv)
    unknown = [r for r in args.recipes if r not in RECIPES]
    if unknown:
        p.error(f"unknown recipes {unknown}; known: {', '.join(RECIPES)}")
    for name in ("seq_len", "batch_size", "eval_batches", "calibration_steps", "oe_k"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.hp_budget is not None and not 0 <= args.hp_budget <= 1:
        p.error("--hp-budget must be in [0, 1] (a share of the GEMM FLOPs)")
    if args.unit_exposure:
        import adahop.loss_aware_policy

        adahop.loss_aware_policy.loss_exposure = lambda summary: 1.0  # this process only: an ablation
    try:
        args.set_fprop = parse_set_fprop(args.set_fprop)
    except ValueError as e:
        p.error(str(e))
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    corpus = pretrained_corpus(p, args.init, args.corpus)
    pretrained = load_pretrained(p, args.init, corpus, args.seq_len)
    env = environment("pretrained_forward.py", sys.argv[1:] if argv is None else argv)
    print_environment(env)
    out = Path(args.out) if args.out else None
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for recipe in args.recipes:
        row = measure(args, recipe, pretrained, corpus, device)
        rows.append(row)
        print(f"[{row['label']}] held-out {row['heldout_loss']:.4f} ({row['seconds']:.0f} s)", flush=True)
        if out:
            with out.open("a") as f:
                f.write(json.dumps({"benchmark": "pretrained_forward", **row, "settings": {
                    k: v for k, v in vars(args).items() if k not in ("out", "threads")}, "env": env}) + "\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
