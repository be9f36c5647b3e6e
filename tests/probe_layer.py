"""One AdaHOPLinear on the reference backend with a given weight, and its forward + backward: the
probe of the tests of a forward option (``test_mean_bias``, ``test_unbias``)."""

import torch
from torch import nn

from adahop import AdaHOPConfig, AdaHOPLinear


def probe_layer(recipe, w, oe_k=8, **cfg):
    """An AdaHOPLinear of ``recipe`` (with ``cfg``'s settings, OE k ``oe_k``) whose weight is ``w``."""
    lin = nn.Linear(w.shape[1], w.shape[0], bias=False)
    with torch.no_grad():
        lin.weight.copy_(w)
    config = AdaHOPConfig.from_recipe_name(recipe, backend="reference", **cfg).with_gemm_settings(oe_k=oe_k)
    return AdaHOPLinear.from_float(lin, config=config, name="blk.fc")


def fwd_bwd(lay, x, g):
    """``(y, dx, dw)`` of one forward on ``x`` and backward with ``g``."""
    xr = x.clone().requires_grad_(True)
    y = lay(xr)
    y.backward(g)
    return y.detach(), xr.grad, lay.weight.grad
