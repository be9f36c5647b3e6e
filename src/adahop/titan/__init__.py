"""torchtitan integration: AdaHOP linears in torchtitan's models, trained by its own trainer.

torchtitan (``pip install "adahop[titan]"``, 0.3) builds a model from a tree of configs; a
*model converter* (``torchtitan.protocols.model.ModelConfigConverter``, how its float8, MX and
NVFP4 converters plug in) rewrites that tree before the model is built. ``AdaHOPConverter``
puts an ``AdaHOPTitanLinear`` config in place of each ``Linear`` config of the transformer
blocks (the LM head ``lm_head``, the embeddings and the norms stay as they are), naming each
layer by its module fqn (the layer's stochastic-rounding seed and per-layer modes go by name).
The state dict is the stock model's, key for key (no ``_extra_state``: torchtitan's
checkpointer holds tensors only): a stock checkpoint loads into the converted model and the
converted model's into a stock one; the calibrated modes are kept in a file instead.

The precision schedule and the modes run through ``ModelSpec.post_optimizer_build_fn``
(``AdaHOPHook``): an optimizer step pre-hook that calls ``PrecisionSchedule.apply`` before each
step, and a post-hook that writes the calibrated modes beside the checkpoints.
``adahop.titan.trainer.AdaHOPTrainer``, torchtitan's ``Trainer`` with ``--adahop.*`` flags,
wires both from the final config and runs each step through an ``adahop.Calibrator`` (data
parallelism); ``adahop.titan.config_registry`` holds its configs, for
``torchtitan.train --module adahop.titan --config llama3_debugmodel_adahop`` (docs/torchtitan.md).

This package imports no torchtitan (``hooks`` is torchtitan-free); ``adahop.titan.linear``,
``trainer`` and ``config_registry`` do, and adahop never imports them itself.
"""

from adahop.titan.hooks import AdaHOPHook, is_block_linear, optimizer_step

__all__ = ["AdaHOPHook", "is_block_linear", "optimizer_step"]
