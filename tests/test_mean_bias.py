"""The activation's mean taken out of the forward GEMM's MXFP4 operand and added back as a rank-one
term (``AdaHOPConfig.fprop_mean_bias``, ``adahop.mean_bias``): its numerics against the formula,
the backward it leaves unchanged, the numerics key, and the refusals."""

from __future__ import annotations

import math

import pytest
import torch
from emulated_hopper import EmulatedHopper
from probe_layer import fwd_bwd, probe_layer

from adahop import AdaHOPConfig
from adahop.formats.mxfp4 import fake_quantize_mxfp4
from adahop.layer.plan import layer_plan, numerics_key
from adahop.mean_bias import add_mean_term, split_mean
from adahop.transforms.hadamard import block_hadamard


def data(T=64, K=64, N=48, seed=0, offset=3.0):
    """x with a large mean over tokens (``offset`` times a random direction), as activations have."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, K, generator=gen) + offset * torch.randn(1, K, generator=gen)
    w = torch.randn(N, K, generator=gen) / math.sqrt(K)
    g = torch.randn(T, N, generator=gen)
    return x, w, g


def quantized(v, iht):
    return fake_quantize_mxfp4(block_hadamard(v, dim=-1) if iht else v, dim=-1)


@pytest.mark.parametrize("recipe", ["mxfp4", "mxfp4_iht"])
def test_forward_is_the_formula(recipe):
    """y = Q(x - mu) Q(W)^T + mu W^T, Q the recipe's fprop quantization (in the Hadamard's basis
    for IHT, where the basis cancels in the product)."""
    x, w, _ = data()
    iht = recipe == "mxfp4_iht"
    with torch.no_grad():
        y = probe_layer(recipe, w, fprop_mean_bias=True)(x)
    mu = x.mean(0, keepdim=True)
    want = quantized(x - mu, iht) @ quantized(w, iht).t() + mu @ w.t()
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    # ... which is not the plain forward, and is closer to x W^T than it on data with a mean
    plain = quantized(x, iht) @ quantized(w, iht).t()
    exact = x.double() @ w.double().t()
    assert (y.double() - exact).norm() < 0.8 * (plain.double() - exact).norm()


def test_split_mean_numerics():
    x = torch.randn(16, 8, dtype=torch.bfloat16)
    mu, r = split_mean(x)
    assert mu.dtype == r.dtype == torch.bfloat16 and mu.shape == (1, 8)
    assert torch.equal(mu, x.float().mean(0, keepdim=True).bfloat16())
    assert torch.equal(r, x - mu)
    w = torch.randn(4, 8)  # a float32 master weight: cast to mu's dtype for the GEMV
    y = torch.zeros(16, 4, dtype=torch.bfloat16)
    assert torch.equal(add_mean_term(y, mu, w), (mu @ w.bfloat16().t()).expand(16, 4))


def test_oe_rows_and_columns_stay_exact():
    """Under OE the high-precision slices are r's, and the mean's term completes them to x W^T."""
    x, w, _ = data(T=64, K=64, N=48, seed=3)
    exact = x @ w.t()
    for mode in ("iht+oe_left", "iht+oe_right"):
        lay = probe_layer("adahop_lv2", w, fprop_mean_bias=True)
        lay.set_modes({"fprop": mode, "dgrad": "bf16", "wgrad": "bf16"})
        with torch.no_grad():
            y = lay(x)
        close = torch.isclose(y, exact, rtol=1e-4, atol=1e-4)
        exact_slices = close.all(1).sum() if mode == "iht+oe_left" else close.all(0).sum()
        assert exact_slices == lay.config.fprop.oe_k == 8


@pytest.mark.parametrize("recipe", ["mxfp4", "mxfp4_iht"])
def test_backward_is_unchanged(recipe):
    """dgrad and wgrad are the layer's GEMMs without the option, bit for bit (the same SR draws):
    the derivative of x W^T, which the split leaves as it is."""
    x, w, g = data(seed=1)
    y0, dx0, dw0 = fwd_bwd(probe_layer(recipe, w), x, g)
    y1, dx1, dw1 = fwd_bwd(probe_layer(recipe, w, fprop_mean_bias=True), x, g)
    assert not torch.equal(y0, y1)
    assert torch.equal(dx0, dx1) and torch.equal(dw0, dw1)


def test_bf16_autocast_forward():
    x, w, g = data(seed=2)
    lay = probe_layer("mxfp4_iht", w, fprop_mean_bias=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = lay(x)
    assert y.dtype == torch.bfloat16
    exact = x.double() @ w.double().t()
    assert (y.double() - exact).norm() < 0.2 * exact.norm()


def test_numerics_key_carries_the_option_only_when_on():
    modes = {"fprop": "iht", "dgrad": "iht", "wgrad": "iht"}
    off = AdaHOPConfig.from_recipe_name("mxfp4_iht")
    on = off.replace(fprop_mean_bias=True)
    key_off, key_on = numerics_key(off, modes, (None,) * 3), numerics_key(on, modes, (None,) * 3)
    assert "mean" not in key_off  # every existing layer's key (and compiled code) as before
    assert key_on != key_off
    assert layer_plan(key_on, torch.zeros(2, dtype=torch.int64), torch.device("cpu"), True).fprop_mean_bias
    assert not layer_plan(key_off, torch.zeros(2, dtype=torch.int64), torch.device("cpu"), True).fprop_mean_bias
    assert AdaHOPConfig.from_dict(on.to_dict()) == on


def test_refusals():
    with pytest.raises(ValueError, match="quantized_all_gather"):
        AdaHOPConfig.from_recipe_name("mxfp4", fprop_mean_bias=True, dgrad_weight="forward", quantized_all_gather=True)
    with pytest.raises(ValueError, match="runs fprop in BF16"):
        AdaHOPConfig.from_recipe_name("bf16", fprop_mean_bias=True)
    with pytest.raises(ValueError, match="must be a bool"):
        AdaHOPConfig.from_recipe_name("mxfp4", fprop_mean_bias=1)


@pytest.mark.parametrize("backend", ["triton", "hopper_fp8"])
def test_every_backend_runs_the_option(monkeypatch, backend):
    """The split is made above the backend, which quantizes r as any operand: on the Triton
    backends the output is the backend's own GEMM of r plus the mean's term, and the gradients
    are those without the option."""
    pytest.importorskip("triton")
    import adahop.layer.plan as plan
    from adahop.ops.backends.triton import TritonBackend

    impl = TritonBackend() if backend == "triton" else EmulatedHopper()
    monkeypatch.setattr(plan, "get_backend", lambda name, device: impl)
    x, w, g = data(T=32, K=64, N=32, seed=4)
    with torch.no_grad():
        y_on = probe_layer("mxfp4_iht", w, fprop_mean_bias=True)(x)
        mu, r = split_mean(x)
        y_r = probe_layer("mxfp4_iht", w)(r)  # the backend's GEMM of r, rounded as the option rounds it
    torch.testing.assert_close(y_on, add_mean_term(y_r, mu, w), rtol=0, atol=0)
    _, dx0, dw0 = fwd_bwd(probe_layer("mxfp4_iht", w), x, g)
    _, dx1, dw1 = fwd_bwd(probe_layer("mxfp4_iht", w, fprop_mean_bias=True), x, g)
    assert torch.equal(dx0, dx1) and torch.equal(dw0, dw1)


def test_layers_sharing_an_input_do_not_share_a_mean_split_one():
    """A layer with the option quantizes r, not x: it takes nothing quantized ahead (input_key None)."""
    from adahop.layer.grouped import input_key

    modes = {"fprop": "iht", "dgrad": "iht", "wgrad": "iht"}
    cfg = AdaHOPConfig.from_recipe_name("mxfp4_iht")
    assert input_key(numerics_key(cfg.replace(fprop_mean_bias=True), modes, (None,) * 3), False) is None
    assert input_key(numerics_key(cfg, modes, (None,) * 3), False) is not None
