"""Per-row unbiasing of the forward GEMM's MXFP4 product (``AdaHOPConfig.fprop_unbias``,
``adahop.unbias``): its numerics against the formula, that it takes the shrink away, the
backward it leaves unchanged, the numerics key, and the refusals."""

from __future__ import annotations

import math

import pytest
import torch
from probe_layer import fwd_bwd, probe_layer

from adahop import AdaHOPConfig
from adahop.formats.mxfp4 import fake_quantize_mxfp4
from adahop.layer.plan import layer_plan, numerics_key
from adahop.ops.operand import OperandSpec
from adahop.transforms.hadamard import block_hadamard
from adahop.unbias import row_unbiasing


def data(T=128, K=128, N=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, K, generator=gen) * torch.rand(1, K, generator=gen) * 3  # channels of different sizes
    w = torch.randn(N, K, generator=gen) / math.sqrt(K)
    g = torch.randn(T, N, generator=gen)
    return x, w, g


def factors(v):
    """The formula: <v, v> / <Q(v), v> per row, in float64."""
    v = v.double()
    q = fake_quantize_mxfp4(v.float(), dim=-1).double()
    return v.pow(2).sum(-1) / (q * v).sum(-1)


@pytest.mark.parametrize("recipe", ["mxfp4", "mxfp4_iht"])
def test_forward_is_the_formula(recipe):
    x, w, _ = data()
    iht = recipe == "mxfp4_iht"
    with torch.no_grad():
        y = probe_layer(recipe, w, fprop_unbias=True)(x)
    xv, wv = (block_hadamard(x, dim=-1), block_hadamard(w, dim=-1)) if iht else (x, w)
    plain = fake_quantize_mxfp4(xv, dim=-1).double() @ fake_quantize_mxfp4(wv, dim=-1).double().t()
    want = plain * factors(xv)[:, None] * factors(wv)[None, :]
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5)


def test_the_shrink_is_taken_away():
    """Round to nearest shrinks the product (its component along the exact one is below 1); the
    factors bring it within a fifth of the shrink to 1 (the product of two unbiased operands is
    nearly, not exactly, unbiased)."""
    x, w, _ = data(T=256, K=256, N=128, seed=1)
    exact = x.double() @ w.double().t()

    def gain(y):
        return ((y.double() * exact).sum() / exact.pow(2).sum()).item() - 1

    with torch.no_grad():
        plain, unbiased = probe_layer("mxfp4", w)(x), probe_layer("mxfp4", w, fprop_unbias=True)(x)
    assert gain(plain) < -0.005
    assert abs(gain(unbiased)) < 0.2 * abs(gain(plain))


def test_rows_without_a_positive_denominator_keep_1():
    t = torch.randn(4, 64)
    t[1] = 0
    t[2, 5] = float("nan")
    c = row_unbiasing(t, 1, OperandSpec())
    assert c[1] == 1 and c[2] == 1 and c[0] != 1 and c[3] != 1


def test_backward_is_unchanged():
    x, w, g = data(seed=2)
    y0, dx0, dw0 = fwd_bwd(probe_layer("mxfp4_iht", w), x, g)
    y1, dx1, dw1 = fwd_bwd(probe_layer("mxfp4_iht", w, fprop_unbias=True), x, g)
    assert not torch.equal(y0, y1)
    assert torch.equal(dx0, dx1) and torch.equal(dw0, dw1)


def test_oe_slices_stay_exact_and_the_options_compose():
    x, w, _ = data(T=64, K=64, N=48, seed=3)
    lay = probe_layer("adahop_lv2", w, fprop_unbias=True, fprop_mean_bias=True)
    lay.set_modes({"fprop": "iht+oe_left", "dgrad": "bf16", "wgrad": "bf16"})
    with torch.no_grad():
        y = lay(x)
    assert torch.isclose(y, x @ w.t(), rtol=1e-4, atol=1e-4).all(1).sum() == 8  # the OE rows, not scaled


def test_with_the_mean_split_off_the_factors_are_r_s():
    """Both options: y = c_r c_W Q(r) Q(W)^T + mu W^T (the factors of the centred activation)."""
    x, w, _ = data(T=64, K=64, N=48, seed=5)
    x = x + 3 * torch.randn(1, 64, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        y = probe_layer("mxfp4_iht", w, fprop_unbias=True, fprop_mean_bias=True)(x)
    mu = x.mean(0, keepdim=True)
    rv, wv = block_hadamard(x - mu, dim=-1), block_hadamard(w, dim=-1)
    plain = fake_quantize_mxfp4(rv, dim=-1).double() @ fake_quantize_mxfp4(wv, dim=-1).double().t()
    want = plain * factors(rv)[:, None] * factors(wv)[None, :] + mu.double() @ w.double().t()
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5)


def test_numerics_key_and_refusals():
    modes = {"fprop": "iht", "dgrad": "iht", "wgrad": "iht"}
    off = AdaHOPConfig.from_recipe_name("mxfp4_iht")
    on = off.replace(fprop_unbias=True)
    key_off, key_on = numerics_key(off, modes, (None,) * 3), numerics_key(on, modes, (None,) * 3)
    assert "unbias" not in key_off and "unbias" in key_on
    state = torch.zeros(2, dtype=torch.int64)
    assert layer_plan(key_on, state, torch.device("cpu"), True).fprop_unbias
    assert not layer_plan(key_off, state, torch.device("cpu"), True).fprop_unbias
    assert AdaHOPConfig.from_dict(on.to_dict()) == on
    with pytest.raises(ValueError, match="fprop_unbias needs the weight in high precision"):
        AdaHOPConfig.from_recipe_name("mxfp4", fprop_unbias=True, dgrad_weight="forward", quantized_all_gather=True)
    with pytest.raises(ValueError, match="fprop_unbias is for recipes with an MXFP4 forward"):
        AdaHOPConfig.from_recipe_name("bf16", fprop_unbias=True)
    with pytest.raises(ValueError, match="must be a bool"):
        AdaHOPConfig.from_recipe_name("mxfp4", fprop_unbias="yes")
