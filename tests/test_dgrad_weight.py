"""One weight for the forward and dgrad (AdaHOPConfig.dgrad_weight = "forward"): the tile-
quantized weight, the weight dgrad multiplies by, and a tiny model trained with it."""

import dataclasses

import pytest
import torch

import adahop
from adahop.formats.mxfp4 import fake_quantize_mxfp4, fake_quantize_mxfp4_tiles
from adahop.layer.gemms import forward_gemms, forward_weight, mxfp4_gemm
from adahop.ops.backends import ReferenceBackend
from adahop.ops.operand import quantize_operand
from adahop.transforms.hadamard import block_hadamard

from test_trainer import CountingBatches, config


def spread_weight(n=96, k=70, seed=0):
    """A weight whose columns span five decades (so tiles and blocks choose different scales),
    with dims that are not multiples of the tile."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * torch.logspace(-3, 2, k)


@pytest.mark.parametrize("scale_mode", ["floor", "even", "ceil", "rceil"])
def test_a_tile_quantized_weight_is_one_quantized_tensor_along_either_dim(scale_mode):
    w2 = fake_quantize_mxfp4_tiles(spread_weight(), scale_mode=scale_mode)
    assert torch.equal(fake_quantize_mxfp4(w2, dim=1, scale_mode=scale_mode), w2)  # fprop: blocks along K
    assert torch.equal(fake_quantize_mxfp4(w2, dim=0, scale_mode=scale_mode), w2)  # dgrad: blocks along N
    assert not torch.equal(w2, fake_quantize_mxfp4(spread_weight(), dim=1, scale_mode=scale_mode))


def test_tile_quantization_of_bad_input():
    w = spread_weight(64, 64)
    w[3, 40] = float("nan")
    out = fake_quantize_mxfp4_tiles(w)
    assert out[:32, 32:].isnan().all() and not out[32:].isnan().any() and not out[:32, :32].isnan().any()
    with pytest.raises(ValueError, match="2-D"):
        fake_quantize_mxfp4_tiles(torch.randn(4, 4, 4))
    with pytest.raises(ValueError, match="scale_mode"):
        fake_quantize_mxfp4_tiles(w, scale_mode="nearest")


def layer(recipe, w, dgrad_weight="forward", modes=None):
    cfg = adahop.AdaHOPConfig.from_recipe_name(recipe, backend="reference", dgrad_weight=dgrad_weight)
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    lin.weight.data.copy_(w)
    m = adahop.AdaHOPLinear.from_float(lin, config=cfg.with_gemm_settings(oe_k=4))
    if modes:
        m.set_modes(modes)
    return m


def run(m, x, g):
    xx = x.clone().requires_grad_()
    y = m(xx)
    y.backward(g)
    return y.detach(), xx.grad, m.weight.grad


def test_plain_mxfp4_multiplies_fprop_and_dgrad_by_the_same_quantized_weight():
    torch.manual_seed(1)
    w, x, g = spread_weight(96, 64), torch.randn(48, 64), torch.randn(48, 96)
    m = layer("mxfp4", w)
    plan = m._plan(torch.device("cpu"))  # this call's plan (SR seeds: the counter before the call)
    y, dx, dw = run(m, x, g)
    w2 = fake_quantize_mxfp4_tiles(w)
    be = ReferenceBackend()
    # fprop's B (w along K) and dgrad's B (w along N) are W2 itself, bit for bit
    assert torch.equal(quantize_operand(w2, 1, plan.fprop.b).codes, be.quantize(w2, 1, plan.fprop.b).codes)
    assert torch.equal(fake_quantize_mxfp4(w2, dim=1), w2) and torch.equal(fake_quantize_mxfp4(w2, dim=0), w2)
    y_ref = be.mm_nt(be.quantize(x, 1, plan.fprop.a), be.quantize(w2, 1, plan.fprop.b), x.dtype)
    assert torch.equal(y, y_ref)
    dx_ref = mxfp4_gemm(plan.dgrad, be, g, 1, w2, 0, a_hp=None, b_hp=None, out_dtype=g.dtype)
    assert torch.equal(dx, dx_ref)
    # the master-weight layer: the same wgrad (x and g are quantized the same way), another fprop/dgrad
    y_m, dx_m, dw_m = run(layer("mxfp4", w, "master"), x, g)
    assert torch.equal(dw, dw_m) and not torch.equal(y, y_m) and not torch.equal(dx, dx_m)


@pytest.mark.parametrize("fprop_mode", ["iht", "iht+oe_left", "iht+oe_right"])
def test_a_rotated_forward_leaves_fprop_alone_and_gives_dgrad_its_weight(fprop_mode):
    torch.manual_seed(2)
    w, x, g = torch.randn(96, 64), torch.randn(48, 64), torch.randn(48, 96)
    modes = {"fprop": fprop_mode, "dgrad": "iht", "wgrad": "iht"}
    m = layer("mxfp4_iht", w, modes=modes)
    y, dx, dw = run(m, x, g)
    y_m, dx_m, dw_m = run(layer("mxfp4_iht", w, "master", modes=modes), x, g)
    assert torch.equal(y, y_m) and torch.equal(dw, dw_m) and not torch.equal(dx, dx_m)
    plan = m._plan(torch.device("cpu"))
    w_f = forward_weight(w, plan, torch.float32)
    # the weight fprop used: its rotation is fprop's quantized B (OE-right rows: the weight's own)
    spec = plan.fprop.b
    deq = fake_quantize_mxfp4(block_hadamard(w_f, dim=1, size=spec.hadamard_size), dim=1)
    rows = ReferenceBackend().select_outer(w, 0, 4) if fprop_mode == "iht+oe_right" else None
    keep = torch.ones(96, dtype=torch.bool)
    if rows is not None:
        keep[rows] = False
        assert torch.equal(w_f[rows], w[rows])
    rotated = block_hadamard(w.index_fill(0, rows, 0) if rows is not None else w, dim=1, size=spec.hadamard_size)
    assert torch.allclose(deq[keep], fake_quantize_mxfp4(rotated, dim=1)[keep], atol=1e-6)
    # and the forward's output is x times it, up to fp32 summation order
    y_f, *_ = forward_gemms(x, w, dataclasses.replace(plan, needs_backward=False))
    if fprop_mode == "iht":
        xq = fake_quantize_mxfp4(block_hadamard(x, dim=1, size=spec.hadamard_size), dim=1)
        assert torch.allclose(y_f, xq @ block_hadamard(w_f, dim=1, size=spec.hadamard_size).t(), atol=1e-4)


def test_dgrad_weight_config_checks():
    with pytest.raises(ValueError, match="dgrad_weight must be one of"):
        adahop.AdaHOPConfig.from_recipe_name("mxfp4", dgrad_weight="shared")
    cfg = adahop.AdaHOPConfig.from_recipe_name("mxfp4")
    with pytest.raises(ValueError, match="b_rounding must be 'rne'"):
        cfg.replace(fprop=dataclasses.replace(cfg.fprop, b_rounding="sr"), dgrad_weight="forward")
    d = adahop.AdaHOPConfig.from_recipe_name("adahop_lv2", dgrad_weight="forward").to_dict()
    assert adahop.AdaHOPConfig.from_dict(d).dgrad_weight == "forward"


@pytest.mark.parametrize("recipe", ["mxfp4", "adahop_lv2"])
def test_a_tiny_model_trains_with_one_weight(tmp_path, recipe):
    from test_precision import llama

    from adahop.train.trainer import train

    cfg = config(tmp_path, steps=16, calibration_steps=2, recipe=recipe)
    cfg = dataclasses.replace(cfg, adahop=cfg.adahop.replace(dgrad_weight="forward"))
    losses = train(cfg, model=llama(n_layers=2), train_batches=CountingBatches())["losses"]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5
