"""Recipes: a recipe is numerics (an ``AdaHOPConfig``) and a precision schedule (``schedule``).

``adahop.recipe(name)`` gives every recipe ``adahop train --recipe`` accepts, as a frozen
``Recipe(name, config, schedule)``:

- the numerics recipes of ``config.RECIPES`` (bf16, mxfp4, mxfp4_iht, tseng, adahop_lv2,
  adahop_lv1, adahop_measured, adahop_loss_aware), each with no schedule;
- the scheduled recipes of ``SCHEDULED_RECIPES``: a numerics recipe and a BF16 phase. The default,
  ``adahop_lv2_tail``, is adahop_lv2 with the forward GEMM in BF16 for the last 18% of the steps,
  the smallest gap to bf16 measured, at 125M and on SmolLM2 (docs/method.md, 'Recipes').

In a loop of your own::

    r = adahop.recipe("adahop_lv2_tail")
    adahop.convert_to_adahop_training(model, config=r.config,
                                      module_filter_fn=r.schedule.module_filter(model))  # its BF16 blocks, if any
    for step in range(total_steps):
        r.schedule.apply(model, step, total_steps)   # the BF16 phase, from its step on
        ...                                          # forward, backward, optimizer step

``AdaHOPConfig.from_recipe_name`` gives a numerics recipe's config; for a scheduled recipe it
raises, naming ``adahop.recipe``, so that no schedule is dropped without a word.
"""

from __future__ import annotations

from dataclasses import dataclass

from adahop.config import RECIPES, SCHEDULED_RECIPE_REFUSALS, AdaHOPConfig
from adahop.schedule import NO_SCHEDULE, PrecisionSchedule

# The recipes that add a precision schedule to a numerics recipe: name -> (numerics recipe, schedule).
SCHEDULED_RECIPES: dict[str, tuple[str, PrecisionSchedule]] = {
    # adahop_lv2 with the forward GEMM in BF16 for the last 18% of the steps: the smallest gap to
    # bf16 measured, at 125M and on SmolLM2 (docs/method.md, 'Recipes')
    "adahop_lv2_tail": ("adahop_lv2", PrecisionSchedule(bf16_phase_start=0.82, bf16_phase_gemms=("fprop",))),
}
for _name, (_numerics, _schedule) in SCHEDULED_RECIPES.items():  # what from_recipe_name says of each
    SCHEDULED_RECIPE_REFUSALS[_name] = (
        f"recipe {_name!r} is {_numerics} with a precision schedule ({_schedule.describe()}), which an AdaHOPConfig "
        f"does not hold: use adahop.recipe({_name!r}) for both (its .config and .schedule), or "
        f"from_recipe_name({_numerics!r}) for the numerics alone")
# Every recipe's name: the numerics recipes, then the scheduled ones.
RECIPE_NAMES: tuple[str, ...] = (*RECIPES, *SCHEDULED_RECIPES)
# adahop train's recipe when none is named.
DEFAULT_RECIPE = "adahop_lv2_tail"


@dataclass(frozen=True)
class Recipe:
    """A named recipe: the layers' numerics (``config``, what ``convert_to_adahop_training``
    takes) and where and when the run leaves MXFP4 (``schedule``)."""

    name: str
    config: AdaHOPConfig
    schedule: PrecisionSchedule = NO_SCHEDULE

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"a recipe's name must be a non-empty str, got {self.name!r}")
        if not isinstance(self.config, AdaHOPConfig):
            raise ValueError(f"a recipe's config must be an AdaHOPConfig, got {self.config!r}")
        if not isinstance(self.schedule, PrecisionSchedule):
            raise ValueError(f"a recipe's schedule must be a PrecisionSchedule, got {self.schedule!r}")

    def check_run(self, total_steps: int, grad_accum: int = 1) -> None:
        """A ValueError, in the recipe's terms, unless the BF16 phase of a run of ``total_steps``
        begins after the calibration: the fewest steps that fit, or the recipe's numerics alone."""
        calibration = self.config.calibration_steps if self.config.adaptive else None
        try:
            self.schedule.check_run(total_steps, calibration, grad_accum)
        except ValueError:
            s = self.schedule
            raise ValueError(f"recipe {self.name} runs {'/'.join(s.bf16_phase_gemms)} in BF16 from "
                             f"{s.bf16_phase_start:.0%} of the steps on, which must come after the calibration's "
                             f"{calibration} steps: give at least {s.fewest_steps(calibration, grad_accum)} steps, "
                             f"or recipe {self.config.recipe}") from None


def recipe(name: str, **overrides) -> Recipe:
    """The recipe ``name`` (one of ``RECIPE_NAMES``); keyword overrides replace fields of its
    ``AdaHOPConfig`` (e.g. ``calibration_steps=10``)."""
    if name in SCHEDULED_RECIPES:
        numerics, schedule = SCHEDULED_RECIPES[name]
    elif name in RECIPES:
        numerics, schedule = name, NO_SCHEDULE
    else:
        raise ValueError(f"unknown recipe {name!r}; known recipes: {RECIPE_NAMES}")
    return Recipe(name, AdaHOPConfig.from_recipe_name(numerics, **overrides), schedule)


def recipe_name(numerics: str, schedule: PrecisionSchedule) -> str:
    """A run's recipe in words: the name of ``SCHEDULED_RECIPES`` with numerics recipe
    ``numerics`` and this BF16 phase, else ``numerics``, with the phase where it has one of its own
    (bf16 has none: every GEMM is BF16 already)."""
    phase = (schedule.bf16_phase_start, schedule.bf16_phase_gemms)
    for name, (own_numerics, own) in SCHEDULED_RECIPES.items():
        if numerics == own_numerics and phase == (own.bf16_phase_start, own.bf16_phase_gemms):
            return name
    if not schedule.has_phase or numerics == "bf16":
        return numerics
    return f"{numerics}, {schedule.describe()}"
