"""``torch.compile`` for training: the whole model as one graph (``compile_model``), or each
transformer block on its own (``compile_blocks``, torchtitan's way).

Why compile: with eager PyTorch, a training step of the 1B model spends more time in small
elementwise kernels than in its GEMMs (profiled on the H200: ~300 of 546 ms per step were the fp32
residual adds, casts and copies, RMSNorm, RoPE and SwiGLU's product, each its own kernel reading
and writing the whole activation; the same in every recipe). Inductor fuses those chains into a
few kernels.

The AdaHOP layers are traced with the rest: their GEMMs are two custom ops per layer
(``adahop.layer.ops``) with fake implementations, and their stochastic-rounding counters are
device tensors advanced inside the graph. After calibration a converted model is one graph, with
no graph break (tested on the CPU for every recipe); that is also what lets a CUDA graph replay a
whole step.

Calibration (the adaptive recipes' first steps) reads statistics back to the host each step and
so cannot be traced: a compiled model (or block) runs eagerly while any of its layers calibrates
and compiles once, when the last one has frozen its modes. Compiling the pieces between
calibrating layers instead would compile dozens of small graphs for a few steps, and leave
Dynamo's automatic dynamic shapes on code that then compiles differently from a resumed run's.

What is compiled is the module in place: the module tree, the state_dict keys and therefore
checkpoints are those of the eager model. Numerics: the fused elementwise kernels round
differently from eager's (fp32 reductions in another order, fewer intermediate bf16 roundings), so
a compiled run's losses match an eager run's closely, not bit for bit; the AdaHOP layers' GEMMs
are the same ops with the same seeds. Exact resume holds within compiled runs (tested on the CPU).
"""

from __future__ import annotations

import functools

import torch
from torch import nn


def _adahop_layers(model: nn.Module) -> list:
    from adahop.linear import AdaHOPLinear

    return [m for m in model.modules() if isinstance(m, AdaHOPLinear)]


def _compile_after_calibration(module: nn.Module, **compile_options) -> None:
    """Replace ``module.forward`` by one that runs the compiled forward, or the eager one while
    any AdaHOP layer inside calibrates."""
    if getattr(module.forward, "_adahop_compiled", False):
        raise ValueError(f"{type(module).__name__} is compiled already")
    layers = _adahop_layers(module)
    eager = module.forward
    compiled = torch.compile(eager, **compile_options)

    @functools.wraps(eager)
    def forward(*args, **kwargs):
        if any(layer.calibrating for layer in layers):
            return eager(*args, **kwargs)
        return compiled(*args, **kwargs)

    forward._adahop_compiled = True
    module.forward = forward


def compile_model(model: nn.Module, **compile_options) -> None:
    """Compile ``model``'s forward as one graph, in place (``torch.compile(**compile_options)``).
    Calls made while any of its AdaHOP layers calibrates run eagerly (module doc). Raises
    ``ValueError`` for a model compiled already."""
    _compile_after_calibration(model, **compile_options)


def compile_blocks(model: nn.Module, **compile_options) -> int:
    """Compile each ``TransformerBlock`` of ``model`` in place, each run eagerly while one of its
    layers calibrates. Returns how many were compiled. The blocks are identical code and their
    parameters and SR state are graph inputs, so blocks whose layers froze the same modes share
    one compiled graph; each other set of modes (and, under random signs, each block: its layers'
    sign seeds are constants) compiles its own, up to Dynamo's recompile limit (8 by default;
    beyond it the other blocks run eagerly, with Dynamo's warning). ``compile_model`` has no such
    limit: the model is one graph.

    Raises ``ValueError`` for a model without transformer blocks (nothing would be compiled)."""
    from adahop.llama.model import TransformerBlock

    blocks = [m for m in model.modules() if isinstance(m, TransformerBlock)]
    if not blocks:
        raise ValueError(f"compile_blocks found no TransformerBlock in {type(model).__name__}: nothing to compile")
    for block in blocks:
        _compile_after_calibration(block, **compile_options)
    return len(blocks)
