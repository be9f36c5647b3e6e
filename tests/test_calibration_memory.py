"""What a calibrating layer keeps for its backward: the source of the adaptive recipes' memory
peak (docs/method.md, 'Calibration').

Under ``calibration_gemms="bf16"`` a calibration step saves x itself, as ``nn.Linear`` does; under
``"iht"`` it saves what a frozen layer with IHT modes saves (x as packed MXFP4 codes and scales),
so the calibration steps need no more activation memory than the steps after them."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from adahop import AdaHOPConfig, AdaHOPLinear

T, K, N = 512, 256, 128


def _layer(config: AdaHOPConfig, w: torch.Tensor) -> AdaHOPLinear:
    lin = nn.Linear(K, N, bias=False, dtype=w.dtype)
    with torch.no_grad():
        lin.weight.copy_(w)
    return AdaHOPLinear.from_float(lin, config=config, name="layer")


def _activation_bytes(layer: AdaHOPLinear, x: torch.Tensor) -> tuple[int, torch.Tensor]:
    """Bytes the forward saves for the backward, the parameter (saved by reference) left out."""
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = layer(x)
    ptr = layer.weight.untyped_storage().data_ptr()
    storages = {}
    for t in saved:
        if t.untyped_storage().data_ptr() != ptr:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values()), y


@pytest.fixture(scope="module")
def data():
    gen = torch.Generator().manual_seed(3)
    w = (torch.randn(N, K, generator=gen) / math.sqrt(K)).to(torch.bfloat16)
    x = torch.randn(T, K, generator=gen).to(torch.bfloat16)
    return w, x


def test_iht_calibration_saves_what_the_frozen_iht_layer_saves(data):
    w, x = data
    lv2 = AdaHOPConfig.from_recipe_name("adahop_lv2", calibration_steps=4)
    calib_bf16 = _layer(lv2, w)
    calib_iht = _layer(lv2.replace(calibration_gemms="iht"), w)
    frozen = _layer(AdaHOPConfig.from_recipe_name("adahop_lv2"), w)
    frozen.set_modes({"fprop": "iht", "dgrad": "iht", "wgrad": "iht"})
    assert calib_bf16.calibrating and calib_iht.calibrating and not frozen.calibrating

    bf16_bytes, y = _activation_bytes(calib_bf16, x.clone().requires_grad_(True))
    y.float().sum().backward()
    iht_bytes, y = _activation_bytes(calib_iht, x.clone().requires_grad_(True))
    y.float().sum().backward()
    frozen_bytes, y = _activation_bytes(frozen, x.clone().requires_grad_(True))
    y.float().sum().backward()

    packed = T * K // 2 + T * K // 32  # 4-bit codes + one E8M0 scale byte per 32
    assert bf16_bytes >= T * K * 2  # x itself, in bf16
    assert frozen_bytes - packed <= 64  # the packed x and the SR chain state
    assert iht_bytes == frozen_bytes
    assert iht_bytes < 0.3 * bf16_bytes
    # both calibrations observed the step they ran
    assert calib_bf16.calibration.steps == calib_iht.calibration.steps == 1
