"""torchtitan integration: AdaHOP linears in torchtitan's models, trained by its own trainer.

torchtitan (``pip install "adahop[titan]"``, 0.3) builds a model from a tree of configs; a
*model converter* (``torchtitan.protocols.model.ModelConfigConverter``, how its float8, MX and
NVFP4 converters plug in) rewrites that tree before the model is built. ``AdaHOPConverter``
puts an ``AdaHOPTitanLinear`` config in place of each ``Linear`` config of the transformer
blocks (the LM head ``lm_head``, the embeddings and the norms stay as they are), naming each
layer by its module fqn (the layer's stochastic-rounding seed and per-layer modes go by name).
The parameters keep torchtitan's names: a stock checkpoint loads into the converted model and
the converted model's weights load into a stock one (the AdaHOP layers add only their
``_extra_state``: calibration, modes, the SR call counter).

The precision schedule runs through ``ModelSpec.post_optimizer_build_fn``
(``ScheduleHook``): an optimizer step pre-hook that calls ``PrecisionSchedule.apply`` before
each step. ``adahop.titan.config_registry`` holds the trainer configs that wire both, for
``torchtitan.train --module adahop.titan --config llama3_debugmodel_adahop`` (docs/torchtitan.md).

This package imports no torchtitan (``hooks`` is torchtitan-free); ``adahop.titan.linear`` and
``adahop.titan.config_registry`` do, and adahop never imports them itself.
"""

from adahop.titan.hooks import AdaHOPHook, is_block_linear, optimizer_step

__all__ = ["AdaHOPHook", "is_block_linear", "optimizer_step"]
