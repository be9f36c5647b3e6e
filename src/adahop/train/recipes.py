"""Training presets as small Python functions, each derived from the tiny ``debug`` one (the
torchtitan way: a preset is code, so it can compute, and a diff shows what a preset changes).

"preset" = how big and how long (model size, batch, steps, schedule, and the AdaHOP settings that
scale with the model: calibration length, OE k); the AdaHOP *recipe* (bf16, mxfp4, ...,
adahop_lv2, adahop_lv2_tail) is chosen separately, so that every recipe runs on the same preset and
the comparison is fair. The recipes are the library's (``adahop.recipes``: numerics and a
precision schedule); each preset function takes a recipe's name, ``preset`` adds its schedule.
"""

from __future__ import annotations

import dataclasses

from adahop.config import AdaHOPConfig
from adahop.recipes import DEFAULT_RECIPE, RECIPE_NAMES, Recipe, recipe
from adahop.train.trainer import TrainConfig


def numerics(recipe_name: str, *, calibration_steps: int, oe_k: int) -> AdaHOPConfig:
    """The AdaHOP config of recipe ``recipe_name`` with a preset's calibration length and OE k
    (all GEMMs)."""
    return recipe(recipe_name, calibration_steps=calibration_steps).config.with_gemm_settings(oe_k=oe_k)


def debug(recipe: str) -> TrainConfig:
    """Seconds on a CPU: the tiny model, a few steps. For tests and smoke runs."""
    return TrainConfig(
        adahop=numerics(recipe, calibration_steps=3, oe_k=4),
        model_size="tiny", steps=20, batch_size=4, seq_len=64, lr=3e-3, warmup_steps=5,
        eval_batches=4, ckpt_every=10,
    )


def cpu(recipe: str) -> TrainConfig:
    """A few minutes on 2 CPU cores: the README's main job."""
    return dataclasses.replace(
        debug(recipe), adahop=numerics(recipe, calibration_steps=30, oe_k=4),
        steps=300, batch_size=8, seq_len=128, lr=2e-3, warmup_steps=30,
        eval_every=100, eval_batches=8, ckpt_every=100,
    )


def h200(recipe: str) -> TrainConfig:
    """One H200, under 10 minutes per recipe: the 20M model, 2000 steps of 64 x 512 tokens
    (65M tokens), the paper's optimizer settings but a higher peak lr for the small model."""
    return dataclasses.replace(
        debug(recipe), adahop=numerics(recipe, calibration_steps=30, oe_k=16),
        model_size="20m", steps=2000, batch_size=64, seq_len=512, lr=1e-3,
        warmup_steps=200, eval_every=500, eval_batches=32, ckpt_every=500, device="cuda",
    )


def h200_125m(recipe: str) -> TrainConfig:
    """The 125M model on one H200: 1000 steps of 64 x 512 tokens (32.8M tokens); the other
    settings are ``h200``'s. docs/results.md has its speed per recipe."""
    return dataclasses.replace(h200(recipe), model_size="125m", steps=1000)


def h200_smollm2(recipe: str) -> TrainConfig:
    """Continued pretraining of SmolLM2-135M on one H200: 500 steps of 16 x 1024 tokens (8.2M
    tokens) from the pretrained weights, a fine-tuning learning rate (1e-4, 30 warm-up steps,
    cosine to 0.1x), 20 calibration steps, one evaluation at the end. Needs a corpus built with
    ``--tokenizer smollm2`` (docs/training.md, 'Continued pretraining from a pretrained model')."""
    return dataclasses.replace(
        h200_125m(recipe), adahop=numerics(recipe, calibration_steps=20, oe_k=16), init="smollm2",
        steps=500, batch_size=16, seq_len=1024, lr=1e-4, warmup_steps=30, min_lr_ratio=0.1, weight_decay=0.1,
        eval_every=0, ckpt_every=250,
    )


