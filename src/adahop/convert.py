"""``convert_to_adahop_training``: swap a model's ``nn.Linear`` modules for ``AdaHOPLinear``.

The swapped modules share the original parameters (nothing is copied; optimizers built before or
after the swap see the same tensors). By default every ``nn.Linear`` is converted except the LM
head (the LM head, embeddings, norms and attention's own matmuls stay in high precision: see
docs/method.md, 'The three GEMMs of a linear layer'). The LM head is recognised as a Linear whose
weight is tied to an ``nn.Embedding`` or whose name ends in ``lm_head``, ``output`` or ``head``;
pass ``module_filter_fn`` to decide yourself.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from adahop.config import AdaHOPConfig
from adahop.linear import AdaHOPLinear

LM_HEAD_NAMES = ("lm_head", "output", "head")


def default_module_filter(model: nn.Module) -> Callable[[nn.Module, str], bool]:
    """Convert every nn.Linear but the LM head (see the module doc)."""
    embedding_weights = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}

    def keep(mod: nn.Module, fqn: str) -> bool:
        if fqn.rsplit(".", 1)[-1] in LM_HEAD_NAMES:
            return False
        return id(mod.weight) not in embedding_weights

    return keep


def convert_to_adahop_training(
    model: nn.Module,
    *,
    config: AdaHOPConfig,
    module_filter_fn: Callable[[nn.Module, str], bool] | None = None,
) -> nn.Module:
    """Replace, in place, each ``nn.Linear`` of ``model`` accepted by ``module_filter_fn(module,
    fqn)`` with an ``AdaHOPLinear`` sharing its parameters. Returns ``model``.

    A model that is itself an ``nn.Linear`` is converted and returned (it cannot be swapped in
    place). Already-converted layers are left alone."""
    if not isinstance(config, AdaHOPConfig):
        raise ValueError(f"config must be an AdaHOPConfig (see AdaHOPConfig.from_recipe_name), "
                         f"got {type(config).__name__}")
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be an nn.Module, got {type(model).__name__}")
    keep = module_filter_fn or default_module_filter(model)

    def eligible(mod: nn.Module) -> bool:
        return type(mod) is nn.Linear

    if eligible(model):
        return AdaHOPLinear.from_float(model, config=config, name="") if keep(model, "") else model
    for fqn, mod in list(model.named_modules()):
        for child_name, child in list(mod.named_children()):
            child_fqn = f"{fqn}.{child_name}" if fqn else child_name
            if eligible(child) and keep(child, child_fqn):
                setattr(mod, child_name, AdaHOPLinear.from_float(child, config=config, name=child_fqn))
    return model


def adahop_layers(model: nn.Module) -> dict[str, AdaHOPLinear]:
    """The converted layers of ``model`` by qualified name."""
    return {fqn: m for fqn, m in model.named_modules() if isinstance(m, AdaHOPLinear)}


def is_calibrated(model: nn.Module) -> bool:
    """True when every converted layer has frozen modes."""
    return all(not m.calibrating for m in adahop_layers(model).values())


def finish_calibration(model: nn.Module) -> dict[str, dict]:
    """Freeze every still-calibrating adaptive layer now (from the steps seen so far)."""
    return {fqn: m.finish_calibration() for fqn, m in adahop_layers(model).items() if m.calibrating}
