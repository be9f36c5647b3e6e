"""Training presets as small Python functions, each derived from the tiny ``debug`` one (the
torchtitan way: a preset is code, so it can compute, and a diff shows what a preset changes).

"preset" = how big and how long (model size, batch, steps, schedule, and the AdaHOP settings that
scale with the model: calibration length, OE k); the AdaHOP *recipe* (bf16, mxfp4, ...,
adahop_lv2) is chosen separately, so that every recipe runs on the same preset and the comparison
is fair. Each preset function takes a numerics recipe's name (``AdaHOPConfig.from_recipe_name``);
``preset`` also takes the names of ``SCHEDULED_RECIPES``.
"""

from __future__ import annotations

import dataclasses

from adahop.config import RECIPES, AdaHOPConfig
from adahop.train.precision import fewest_steps_for_phase, validate_schedule
from adahop.train.trainer import TrainConfig

# adahop train's recipe when none is named: adahop_lv2 with the forward in BF16 for the last 18% of
# the steps, the smallest gap to bf16 measured (docs/method.md, 'Recipes'). The layers' config,
# AdaHOPConfig(), stays adahop_lv2: a schedule belongs to a training run, not to a layer.
DEFAULT_RECIPE = "adahop_lv2_tail"

# Named recipes that add a precision schedule (TrainConfig fields) to a numerics recipe. A schedule
# is training-side, so these names are ``preset``'s and ``adahop train``'s, not
# ``AdaHOPConfig.from_recipe_name``'s; a schedule field given as an override wins.
SCHEDULED_RECIPES: dict[str, tuple[str, dict]] = {
    # adahop_lv2 with the forward GEMM in BF16 for the last 18% of the steps: the smallest gap to
    # bf16 measured, at 125M and on SmolLM2 (docs/method.md, 'Recipes')
    "adahop_lv2_tail": ("adahop_lv2", {"bf16_phase_start": 0.82, "bf16_phase_gemms": ("fprop",)}),
}
TRAIN_RECIPES = (*RECIPES, *SCHEDULED_RECIPES)


def recipe_label(cfg: TrainConfig) -> str:
    """A run's recipe as ``adahop train`` names it: the name of ``SCHEDULED_RECIPES`` whose
    numerics recipe and BF16 phase the run has, else its numerics recipe, with the BF16 phase it
    ran where it has one of its own."""
    for name, (numerics_recipe, schedule) in SCHEDULED_RECIPES.items():
        if cfg.recipe == numerics_recipe and all(getattr(cfg, k) == v for k, v in schedule.items()):
            return name
    if cfg.bf16_phase_start is None or cfg.recipe == "bf16":
        return cfg.recipe
    return f"{cfg.recipe}, {'/'.join(cfg.bf16_phase_gemms)} BF16 from {cfg.bf16_phase_start:.0%}"


def numerics(recipe: str, *, calibration_steps: int, oe_k: int) -> AdaHOPConfig:
    """The AdaHOP config of ``recipe`` with a preset's calibration length and OE k (all GEMMs)."""
    return AdaHOPConfig.from_recipe_name(recipe, calibration_steps=calibration_steps).with_gemm_settings(oe_k=oe_k)


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
                    "backend")


def preset(name: str, *, adahop: AdaHOPConfig | None = None, **overrides) -> TrainConfig:
    """Preset ``name`` with ``overrides`` (None values are ignored, so a CLI's unset options pass
    through). ``recipe`` picks the recipe (default ``DEFAULT_RECIPE``); ``calibration_steps``,
    ``calibration_gemms``, ``dgrad_weight``, ``value_fprop``, ``oe_k`` (all GEMMs) and ``backend``
    change the AdaHOP side; ``adahop`` replaces the AdaHOP config as a whole (an experiment's own
    variant), before those, and brings no BF16 phase but one given as an override; ``seed`` sets
    both the training seed and the SR seed; every other name is a TrainConfig field. ``recipe`` is
    one of ``TRAIN_RECIPES``: a numerics recipe, or a name of ``SCHEDULED_RECIPES`` (a numerics
    recipe and a BF16 phase)."""
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
    recipe = overrides.pop("recipe", DEFAULT_RECIPE)
    if recipe not in TRAIN_RECIPES:
        raise ValueError(f"unknown recipe {recipe!r}; known recipes: {TRAIN_RECIPES}")
    numerics_recipe, schedule = SCHEDULED_RECIPES.get(recipe, (recipe, {}))
    if adahop is not None:
        schedule = {}  # an experiment's own config runs no schedule it did not name (an override)
    cfg = dataclasses.replace(PRESETS[name](numerics_recipe), **schedule)
    q = adahop or cfg.adahop
    if "calibration_steps" in overrides:
        q = q.replace(calibration_steps=overrides.pop("calibration_steps"))
    if "backend" in overrides:
        q = q.replace(backend=overrides.pop("backend"))
    for name in ("calibration_gemms", "dgrad_weight", "value_fprop"):
        if name in overrides:
            q = q.replace(**{name: overrides.pop(name)})
    if "oe_k" in overrides:
        q = q.with_gemm_settings(oe_k=overrides.pop("oe_k"))
    if "seed" in overrides:
        q = q.replace(seed=overrides["seed"])
    cfg = dataclasses.replace(cfg, adahop=q, **overrides)
    if schedule and "bf16_phase_start" not in overrides:
        _check_scheduled_recipe(recipe, cfg)
    return cfg


def _check_scheduled_recipe(recipe: str, cfg: TrainConfig) -> None:
    """A run too short for its recipe's BF16 phase to begin after the calibration is refused
    with the fewest steps that fit, in the recipe's terms (the user did not ask for a phase)."""
    try:
        validate_schedule(cfg.steps, cfg.grad_accum, cfg.bf16_phase_start, cfg.adahop.calibration_steps)
    except ValueError:
        fewest = fewest_steps_for_phase(cfg.bf16_phase_start, cfg.adahop.calibration_steps, cfg.grad_accum)
        raise ValueError(f"recipe {recipe} runs {'/'.join(cfg.bf16_phase_gemms)} in BF16 from "
                         f"{cfg.bf16_phase_start:.0%} of the steps on, which must come after the calibration's "
                         f"{cfg.adahop.calibration_steps} steps: give at least {fewest} steps, or recipe "
                         f"{SCHEDULED_RECIPES[recipe][0]}") from None
