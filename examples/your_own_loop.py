"""adahop inside your own training loop: convert a model, train it, read the modes calibration chose.

    python examples/your_own_loop.py                 # about 20 s on a CPU
    python examples/your_own_loop.py --steps 200 --device cuda
    python examples/your_own_loop.py --fprop-bf16-from 1   # adahop_lv2 throughout, no BF16 phase

The model is the library's Llama at its ``tiny`` size, but any ``nn.Module`` with ``nn.Linear``
layers converts the same way. The text is the source of a few CPython standard-library modules,
byte-level, so the example needs no download. ``adahop train`` is the full trainer (schedule,
checkpoints, evaluation); this file shows the few lines a loop of your own needs, including the
BF16 phase of ``adahop train``'s default recipe, ``adahop_lv2_tail``: the forward GEMM switched
to BF16 for the last 18% of the steps (docs/method.md, 'Recipes').
"""

from __future__ import annotations

import argparse
import importlib
import inspect

import torch

import adahop
from adahop.llama.model import Llama, LlamaConfig
from adahop.train.precision import apply_bf16_phase, phase_switch_step


def byte_tokens() -> torch.Tensor:
    text = "\n".join(inspect.getsource(importlib.import_module(m)) for m in ("argparse", "textwrap", "json.decoder"))
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default="adahop_lv2", choices=list(adahop.RECIPES), help="AdaHOP recipe")
    p.add_argument("--steps", type=int, default=40, help="optimizer steps (the first --calibration-steps in BF16)")
    p.add_argument("--calibration-steps", type=int, default=10, help="BF16 steps that measure the outlier patterns")
    p.add_argument("--fprop-bf16-from", type=float, default=0.82, metavar="F",
                   help="switch every forward GEMM to BF16 once this fraction of the steps is done (1: never)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="torch device")
    args = p.parse_args(argv)
    if args.steps < 1 or args.calibration_steps < 1:
        p.error("--steps and --calibration-steps must be >= 1")
    if not 0 < args.fprop_bf16_from <= 1:
        p.error(f"--fprop-bf16-from must be in (0, 1], got {args.fprop_bf16_from}")
    switch = phase_switch_step(args.steps, args.fprop_bf16_from) if args.fprop_bf16_from < 1 else None
    if switch is not None and switch < args.calibration_steps:  # the modes must be chosen before
        p.error(f"--fprop-bf16-from {args.fprop_bf16_from} switches after {switch} steps, before the "
                f"{args.calibration_steps} calibration steps end: give more --steps or --fprop-bf16-from 1")

    torch.manual_seed(0)
    tokens, seq_len, batch = byte_tokens(), 64, 8
    model = Llama(LlamaConfig.from_size("tiny", vocab_size=256, max_seq_len=seq_len))
    config = adahop.AdaHOPConfig.from_recipe_name(args.recipe, calibration_steps=args.calibration_steps)
    adahop.convert_to_adahop_training(model, config=config.with_gemm_settings(oe_k=4))  # the LM head stays BF16
    model.to(args.device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(args.steps):
        if step == switch:  # the rest of the run with the forward in BF16; dgrad and wgrad keep their modes
            print(f"step {step:4d}  forward GEMMs to BF16 in {len(apply_bf16_phase(model, ('fprop',)))} layers")
        start = torch.randint(0, tokens.numel() - seq_len - 1, (batch,))
        chunk = tokens[start[:, None] + torch.arange(seq_len + 1)].to(args.device)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.device.startswith("cuda")):
            logits = model(chunk[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), chunk[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()  # during calibration the layers observe x, w and g here
        opt.step()
        if step % 10 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {loss.item():.4f}  calibrated {adahop.is_calibrated(model)}")
    for name, layer in adahop.adahop_layers(model).items():
        print(f"{name:24s} {layer.extra_repr()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
