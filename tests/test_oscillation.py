"""Weight-oscillation dampening (adahop/oscillation.py)."""

import dataclasses

import pytest
import torch
from test_precision import llama

import adahop
from adahop.layer.gemms import forward_weight
from adahop.oscillation import add_dampening_grad, check_dampening
from adahop.train.trainer import train

from test_trainer import CountingBatches, config


def model_with(recipe, modes=None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Linear(96, 64))
    adahop.convert_to_adahop_training(model, config=adahop.AdaHOPConfig.from_recipe_name(recipe, backend="reference"))
    for layer in adahop.adahop_layers(model).values():
        if modes:
            layer.set_modes(modes)
        layer.weight.grad = torch.randn_like(layer.weight)
    return model


def test_the_term_is_twice_lambda_times_the_distance_to_the_forward_weight():
    model = model_with("mxfp4_iht")
    layers = list(adahop.adahop_layers(model).values())
    before = [layer.weight.grad.clone() for layer in layers]
    assert add_dampening_grad(model, 0.05, torch.float32) == 2
    for layer, g in zip(layers, before):
        q = forward_weight(layer.weight, layer._plan(torch.device("cpu")), torch.float32)
        assert torch.allclose(layer.weight.grad, g + 0.1 * (layer.weight - q), atol=1e-7)
        assert not torch.equal(layer.weight.grad, g)


def test_no_term_for_a_bf16_forward_a_calibrating_layer_or_lambda_zero():
    model = model_with("mxfp4_iht", modes={"fprop": "bf16", "dgrad": "iht", "wgrad": "iht"})
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    assert add_dampening_grad(model, 0.05, torch.float32) == 0
    calibrating = model_with("adahop_lv2")  # not calibrated yet
    assert add_dampening_grad(calibrating, 0.05, torch.float32) == 0
    assert add_dampening_grad(model_with("mxfp4"), 0.0, torch.float32) == 0
    assert all(torch.equal(a, p.grad) for a, p in zip(grads, [p for p in model.parameters() if p.grad is not None]))


def distance_to_grid(model):
    total = 0.0
    for layer in adahop.adahop_layers(model).values():
        q = forward_weight(layer.weight, layer._plan(torch.device("cpu")), torch.float32)
        total += float((layer.weight.detach() - q).pow(2).sum())
    return total


def test_a_tiny_model_trains_with_dampening_and_its_weights_sit_closer_to_the_grid(tmp_path):
    plain_model, damped_model = llama(n_layers=2), llama(n_layers=2)
    cfg = config(tmp_path / "plain", steps=16, recipe="mxfp4_iht")
    plain = train(cfg, model=plain_model, train_batches=CountingBatches())
    damped = train(dataclasses.replace(cfg, out_dir=str(tmp_path / "damped"), oscillation_dampening=50.0),
                   model=damped_model, train_batches=CountingBatches())
    losses = damped["losses"]
    assert all(torch.isfinite(torch.tensor(losses))) and sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5
    assert losses != plain["losses"]
    assert distance_to_grid(damped_model) < 0.8 * distance_to_grid(plain_model)


def test_bad_dampening_values_are_refused(tmp_path):
    for bad in (-1.0, float("nan"), float("inf"), True, "0.1"):
        with pytest.raises(ValueError, match="oscillation_dampening must be a finite number >= 0"):
            check_dampening(bad)
        with pytest.raises(ValueError, match="oscillation_dampening must be a finite number >= 0"):
            add_dampening_grad(model_with("mxfp4"), bad)  # (a loop's own call is checked too)
    cfg = dataclasses.replace(config(tmp_path), oscillation_dampening=0.1, parallel="fsdp2")
    with pytest.raises(ValueError, match="not with --parallel fsdp2"):
        cfg.validate()
