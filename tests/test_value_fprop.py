"""``AdaHOPConfig.value_fprop``: the forward GEMM's mode in attention's value projections, in
place of the policy's (adaptive recipes) or the recipe's (fixed ones); every other GEMM and layer
as without it; the numerics of the mode it names; `adahop train --value-fprop`."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from test_precision import llama

import adahop
from adahop.config import is_value_projection

from test_trainer import CountingBatches, config


def test_value_projections_by_name():
    assert is_value_projection("layers.3.attention.wv") and is_value_projection("model.layers.0.self_attn.v_proj")
    assert is_value_projection("wv")
    assert not any(is_value_projection(n) for n in ("layers.0.attention.wq", "layers.0.attention.wk",
                                                     "layers.0.attention.wo", "layers.0.feed_forward.w1", "wv_gate"))


def test_config_checks_and_round_trip():
    cfg = adahop.AdaHOPConfig.from_recipe_name("adahop_measured", value_fprop="mxfp4")
    assert adahop.AdaHOPConfig.from_dict(cfg.to_dict()).value_fprop == "mxfp4"
    assert adahop.AdaHOPConfig.from_recipe_name("adahop_lv2").value_fprop is None  # the default: the policy's
    with pytest.raises(ValueError, match=r"^value_fprop must be one of") as e:
        adahop.AdaHOPConfig.from_recipe_name("adahop_lv2", value_fprop="fp8")
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="runs every GEMM in BF16"):
        adahop.AdaHOPConfig.from_recipe_name("bf16", value_fprop="mxfp4")


def test_layer_modes_only_touch_a_value_projections_forward():
    cfg = adahop.AdaHOPConfig.from_recipe_name("adahop_measured", value_fprop="mxfp4")
    modes = {"fprop": "iht+oe_right", "dgrad": "iht+oe_left", "wgrad": "iht"}
    assert cfg.layer_modes("layers.0.attention.wv", modes, {"fprop": 16, "dgrad": 8}) == (
        {"fprop": "mxfp4", "dgrad": "iht+oe_left", "wgrad": "iht"}, {"dgrad": 8})
    assert cfg.layer_modes("layers.0.attention.wv", modes, {"fprop": 16}) == (
        {"fprop": "mxfp4", "dgrad": "iht+oe_left", "wgrad": "iht"}, None)
    assert cfg.layer_modes("layers.0.attention.wk", modes, {"fprop": 16}) == (modes, {"fprop": 16})
    assert cfg.replace(value_fprop=None).layer_modes("layers.0.attention.wv", modes) == (modes, None)


def calibrated(recipe, value_fprop, steps=2):
    """A tiny Llama converted to ``recipe`` and trained through its calibration (same seed and
    data every time)."""
    model = llama(n_layers=2)
    cfg = adahop.AdaHOPConfig.from_recipe_name(recipe, calibration_steps=steps, backend="reference",
                                               value_fprop=value_fprop).with_gemm_settings(oe_k=4)
    adahop.convert_to_adahop_training(model, config=cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _, (inputs, targets) in zip(range(steps), CountingBatches()):
        loss = torch.nn.functional.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
    return model


@pytest.mark.parametrize("recipe", ["adahop_lv2", "adahop_measured", "mxfp4_iht"])
def test_the_value_projections_forward_runs_the_mode_and_nothing_else_moves(recipe):
    plain = adahop.adahop_layers(calibrated(recipe, None))
    model = calibrated(recipe, "mxfp4")
    layers = adahop.adahop_layers(model)
    assert set(layers) == set(plain) and sum(is_value_projection(n) for n in layers) == 2
    for name, layer in layers.items():
        assert not layer.calibrating
        if is_value_projection(name):
            assert layer.modes == {**plain[name].modes, "fprop": "mxfp4"}, name
            assert "fprop" not in (layer.oe_ks or {})
        else:
            assert layer.modes == plain[name].modes and layer.oe_ks == plain[name].oe_ks, name
    # the forward of a value projection is naive MXFP4's, to the bit
    wv = model.layers[0].attention.wv
    naive = adahop.AdaHOPLinear.from_float(torch.nn.Linear(wv.in_features, wv.out_features, bias=False),
                                           config=adahop.AdaHOPConfig.from_recipe_name("mxfp4", backend="reference"))
    naive.weight = wv.weight
    x = torch.randn(3, 5, wv.in_features, generator=torch.Generator().manual_seed(2))
    model.eval()
    naive.eval()
    with torch.no_grad():
        assert torch.equal(wv(x), naive(x))


def test_drift_keeps_the_rule():
    """Re-deciding the modes on new batches (``measure_drift``) applies the rule as the freeze
    does: the value projections' forward is never reported as drifted, nor undone."""
    from adahop.drift import measure_drift

    model = calibrated("adahop_lv2", "mxfp4")
    batches = [next(CountingBatches(seed=s)) for s in (5, 6)]
    result = measure_drift(model, batches, apply=True)
    assert not any("fprop" in entry.get("modes", {}) for name, entry in result["changed"].items()
                   if is_value_projection(name))
    assert all(layer.modes["fprop"] == "mxfp4" for name, layer in adahop.adahop_layers(model).items()
               if is_value_projection(name))


def test_a_tiny_model_trains_with_it_and_the_cli_records_it(tmp_path, capsys):
    from adahop import cli
    from adahop.data import corpus as D
    from adahop.data import sources as S
    from adahop.train.trainer import train

    cfg = config(tmp_path, steps=16, calibration_steps=2, recipe="adahop_lv2")
    cfg = dataclasses.replace(cfg, adahop=cfg.adahop.replace(value_fprop="mxfp4"))
    losses = train(cfg, model=llama(n_layers=2), train_batches=CountingBatches())["losses"]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5

    corpus = tmp_path / "corpus"
    D.build_corpus(corpus, sources=[S.cpython_stdlib_source(modules=("json", "textwrap"), name="mini")],
                   tokenizer="byte", progress=False)
    run = tmp_path / "run_cli"
    args = ["train", "--preset", "debug", "--recipe", "adahop_measured", "--corpus", str(corpus), "--steps", "3",
            "--seq-len", "32", "--calibration-steps", "2", "--no-progress"]
    assert cli.main([*args, "--out", str(run), "--value-fprop", "mxfp4"]) == 0
    assert json.loads((run / "config.json").read_text())["adahop"]["value_fprop"] == "mxfp4"
    modes = json.loads((run / "modes.json").read_text())
    assert all(m["fprop"] == "mxfp4" for n, m in modes.items() if is_value_projection(n)) and len(modes) > 2
    with pytest.raises(SystemExit) as e:
        cli.main([*args, "--out", str(tmp_path / "bad"), "--value-fprop", "fp8"])
    assert e.value.code == 2 and "--value-fprop: invalid choice: 'fp8'" in capsys.readouterr().err
