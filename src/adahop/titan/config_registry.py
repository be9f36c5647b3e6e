"""torchtitan trainer configs with AdaHOP, for ``torchtitan.train --module adahop.titan --config NAME``
(torchtitan's config manager imports ``<module>.config_registry`` and calls ``NAME()``).
Imports torchtitan (``pip install "adahop[titan]"``).
"""

from __future__ import annotations

from dataclasses import fields

from torchtitan.trainer import Trainer

from adahop.titan.trainer import AdaHOPOptions, AdaHOPTrainer


def adahop_config(base: Trainer.Config, **options) -> AdaHOPTrainer.Config:
    """``base`` (any torchtitan ``Trainer.Config``) as an ``AdaHOPTrainer.Config``, with
    ``AdaHOPOptions(**options)`` (recipe, calibration_steps, ...): its model's block linears
    are converted when the trainer is made."""
    if not isinstance(base, Trainer.Config):
        raise ValueError(f"base must be a torchtitan Trainer.Config, got {type(base).__name__}")
    kept = {f.name: getattr(base, f.name) for f in fields(Trainer.Config) if f.init}
    return AdaHOPTrainer.Config(**kept, adahop=AdaHOPOptions(**options))


def llama3_debugmodel_adahop() -> AdaHOPTrainer.Config:
    """torchtitan's ``llama3_debugmodel`` (6 blocks of dim 256, 10 steps) with adahop_lv2_tail,
    calibrating over its first 2 steps (the BF16 phase of a 10-step run begins after step 8)."""
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    return adahop_config(llama3_debugmodel(), recipe="adahop_lv2_tail", calibration_steps=2)
