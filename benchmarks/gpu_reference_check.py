"""Check on a CUDA GPU that the reference numerics are the same bits as on the CPU, then train
every recipe there.

The reference path is pure PyTorch, so it runs on any GPU; its MXFP4 codes, scale bytes, SR
decisions and Hadamard outputs must equal the CPU's bit for bit (IEEE float32 adds, multiplies by
powers of two and comparisons are deterministic; the SR hash is integer arithmetic). GEMM outputs
may differ by fp32 accumulation order only. Then every recipe trains the tiny model of the
``debug`` preset for --train-steps steps on the GPU (``adahop.train.trainer.train``, the backend
``auto`` picks there), on --corpus or on a small corpus of the Python standard library built in
a temporary folder (no download).

    python benchmarks/gpu_reference_check.py [--train-steps 80] [--corpus DIR] [--out FILE]

Prints a summary line last; rows go to --out (JSONL, default runs/bench/gpu_reference_check.jsonl),
each with the environment. Exit status 1 if a bit-exact check fails or a loss is not finite.
"""

from __future__ import annotations

import math
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import Results, add_out_arg, script_parser, start

import adahop
from adahop.formats.mxfp4 import SCALE_MODES
from adahop.transforms.hadamard import HADAMARD_SIZES, block_hadamard, random_signs


