"""Training presets as small Python functions, each derived from the tiny ``debug`` one (the
torchtitan way: a preset is code, so it can compute, and a diff shows what a preset changes).

"preset" = how big and how long (model size, batch, steps, schedule); the AdaHOP *recipe*
(bf16, mxfp4, ..., adahop_lv2) is chosen separately, so that every recipe runs on the same
preset and the comparison is fair.
"""

from __future__ import annotations

import dataclasses

from adahop.train.trainer import TrainConfig


def debug() -> TrainConfig:
    """Seconds on a CPU: the tiny model, a few steps. For tests and smoke runs."""
    return TrainConfig(
        model_size="tiny", steps=20, batch_size=4, seq_len=64, lr=3e-3, warmup_steps=5,
        calibration_steps=3, oe_k=4, eval_batches=4, ckpt_every=10,
    )


def cpu() -> TrainConfig:
    """A few minutes on 2 CPU cores: the README's main job."""
    return dataclasses.replace(
        debug(), steps=300, batch_size=8, seq_len=128, lr=2e-3, warmup_steps=30,
        calibration_steps=30, eval_every=100, eval_batches=8, ckpt_every=100,
    )


def h200() -> TrainConfig:
    """One H200, under 10 minutes per recipe: the 20M model, 2000 steps of 64 x 512 tokens
    (65M tokens), the paper's optimizer settings but a higher peak lr for the small model."""
    return dataclasses.replace(
        debug(), model_size="20m", steps=2000, batch_size=64, seq_len=512, lr=1e-3,
        warmup_steps=200, calibration_steps=30, oe_k=16, eval_every=500, eval_batches=32,
        ckpt_every=500, device="cuda",
    )


def h200_125m() -> TrainConfig:
    """The 125M model on one H200: 1000 steps of 64 x 512 tokens (32.8M tokens). One run alone
    takes about 2 minutes in bf16 and 4-5 in the MXFP4 recipes (measured: 294k and 133-152k
    tokens/s); the other settings are ``h200``'s."""
    return dataclasses.replace(h200(), model_size="125m", steps=1000)


PRESETS = {"debug": debug, "cpu": cpu, "h200": h200, "h200_125m": h200_125m}


def preset(name: str, **overrides) -> TrainConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {tuple(PRESETS)}")
    unknown = set(overrides) - {f.name for f in dataclasses.fields(TrainConfig)}
    if unknown:
        raise ValueError(f"unknown TrainConfig fields {sorted(unknown)}")
    return dataclasses.replace(PRESETS[name](), **{k: v for k, v in overrides.items() if v is not None})
