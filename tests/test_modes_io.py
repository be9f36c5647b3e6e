"""adahop.save_modes / load_modes: the JSON of the calibrated modes, checked whole before any
layer changes."""

import json
import re

import pytest
import torch

import adahop

from tiny_lm import TinyLM


def converted():
    torch.manual_seed(0)
    model = TinyLM(d=64, layers=2, seq_len=32)
    adahop.convert_to_adahop_training(model, config=adahop.AdaHOPConfig.from_recipe_name("adahop_lv2"))
    return model


def modes_file(tmp_path, model):
    for layer in adahop.adahop_layers(model).values():
        layer.set_modes({"fprop": "iht", "dgrad": "iht+oe_left", "wgrad": "bf16"},
                        {"x": "col", "w": "none", "g": "row"})
    path = tmp_path / "modes.json"
    adahop.save_modes(model, path)
    return path


def test_round_trip(tmp_path):
    path = modes_file(tmp_path, converted())
    fresh = converted()
    adahop.load_modes(fresh, path)
    for layer in adahop.adahop_layers(fresh).values():
        assert layer.modes == {"fprop": "iht", "dgrad": "iht+oe_left", "wgrad": "bf16"}
        assert layer.patterns == {"x": "col", "w": "none", "g": "row"}


@pytest.mark.parametrize("damage, message", [
    (lambda e: e.update(wgrad="fp3"), "mode of wgrad must be one of"),
    (lambda e: e.update(wgrad="iht+oe_left"), "wgrad cannot use iht+oe_left"),
    (lambda e: e.pop("dgrad"), "modes must map exactly"),
    (lambda e: e.update(patterns={"x": "diagonal", "w": "none", "g": "row"}), "pattern of x must be one of"),
    (lambda e: e.update(patterns=["row", "col"]), "patterns must map exactly x, w and g"),
    (lambda e: e.update(extra=1), "unknown keys ['extra']"),
])
def test_a_bad_last_entry_changes_no_layer(tmp_path, damage, message):
    """Every entry is checked before any is applied: a bad last entry leaves all layers
    calibrating, and the model still prints."""
    data = json.loads(modes_file(tmp_path, converted()).read_text())
    damage(data[sorted(data)[-1]])
    (tmp_path / "bad.json").write_text(json.dumps(data))
    fresh = converted()
    with pytest.raises(ValueError, match=re.escape(message)):
        adahop.load_modes(fresh, tmp_path / "bad.json")
    assert all(layer.calibrating and layer.patterns is None for layer in adahop.adahop_layers(fresh).values())
    assert "calibrating" in repr(fresh)


def test_not_json_and_wrong_layers(tmp_path):
    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(ValueError, match="is not a modes JSON file"):
        adahop.load_modes(converted(), tmp_path / "x.json")
    (tmp_path / "y.json").write_text(json.dumps(["iht"]))
    with pytest.raises(ValueError, match="must be a JSON object"):
        adahop.load_modes(converted(), tmp_path / "y.json")
    data = json.loads(modes_file(tmp_path, converted()).read_text())
    data["blocks.9.up"] = data.pop(sorted(data)[0])
    (tmp_path / "z.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="unknown \\['blocks.9.up'\\]"):
        adahop.load_modes(converted(), tmp_path / "z.json")


def test_a_measured_policy_runs_modes_json_gives_back_its_oe_k(tmp_path):
    """adahop train's modes.json is save_modes' format: loaded into a fresh model of the run's
    config, every layer runs the trained one's GEMMs, the OE k its measured policy chose (8, the
    config's is 4) included."""
    import dataclasses

    from adahop.train.trainer import train

    from test_trainer import CountingBatches, config, tiny_model

    cfg = config(tmp_path, recipe="adahop_measured", steps=3, calibration_steps=2)
    cfg = dataclasses.replace(cfg, adahop=cfg.adahop.replace(hp_budget=0.25))
    trained = tiny_model()
    train(cfg, model=trained, train_batches=CountingBatches())
    layers = adahop.adahop_layers(trained)
    assert any(layer.oe_ks and 8 in layer.oe_ks.values() for layer in layers.values())
    path = tmp_path / "run" / "modes.json"
    assert json.loads(path.read_text()) == json.loads(json.dumps(adahop.modes_io.modes_dict(trained)))
    fresh = tiny_model()
    adahop.convert_to_adahop_training(fresh, config=cfg.adahop)
    adahop.load_modes(fresh, path)
    for fqn, layer in adahop.adahop_layers(fresh).items():
        old = layers[fqn]
        assert (layer.modes, layer.oe_ks, layer.patterns) == (old.modes, old.oe_ks, old.patterns)
        assert layer.numerics == old.numerics  # the same GEMMs, k included


def test_a_run_that_ends_calibrating_writes_no_modes_json(tmp_path):
    """A run shorter than its calibration has no modes to write (save_modes refuses a calibrating
    layer): no modes.json, rather than one of empty entries."""
    from adahop.train.trainer import train

    from test_trainer import CountingBatches, config, tiny_model

    summary = train(config(tmp_path, steps=2, calibration_steps=3), model=tiny_model(), train_batches=CountingBatches())
    assert summary["steps"] == 2 and (tmp_path / "run" / "summary.json").is_file()
    assert not (tmp_path / "run" / "modes.json").exists()
