"""Linear layers that read one activation (attention's q, k and v; SwiGLU's w1 and w3) quantize
it once.

Called one by one, each such layer quantizes x itself: along K for its forward GEMM and along
T for its wgrad, a pass over x each, with the same bits where the layers' settings for x are the
same (X is rounded to nearest even: nothing random). ``linears_on_one_input`` runs the group as
one op (``layer.grouped.linear_group_forward``) that makes each distinct quantization of x once; the
weights, the GEMMs, OE, each layer's SR stream and the whole backward stay the layer's own. The
results are those of the layers called one by one, bit for bit (tested), and the saved packed x
is kept once for the layers that share it.

Where the group cannot run as one op the layers are called one by one, as the model would
without this module: a layer that is not an ``AdaHOPLinear``, is calibrating (its statistics run
eagerly) or plain ``F.linear`` (the bf16 recipe), has a bias, a forward hook (a hook, e.g. the
outlier study's or a sharded wrapper's, expects its own call) or a weight that is a tensor
subclass (FSDP2's quantized all-gather hands the layer's own op a gathered MXFP4 weight; a
DTensor), or a config with ``share_input=False`` (docs/method.md, 'Layers that read one
activation'); or when no two layers would quantize x alike.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.nn.modules import module as module_globals

from adahop.layer.bounds import bounds_wanted, input_bound
from adahop.layer.grouped import group_numerics_key
from adahop.linear import AdaHOPLinear


def linears_on_one_input(layers: Sequence[nn.Module], copies: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """``tuple(layer(x) for layer, x in zip(layers, copies))``, where ``copies`` are one
    activation's copies, one per layer (``llama.model.compute_copies``: equal values), with x
    quantized once per distinct setting where the layers allow it (module doc)."""
    if len(layers) != len(copies):
        raise ValueError(f"one copy of the input per layer: {len(layers)} layers, {len(copies)} copies")
    if not _runs_as_group(layers, copies):
        return tuple(layer(x) for layer, x in zip(layers, copies))
    xs = [layer.compute_input(x) for layer, x in zip(layers, copies)]
    backward = [layer.needs_backward(x) for layer, x in zip(layers, xs)]
    if any(b != backward[0] for b in backward):
        return tuple(layer(x) for layer, x in zip(layers, copies))  # (some weights frozen, some not)
    needs_backward = backward[0]
    keys = [layer.input_key(needs_backward) for layer in layers]
    # each layer's owner: the first layer with its key (layer.grouped.group_layers, which the op checks)
    owners = [-1 if key is None else keys.index(key) for key in keys]
    if all(owners.count(owner) < 2 for owner in owners if owner >= 0):
        return tuple(layer(x) for layer, x in zip(layers, copies))  # nothing to share
    group_numerics = group_numerics_key([layer.numerics for layer in layers])
    rng_states = [layer.call_rng_state(needs_backward) for layer in layers]
    with torch.autocast(copies[0].device.type, enabled=False):
        # one bound for the copies (equal values), taken once where some layer's backend takes one
        wanted = next((layer.numerics for layer in layers if bounds_wanted(layer.numerics, str(xs[0].device))[0]),
                      None)
        x_bound = None if wanted is None else input_bound(xs[0], wanted)
        out = torch.ops.adahop.linear_group_forward(xs, [layer.weight for layer in layers], rng_states,
                                                    group_numerics, owners, needs_backward, x_bound)
    return tuple(out[5 * i].reshape(*x.shape[:-1], layer.out_features)
                 for i, (layer, x) in enumerate(zip(layers, copies)))


def _runs_as_group(layers: Sequence[nn.Module], copies: Sequence[torch.Tensor]) -> bool:
    if len(layers) < 2 or module_globals._global_forward_hooks or module_globals._global_forward_pre_hooks:
        return False
    for layer, x in zip(layers, copies):
        if not (isinstance(layer, AdaHOPLinear) and layer.config.share_input and layer.bias is None
                and type(layer.weight) in (torch.Tensor, nn.Parameter)
                and not layer.calibrating and not layer.runs_plain_linear
                and not layer._forward_hooks and not layer._forward_pre_hooks):
            return False
        # (a bad input goes to the layer's own call, which names what is allowed)
        if not (isinstance(x, torch.Tensor) and x.is_floating_point() and x.dim() > 0
                and x.shape[-1] == layer.in_features and x.shape == copies[0].shape):
            return False
    return True
