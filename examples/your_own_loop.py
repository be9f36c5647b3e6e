"""adahop inside your own training loop: convert a model, train it, read the modes calibration chose.

    python examples/your_own_loop.py                 # about 20 s on a CPU
    python examples/your_own_loop.py --steps 200 --device cuda
    python examples/your_own_loop.py --fprop-bf16-from 1   # no BF16 phase: adahop_lv2 throughout

The model is the library's Llama at its ``tiny`` size, but any ``nn.Module`` with ``nn.Linear``
layers converts the same way. The text is the source of a few CPython standard-library modules,
byte-level, so the example needs no download. ``adahop train`` is the full trainer (schedule,
checkpoints, evaluation); this file shows the few lines a loop of your own needs, including the
precision schedule of ``adahop train``'s default recipe, ``adahop_lv2_tail``: the forward GEMM
switched to BF16 for the last 18% of the steps (docs/method.md, 'Recipes'), one
``schedule.apply`` call before each step.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect

import torch

import adahop
from adahop.recipes import DEFAULT_RECIPE, RECIPE_NAMES
from adahop.train.model import Llama, LlamaConfig


def byte_tokens() -> torch.Tensor:
    text = "\n".join(inspect.getsource(importlib.import_module(m)) for m in ("argparse", "textwrap", "json.decoder"))
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default=DEFAULT_RECIPE, choices=list(RECIPE_NAMES),
                   help="AdaHOP recipe: its numerics and its precision schedule")
    p.add_argument("--steps", type=int, default=40, help="optimizer steps (the first --calibration-steps in BF16)")
    p.add_argument("--calibration-steps", type=int, default=10, help="BF16 steps that measure the outlier patterns")
    p.add_argument("--fprop-bf16-from", type=float, default=None, metavar="F",
                   help="in place of the recipe's schedule: switch every forward GEMM to BF16 once this fraction "
                        "of the steps is done (1: never)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="torch device")
    args = p.parse_args(argv)
    if args.steps < 1 or args.calibration_steps < 1:
        p.error("--steps and --calibration-steps must be >= 1")
    recipe = adahop.recipe(args.recipe, calibration_steps=args.calibration_steps)
    try:
        if args.fprop_bf16_from is not None:  # the recipe's numerics with a phase of your own
            start = None if args.fprop_bf16_from == 1 else args.fprop_bf16_from
            recipe = dataclasses.replace(recipe, schedule=adahop.PrecisionSchedule(bf16_phase_start=start,
                                                                                   bf16_phase_gemms=("fprop",)))
        recipe.check_run(args.steps)  # the phase must begin after the calibration has chosen the modes
    except ValueError as e:
        p.error(str(e))

    torch.manual_seed(0)
    tokens, seq_len, batch = byte_tokens(), 64, 8
    model = Llama(LlamaConfig.from_size("tiny", vocab_size=256, max_seq_len=seq_len))
    adahop.convert_to_adahop_training(model, config=recipe.config.with_gemm_settings(oe_k=4),  # the LM head stays BF16
                                      module_filter_fn=recipe.schedule.module_filter(model))  # (its BF16 blocks)
    model.to(args.device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(args.steps):
        switched = recipe.schedule.apply(model, step, args.steps)  # from the phase's step on; the others keep theirs
        if switched:
            gemms = "/".join(recipe.schedule.bf16_phase_gemms)
            print(f"step {step:4d}  {gemms} GEMMs to BF16 in {len(switched)} layers")
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
