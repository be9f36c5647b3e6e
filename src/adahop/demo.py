"""The README's main job until ``adahop train`` lands: convert a small transformer, calibrate it and
train it a few steps under every recipe, then print each layer's modes and the loss curves.

    python -m adahop.demo                      # all recipes, CPU-sized defaults (about a minute)
    python -m adahop.demo --recipes bf16 adahop_lv2 --steps 100 --device cuda

Data: a character-level language model over the source of a few CPython standard-library modules
(real text that every Python installation carries, so the demo needs no download). Every recipe
starts from the same initial weights and sees the same batches.
"""

from __future__ import annotations

import argparse
import inspect
import math
import sys
import time

import torch
from torch import nn

import adahop
from adahop.config import RECIPES, AdaHOPConfig

CORPUS_MODULES = ("argparse", "textwrap", "inspect", "dataclasses", "json.decoder", "unittest.case")


# ---- data ----------------------------------------------------------------------------------------
def load_corpus() -> str:
    import importlib

    return "\n".join(inspect.getsource(importlib.import_module(m)) for m in CORPUS_MODULES)


def encode_bytes(text: str) -> torch.Tensor:
    """Byte-level tokens (vocab 256)."""
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def batches(tokens: torch.Tensor, *, batch: int, seq_len: int, steps: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        start = torch.randint(0, tokens.numel() - seq_len - 1, (batch,), generator=g)
        idx = start[:, None] + torch.arange(seq_len + 1)
        chunk = tokens[idx]
        yield chunk[:, :-1], chunk[:, 1:]


# ---- a tiny pre-norm transformer (causal self-attention + GELU MLP) ------------------------------
class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.norm2 = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d, bias=False)
        self.down = nn.Linear(4 * d, d, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, d = h.shape
        q, k, v = self.qkv(self.norm1(h)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        a = nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        h = h + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return h + self.down(nn.functional.gelu(self.up(self.norm2(h))))


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 256, d: int = 64, layers: int = 2, heads: int = 4, seq_len: int = 128):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq_len, d) * 0.02)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            h = block(h)
        return self.lm_head(self.norm(h))


def lm_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(inputs)
    return nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


# ---- one run -------------------------------------------------------------------------------------
def train_recipe(recipe: str, tokens: torch.Tensor, args) -> tuple[list[float], nn.Module]:
    torch.manual_seed(args.seed)
    model = TinyLM(d=args.d_model, layers=args.layers, heads=args.heads, seq_len=args.seq_len)
    config = AdaHOPConfig.from_recipe_name(recipe, calibration_steps=args.calibration_steps)
    config = config.with_gemm_settings(oe_k=args.oe_k)
    adahop.convert_to_adahop_training(model, config=config)
    model.to(args.device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, eps=1e-8)
    use_bf16 = args.device.startswith("cuda")
    losses = []
    for inputs, targets in batches(tokens, batch=args.batch, seq_len=args.seq_len, steps=args.steps, seed=args.seed):
        inputs, targets = inputs.to(args.device), targets.to(args.device)
        with torch.autocast(args.device.split(":")[0], dtype=torch.bfloat16, enabled=use_bf16):
            loss = lm_loss(model, inputs, targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if not math.isfinite(losses[-1]):
            break
    return losses, model


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("what to run")
    g.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    g.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    g = p.add_argument_group("training")
    g.add_argument("--steps", type=int, default=60)
    g.add_argument("--calibration-steps", type=int, default=10, help="BF16 steps before AdaHOP's modes freeze")
    g.add_argument("--batch", type=int, default=8)
    g.add_argument("--seq-len", type=int, default=128)
    g.add_argument("--lr", type=float, default=3e-3)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--oe-k", type=int, default=4, help="slices outlier extraction moves to BF16 (the paper's 64 is for d=4096)")
    g = p.add_argument_group("model")
    g.add_argument("--d-model", type=int, default=64)
    g.add_argument("--layers", type=int, default=2)
    g.add_argument("--heads", type=int, default=4)
    args = p.parse_args(argv)
    if args.steps < 1 or args.calibration_steps < 1 or args.oe_k < 1:
        p.error("--steps, --calibration-steps and --oe-k must be >= 1")
    if args.d_model % args.heads:
        p.error("--d-model must be a multiple of --heads")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    tokens = encode_bytes(load_corpus())
    print(f"adahop {adahop.__version__} demo: {len(tokens):,} byte tokens from the CPython stdlib, "
          f"device {args.device}, torch {torch.__version__}")
    results = {}
    for recipe in args.recipes:
        t0 = time.perf_counter()
        losses, model = train_recipe(recipe, tokens, args)
        results[recipe] = losses
        print(f"\n== {recipe}: {len(losses)} steps in {time.perf_counter() - t0:.1f}s")
        for fqn, layer in adahop.adahop_layers(model).items():
            print(f"  {fqn:18s} {layer.extra_repr().split(', recipe=')[1]}")
    print("\nrecipe        first loss   last-10 mean   gap to bf16")
    base = results.get("bf16")
    for recipe, losses in results.items():
        tail = sum(losses[-10:]) / len(losses[-10:])
        gap = "" if base is None else f"{tail - sum(base[-10:]) / len(base[-10:]):+.4f}"
        print(f"{recipe:13s} {losses[0]:10.4f} {tail:14.4f}   {gap}")
    bad = [r for r, losses in results.items() if not all(math.isfinite(v) for v in losses)]
    if bad:
        print(f"non-finite loss under: {bad}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
