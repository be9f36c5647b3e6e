"""The AdaHOP linear as a torchtitan component, and the model converter that puts it in the
blocks (imports torchtitan: ``pip install "adahop[titan]"``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torchtitan.config.override import derive
from torchtitan.models.common.linear import Linear
from torchtitan.protocols.model import ModelConfigConverter
from torchtitan.protocols.module import Module

from adahop.linear import AdaHOPLinear
from adahop.recipes import recipe
from adahop.titan.hooks import is_block_linear


class AdaHOPTitanLinear(AdaHOPLinear, Module):
    """``AdaHOPLinear`` built from a torchtitan config (``Module``'s protocol: ``Config.build``,
    ``init_states``); its state dict is torchtitan's ``Linear``'s, ``weight`` (and ``bias``) and
    nothing else.

    No extra state: torchtitan's checkpointer holds tensors only (its ``ModelWrapper`` reads the
    ``.shape`` of every state-dict value, and an AdaHOPLinear's extra state is a dict), and a
    stock checkpoint has none to load. The calibrated modes are kept in a file beside the
    checkpoints instead (``hooks.AdaHOPHook``'s ``modes_file``). So a resumed run restarts the
    stochastic-rounding call counter at 0 (other SR draws than an unbroken run, the same
    distribution), and one resumed before its calibration ended calibrates afresh."""

    get_extra_state = nn.Module.get_extra_state
    set_extra_state = nn.Module.set_extra_state

    @dataclass(kw_only=True, slots=True)
    class Config(Linear.Config):
        recipe: str = "adahop_lv2"  # a numerics recipe (adahop.recipe(name).config)
        name: str = ""  # the layer's module fqn (its SR seed and per-layer modes go by it)
        config_overrides: dict = field(default_factory=dict)  # AdaHOPConfig fields, e.g. calibration_steps

    def __init__(self, config: Config):
        numerics = recipe(config.recipe, **config.config_overrides).config
        AdaHOPLinear.__init__(self, config.in_features, config.out_features, bias=config.bias,
                              config=numerics, name=config.name)

    def _fill_missing_extra_state(self, state_dict, prefix, *args) -> None:
        pass  # (AdaHOPLinear's load pre-hook: there is no extra state to fill in here)

    def _init_self_buffers(self, *, buffer_device: torch.device | None = None) -> None:
        # Built on the meta device and moved with to_empty(), the SR chain state holds garbage:
        # a fresh one (call 0, the seed prefix of this layer's config and name).
        self.rng_state = torch.zeros(2, dtype=torch.int64, device=buffer_device or self.weight.device)
        self.config = self.config


class AdaHOPConverter(ModelConfigConverter):
    """Replaces each block ``Linear`` config of a torchtitan model config with an
    ``AdaHOPTitanLinear`` config (``hooks.is_block_linear``: ``layers.<i>.`` and not the LM head;
    the first and last blocks of the recipe's ``bf16_blocks`` stay ``Linear``). Only
    ``Linear.Config`` itself is replaced, not subclasses with their own forward (e.g.
    ``ScaledBiasRowwiseLinear``)."""

    @dataclass(kw_only=True, slots=True)
    class Config(ModelConfigConverter.Config):
        recipe: str = "adahop_lv2_tail"  # any adahop.recipe name: numerics and schedule
        config_overrides: dict = field(default_factory=dict)

    def __init__(self, config: Config):
        self.recipe = recipe(config.recipe, **config.config_overrides)  # checked here: a bad name fails early
        self.config = config

    def convert(self, model_config):
        n_layers = len(getattr(model_config, "layers", ()) or ())
        converted = 0
        for fqn, cfg, parent, attr in list(model_config.traverse(Linear.Config)):
            if type(cfg) is not Linear.Config or not is_block_linear(fqn, n_layers, self.recipe.schedule.bf16_blocks):
                continue
            new = derive(cfg, AdaHOPTitanLinear.Config, recipe=self.recipe.config.recipe, name=fqn,
                         config_overrides=dict(self.config.config_overrides))
            if isinstance(attr, int):
                parent[attr] = new
            else:
                setattr(parent, attr, new)
            converted += 1
        if not converted:
            raise ValueError(f"{type(model_config).__name__} has no Linear under layers.<i>. to convert")
        return model_config
