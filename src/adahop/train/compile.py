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

Recompiles: each AdaHOP layer's numerics (``AdaHOPLinear.numerics``: its frozen modes, OE k,
sign seeds) are a string the compiled code reads as a constant, so Dynamo guards on its value,
and blocks whose layers froze other modes compile other graphs of the same code
(``TransformerBlock.forward``: one code object for every block, whether each block is compiled
on its own or, under FSDP2, the whole model's graph breaks at each sharded block). Those graphs
are needed: the modes choose the kernels. Making the numerics a graph input instead would trace
every mode's code into one graph, or break the graph at each layer. But Dynamo counts every graph
of one code object against its ``recompile_limit`` (8 by default) and runs the code eagerly past
it, silently but for one warning: with more than 8 distinct sets of modes among the blocks, the
other blocks would lose compilation. So a compiled call runs under a recompile limit of Dynamo's
own allowance per distinct numerics set (a block's layers' numerics, and the compiled module's)
seen so far in this process, times the number of such sets (``_recompile_budget``): each set is,
to Dynamo, another function, and gets what one function gets (its dynamic-shape and
``no_grad`` variants). The limit is set around the compiled call, where Dynamo reads it (when a
frame misses its guards), and nowhere else: other compiled code in the process keeps Dynamo's
limits. (``torch.compile(recompile_limit=...)``, torch 2.13, fixes it at compile time, before
calibration has chosen the modes; it sets the same config around the region's compiles.) The
sets grow at the freeze after calibration (eager before: no graph) and at a change of modes late
in training (the BF16 phase), and are bounded by the blocks and the changes of modes.
"""

from __future__ import annotations

import functools

import torch
from torch import nn


def _adahop_layers(model: nn.Module) -> list:
    from adahop.linear import AdaHOPLinear

    return [m for m in model.modules() if isinstance(m, AdaHOPLinear)]


# Each distinct numerics set a compiled call has run with in this process (module doc): a tuple of
# the numerics of one block's AdaHOP layers, or of a compiled module's. Process-wide, as Dynamo's
# cache of a code object is (every model's blocks share TransformerBlock.forward).
_numerics_sets_seen: set[tuple[str, ...]] = set()


def _numerics_units(module: nn.Module) -> list[list]:
    """The AdaHOP layers of ``module`` and of each of its transformer blocks: the groups whose
    numerics Dynamo guards on in one compiled frame (``module``'s own, or a block's when the
    graph breaks at it, under FSDP2)."""
    from adahop.train.distributed import transformer_blocks

    units = [_adahop_layers(module)]
    units += [_adahop_layers(block) for block in transformer_blocks(module) if block is not module]
    return [unit for unit in units if unit]


def _recompile_budget(units: list[list]) -> dict[str, int] | None:
    """The Dynamo limits for a compiled call of the module with these ``units`` (module doc), or
    None where Dynamo's own suffice."""
    _numerics_sets_seen.update(tuple(layer.numerics for layer in unit) for unit in units)
    config = torch._dynamo.config
    per_set, accumulated = getattr(config, _LIMIT), getattr(config, _ACCUMULATED_LIMIT)
    budget = per_set * max(1, len(_numerics_sets_seen))
    if budget <= per_set:
        return None
    return {_LIMIT: budget, _ACCUMULATED_LIMIT: max(budget, accumulated)}


# (torch 2.6 names them cache_size_limit and accumulated_cache_size_limit; later ones keep those as aliases)
_LIMIT = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
_ACCUMULATED_LIMIT = ("accumulated_recompile_limit" if hasattr(torch._dynamo.config, "accumulated_recompile_limit")
                      else "accumulated_cache_size_limit")


def _compile_after_calibration(module: nn.Module, **compile_options) -> None:
    """Replace ``module.forward`` by one that runs the compiled forward, or the eager one while
    any AdaHOP layer inside calibrates; the compiled one with a recompile limit that covers each
    set of modes (module doc)."""
    if getattr(module.forward, "_adahop_compiled", False):
        raise ValueError(f"{type(module).__name__} is compiled already")
    layers = _adahop_layers(module)
    units = _numerics_units(module)
    eager = module.forward
    compiled = torch.compile(eager, **compile_options)

    @functools.wraps(eager)
    def forward(*args, **kwargs):
        if any(layer.calibrating for layer in layers):
            return eager(*args, **kwargs)
        limits = _recompile_budget(units)
        if limits is None:
            return compiled(*args, **kwargs)
        with torch._dynamo.config.patch(**limits):
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
    sign seeds are constants) compiles its own, once, however many there are (the recompile
    limit covers them: module doc).

    Raises ``ValueError`` for a model without transformer blocks (nothing would be compiled)."""
    from adahop.llama.model import TransformerBlock

    blocks = [m for m in model.modules() if isinstance(m, TransformerBlock)]
    if not blocks:
        raise ValueError(f"compile_blocks found no TransformerBlock in {type(model).__name__}: nothing to compile")
    for block in blocks:
        _compile_after_calibration(block, **compile_options)
    return len(blocks)
