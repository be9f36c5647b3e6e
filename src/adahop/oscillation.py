"""Weight-oscillation dampening: a pull of each quantized weight toward the value its forward
GEMM multiplies by.

Near convergence, a latent weight that sits close to the midpoint between two adjacent FP4
values flips between them from step to step: the forward sees a weight that jumps by a whole
grid step while the latent weight barely moves, and the loss stops improving (Nagel et al.,
"Overcoming Oscillations in Quantization-Aware Training", 2022). Their dampening adds

    lambda * sum ||W - Q(W)||^2        (Q(W) held constant: no gradient through the rounding)

to the loss, i.e. ``2 * lambda * (W - Q(W))`` to each weight's gradient, which draws latent
weights away from the decision boundaries toward the grid points, where small updates do not
flip them.

Here Q(W) is the weight the layer's forward GEMM uses (``layer.gemms.forward_weight``: fprop's
quantized W, rotated back for IHT modes, with the OE rows exact; under IHT the distance is the
same in the rotated basis, which is orthonormal). Layers still calibrating and layers whose
forward runs in BF16 get no term. The term is added after the backward, before gradient
clipping, so the clipped norm includes it: a loop calls ``add_dampening_grad(model, lambda,
dtype)`` there (``adahop train``: ``--oscillation-dampening``, ``TrainConfig.oscillation_dampening``;
0 is off). It reads whole weights: under FSDP2 a layer holds a shard (not supported there).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from adahop.convert import adahop_layers
from adahop.layer.gemms import forward_weight


def check_dampening(value) -> float:
    """lambda: a finite float >= 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"oscillation_dampening must be a finite number >= 0, got {value!r}")
    return float(value)


@torch.no_grad()
def add_dampening_grad(model: nn.Module, strength: float, dtype: torch.dtype = torch.float32) -> int:
    """Add ``2 * strength * (W - Q(W))`` to the gradient of every converted layer's weight whose
    forward GEMM is quantized (``dtype``: the compute dtype, bf16 under autocast). Returns how
    many layers got the term."""
    if check_dampening(strength) == 0:
        return 0
    count = 0
    for layer in adahop_layers(model).values():
        w = layer.weight
        if w.grad is None or layer.calibrating:
            continue
        if _is_shard(w):
            raise ValueError(f"oscillation dampening reads whole weights: {layer.layer_name!r} holds an FSDP2 shard "
                             "(use DDP, or no dampening)")
        plan = layer._plan(w.device, needs_backward=False)
        if not plan.fprop.quantized:
            continue
        w.grad.add_(w - forward_weight(w, plan, dtype).to(w.dtype), alpha=2 * strength)
        count += 1
    return count


def _is_shard(w: torch.Tensor) -> bool:
    """A DTensor (FSDP2's sharded parameter)."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(w, DTensor)