def cpu_smollm2(recipe: str) -> TrainConfig:
    """SmolLM2-135M on a CPU, as a smoke run of continued pretraining: 6 steps of 2 x 64 tokens
    (about 2.5 s a BF16 step on one core; MXFP4 steps on the reference backend are several times
    slower), 3 calibration steps."""
    return dataclasses.replace(
        debug(recipe), adahop=numerics(recipe, calibration_steps=3, oe_k=4), init="smollm2",
        steps=6, batch_size=2, seq_len=64, lr=1e-4, warmup_steps=2, eval_batches=2, ckpt_every=0,
    )


PRESETS = {"debug": debug, "cpu": cpu, "h200": h200, "h200_125m": h200_125m, "h200_smollm2": h200_smollm2,
           "cpu_smollm2": cpu_smollm2}

# Overrides of the AdaHOP side that ``preset`` accepts beside TrainConfig's own fields.
ADAHOP_OVERRIDES = ("recipe", "calibration_steps", "calibration_gemms", "dgrad_weight", "value_fprop", "oe_k",
                    "backend", "wgrad_input")


def preset(name: str, *, adahop: AdaHOPConfig | None = None, **overrides) -> TrainConfig:
    """Preset ``name`` with ``overrides`` (None values are ignored, so a CLI's unset options pass
    through). ``recipe`` picks the recipe (default ``DEFAULT_RECIPE``): its numerics and its
    precision schedule (``adahop.recipes``); ``calibration_steps``, ``calibration_gemms``,
    ``dgrad_weight``, ``value_fprop``, ``wgrad_input``, ``oe_k`` (all GEMMs) and ``backend`` change the
    AdaHOP side;
    ``adahop`` replaces the AdaHOP config as a whole (an experiment's own variant), before those,
    and brings no BF16 phase but one given as an override; ``seed`` sets both the training seed and
    the SR seed; every other name is a TrainConfig field (a schedule field given wins over the
    recipe's)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {tuple(PRESETS)}")
    overrides = {k: v for k, v in overrides.items() if v is not None}
    train_fields = {f.name for f in dataclasses.fields(TrainConfig)} - {"adahop"}
    unknown = set(overrides) - train_fields - set(ADAHOP_OVERRIDES)
    if unknown:
        known = sorted(train_fields | set(ADAHOP_OVERRIDES))
        raise ValueError(f"unknown preset overrides {sorted(unknown)}; known: {known}")
    if adahop is not None and "recipe" in overrides:
        raise ValueError("give a recipe name or an adahop config, not both")
    recipe_name = overrides.pop("recipe", DEFAULT_RECIPE)
    if recipe_name not in RECIPE_NAMES:
        raise ValueError(f"unknown recipe {recipe_name!r}; known recipes: {RECIPE_NAMES}")
    cfg = PRESETS[name](recipe_name)
    schedule = recipe(recipe_name).schedule
    if adahop is None:  # an experiment's own config runs no schedule it did not name (an override)
        cfg = cfg.with_schedule(schedule)
    q = adahop or cfg.adahop
    if "calibration_steps" in overrides:
        q = q.replace(calibration_steps=overrides.pop("calibration_steps"))
    if "backend" in overrides:
        q = q.replace(backend=overrides.pop("backend"))
    for name in ("calibration_gemms", "dgrad_weight", "value_fprop", "wgrad_input"):
        if name in overrides:
            q = q.replace(**{name: overrides.pop(name)})
    if "oe_k" in overrides:
        q = q.with_gemm_settings(oe_k=overrides.pop("oe_k"))
    if "seed" in overrides:
        q = q.replace(seed=overrides["seed"])
    cfg = dataclasses.replace(cfg, adahop=q, **overrides)
    if adahop is None and schedule.has_phase and "bf16_phase_start" not in overrides:
        # a run too short for the recipe's phase to begin after the calibration is refused with the
        # fewest steps that fit, in the recipe's terms (the user did not ask for a phase)
        Recipe(recipe_name, cfg.adahop, cfg.schedule).check_run(cfg.steps, cfg.grad_accum)
    return cfg
