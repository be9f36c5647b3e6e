"""The share of a training step's linear-layer GEMM FLOPs that run in MXFP4 (``mxfp4_flop_share``):
what a run's recipe, precision schedule (``adahop.schedule``: BF16 blocks, a BF16 phase) and
calibrated modes leave in MXFP4, as the ablation and the pretrained-forward study report it.
"""

from __future__ import annotations

from torch import nn

from adahop.convert import adahop_layers
from adahop.gemm_geometry import GEMMS, oe_outer_size


def mxfp4_flop_share(model: nn.Module, tokens: int, calibrating: set[str] | None = None,
                     gemms: tuple[str, ...] = GEMMS) -> float:
    """The share of one training step's linear-layer GEMM FLOPs that run in MXFP4, with the
    modes the layers have now; ``gemms``: of those GEMMs alone (("fprop",): an evaluation's).

    Every ``nn.Linear`` counts, converted or not (an LM head or a BF16 block is high precision),
    each with its three GEMMs of ``2 * tokens * N * K`` FLOPs. A GEMM in an MXFP4 mode counts
    but for its OE slices (k of the outer dim it selects from, in high precision). The layers
    named in ``calibrating`` (default: those calibrating now) count as their calibration runs
    them: nothing in MXFP4 under ``calibration_gemms="bf16"``, all of it under "iht"."""
    from adahop.linear import AdaHOPLinear

    layers = adahop_layers(model)
    if calibrating is None:
        calibrating = {fqn for fqn, layer in layers.items() if layer.calibrating}
    total = low = 0.0
    for fqn, mod in model.named_modules():
        if not isinstance(mod, (nn.Linear, AdaHOPLinear)):
            continue
        n, k = mod.out_features, mod.in_features
        flops = 2.0 * tokens * n * k
        total += len(gemms) * flops
        if not isinstance(mod, AdaHOPLinear):
            continue
        if fqn in calibrating:
            low += len(gemms) * flops if mod.config.calibration_gemms == "iht" else 0.0
            continue
        for gemm in gemms:
            mode = mod.modes[gemm]
            if mode == "bf16":
                continue
            size = oe_outer_size(gemm, mode, {"T": tokens, "N": n, "K": k})  # OE's slices: high precision
            hp = 0.0
            if size is not None:
                hp = min((mod.oe_ks or {}).get(gemm, mod.config.gemm(gemm).oe_k), size) / size
            low += flops * (1 - hp)
    return low / total if total else 0.0
