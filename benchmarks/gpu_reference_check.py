"""Check on a CUDA GPU that the reference numerics are the same bits as on the CPU.

The reference path is pure PyTorch, so it runs on any GPU; its MXFP4 codes, scale bytes, SR
decisions and Hadamard outputs must equal the CPU's bit for bit (IEEE float32 adds, multiplies by
powers of two and comparisons are deterministic; the SR hash is integer arithmetic). GEMM outputs
may differ by fp32 accumulation order only. Then the demo trains every recipe on the GPU.

    python benchmarks/gpu_reference_check.py [--out DIR]

Prints a short table last; writes gpu_reference_check.json under --out (default $OUT or .).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch

import adahop
from adahop.formats.mxfp4 import SCALE_MODES
from adahop.transforms.hadamard import HADAMARD_SIZES, block_hadamard, random_signs


def make_input(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp(torch.randn(shape[0], 1, generator=g) * 2)
    x[torch.rand(shape, generator=g) < 0.002] *= 40  # point outliers
    x[:, :3] *= 25  # channel outliers
    return x.to(dtype)


def check_quantize(results):
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
                    rows.append((mode, rounding, str(dtype).split(".")[-1], dim, same, deq_same))
    results["quantize"] = rows
    return all(r[4] and r[5] for r in rows)


def check_hadamard(results):
    rows = []
    for size in HADAMARD_SIZES:
        x = make_input((512, 2048), torch.float32, seed=size)
        s = random_signs(2048, 99)
        a = block_hadamard(x, size=size, signs=s)
        b = block_hadamard(x.cuda(), size=size, signs=s.cuda()).cpu()
        rows.append((size, torch.equal(a, b)))
    results["hadamard"] = rows
    return all(r[1] for r in rows)


def check_linear(results):
    rows = []
    torch.manual_seed(0)
    x = make_input((1024, 512), torch.float32, seed=7)
    w = torch.randn(768, 512) * 0.05
    g = torch.randn(1024, 768)
    for recipe in adahop.RECIPES:
        outs = {}
        for device in ("cpu", "cuda"):
            cfg = adahop.AdaHOPConfig.from_recipe_name(recipe)
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
        rows.append((recipe, *rel))
    results["linear_cpu_vs_cuda_rel_diff"] = rows
    return all(max(r[1:]) < 1e-4 for r in rows)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--demo-steps", type=int, default=80)
    args = p.parse_args()
    dev = torch.cuda.get_device_name()
    print(f"device {dev}, torch {torch.__version__}, python {platform.python_version()}")
    results = {"device": dev, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
    ok_q = check_quantize(results)
    ok_h = check_hadamard(results)
    ok_l = check_linear(results)

    from adahop import demo

    t0 = time.perf_counter()
    demo_rc = demo.main(["--device", "cuda", "--steps", str(args.demo_steps), "--d-model", "128", "--layers", "4", "--batch", "16", "--seq-len", "256", "--oe-k", "8"])
    results["demo_seconds"] = time.perf_counter() - t0
    with open(os.path.join(args.out, "gpu_reference_check.json"), "w") as f:
        json.dump(results, f, indent=1)

    print("\nquantize CPU == CUDA (codes+scales, dequantized):")
    for r in results["quantize"]:
        print("  ", r)
    print("hadamard CPU == CUDA:", results["hadamard"])
    print("linear CPU vs CUDA relative diff (y, dx, dw):")
    for r in results["linear_cpu_vs_cuda_rel_diff"]:
        print(f"   {r[0]:12s} {r[1]:.2e} {r[2]:.2e} {r[3]:.2e}")
    print(f"\nSUMMARY quantize_bitexact={ok_q} hadamard_bitexact={ok_h} linear_close={ok_l} demo_rc={demo_rc}")


if __name__ == "__main__":
    main()