def make_input(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp(torch.randn(shape[0], 1, generator=g) * 2)
    x[torch.rand(shape, generator=g) < 0.002] *= 40  # point outliers
    x[:, :3] *= 25  # channel outliers
    return x.to(dtype)


def check_quantize() -> list[dict]:
    rows = []
    for mode in SCALE_MODES:
        for rounding in ("rne", "sr"):
            for dtype in (torch.float32, torch.bfloat16):
                for dim in (0, 1):
                    x = make_input((2048, 1536), dtype, seed=len(rows))
                    kw = dict(dim=dim, scale_mode=mode, rounding=rounding, seed=1234 if rounding == "sr" else None)
                    q_cpu = adahop.quantize_mxfp4(x, **kw)
                    q_gpu = adahop.quantize_mxfp4(x.cuda(), **kw)
                    same = torch.equal(q_cpu.codes, q_gpu.codes.cpu()) and torch.equal(
                        q_cpu.scale_e8m0, q_gpu.scale_e8m0.cpu()
                    )
                    deq_same = torch.equal(
                        adahop.dequantize_mxfp4(q_cpu), adahop.dequantize_mxfp4(q_gpu).cpu()
                    )
                    rows.append(dict(scale_mode=mode, rounding=rounding, dtype=str(dtype).split(".")[-1], dim=dim,
                                     codes_and_scales_equal=same, dequantized_equal=deq_same))
    return rows


def check_hadamard() -> list[dict]:
    rows = []
    for size in HADAMARD_SIZES:
        x = make_input((512, 2048), torch.float32, seed=size)
        s = random_signs(2048, 99)
        a = block_hadamard(x, size=size, signs=s)
        b = block_hadamard(x.cuda(), size=size, signs=s.cuda()).cpu()
        rows.append(dict(size=size, equal=torch.equal(a, b)))
    return rows


def check_linear() -> list[dict]:
    rows = []
    torch.manual_seed(0)
    x = make_input((1024, 512), torch.float32, seed=7)
    w = torch.randn(768, 512) * 0.05
    g = torch.randn(1024, 768)
    for recipe in adahop.RECIPES:
        outs = {}
        for device in ("cpu", "cuda"):
            # the reference backend on both devices ("auto" would pick a kernel backend on the GPU)
            cfg = adahop.AdaHOPConfig.from_recipe_name(recipe, backend="reference")
            lin = torch.nn.Linear(512, 768, bias=False)
            lin.weight.data.copy_(w)
            layer = adahop.AdaHOPLinear.from_float(lin, config=cfg, name="probe").to(device)
            if layer.calibrating:
                layer.set_modes({"fprop": "iht+oe_left", "dgrad": "iht+oe_right", "wgrad": "iht+oe_right"})
            xx = x.detach().to(device).clone().requires_grad_()
            y = layer(xx)
            y.backward(g.to(device))
            outs[device] = [t.detach().cpu().double() for t in (y, xx.grad, layer.weight.grad)]
        rel = [((a - b).norm() / a.norm()).item() for a, b in zip(outs["cpu"], outs["cuda"])]
        rows.append(dict(recipe=recipe, rel_y=rel[0], rel_dx=rel[1], rel_dw=rel[2]))
    return rows


def train_every_recipe(corpus_dir, *, device: str, steps: int, out_dir, batch_size=16, seq_len=256) -> list[dict]:
    """Every recipe on the tiny model of the ``debug`` preset (``batch_size`` x ``seq_len``
    tokens per step, OE k = 8), ``steps`` steps on ``device``: first and last training loss,
    tokens/s."""
    from adahop.data.corpus import load_corpus
    from adahop.train.recipes import preset
    from adahop.train.run import open_run
    from adahop.train.trainer import train

    corpus = load_corpus(corpus_dir)
    rows = []
    for recipe in adahop.RECIPES:
        cfg = preset("debug", recipe=recipe, device=device, steps=steps, batch_size=batch_size, seq_len=seq_len, oe_k=8,
                     calibration_steps=max(1, min(10, steps // 2)), corpus_dir=str(corpus_dir),
                     out_dir=str(Path(out_dir) / recipe), progress=False, ckpt_every=0)
        model, batches = open_run(cfg, corpus)
        t0 = time.perf_counter()
        summary = train(cfg, model=model, train_batches=batches, resume=False)
        losses = summary["losses"]
        rows.append(dict(recipe=recipe, steps=len(losses), first_loss=losses[0], last_loss=losses[-1],
                         finite=all(math.isfinite(v) for v in losses), tokens_per_s=summary["tokens_per_s"],
                         seconds=time.perf_counter() - t0))
        print(f"  train {recipe:12s} loss {losses[0]:.4f} -> {losses[-1]:.4f} in {len(losses)} steps", flush=True)
    return rows


def tiny_corpus(out_dir) -> Path:
    """A byte-level corpus of three standard-library modules (no download)."""
    from adahop.data import corpus, sources

    src = sources.cpython_stdlib_source(modules=("json", "textwrap", "string"), name="stdlib-mini")
    corpus.build_corpus(out_dir, sources=[src], tokenizer="byte", progress=False)
    return Path(out_dir)


def main(argv=None) -> int:
    p = script_parser(__doc__)
    p.add_argument("--train-steps", type=int, default=80,
                   help="training steps per recipe on the GPU, 0 to skip training (default: %(default)s)")
    p.add_argument("--corpus", default=None,
                   help="corpus folder for the training part (default: a small standard-library corpus, built in a "
                        "temporary folder)")
    add_out_arg(p, "gpu_reference_check")
    args = p.parse_args(argv)
    if args.train_steps < 0:
        p.error(f"--train-steps must be >= 0, got {args.train_steps}")
    env = start("gpu_reference_check.py", argv)
    results = Results(args.out, "gpu_reference_check", env)
    quantize, hadamard, linear = check_quantize(), check_hadamard(), check_linear()
    results.write("quantize", quantize)
    results.write("hadamard", hadamard)
    results.write("linear", linear)
    ok_q = all(r["codes_and_scales_equal"] and r["dequantized_equal"] for r in quantize)
    ok_h = all(r["equal"] for r in hadamard)
    ok_l = all(max(r["rel_y"], r["rel_dx"], r["rel_dw"]) < 1e-4 for r in linear)
    print("linear CPU vs CUDA relative diff (y, dx, dw):")
    for r in linear:
        print(f"   {r['recipe']:12s} {r['rel_y']:.2e} {r['rel_dx']:.2e} {r['rel_dw']:.2e}")
    ok_t = True
    if args.train_steps:
        with tempfile.TemporaryDirectory() as tmp:
            corpus = Path(args.corpus) if args.corpus else tiny_corpus(Path(tmp) / "corpus")
            trained = train_every_recipe(corpus, device="cuda", steps=args.train_steps, out_dir=Path(tmp) / "runs")
        results.write("train", trained)
        ok_t = all(r["finite"] for r in trained)
    print(f"\nSUMMARY quantize_bitexact={ok_q} hadamard_bitexact={ok_h} linear_close={ok_l} "
          f"train_finite={ok_t if args.train_steps else 'skipped'}  (rows: {results.path})")
    return 0 if ok_q and ok_h and ok_l and ok_t else 1


if __name__ == "__main__":
    sys.exit(main())
