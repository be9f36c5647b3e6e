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
