"""Calibrated modes as JSON: ``{layer: {"fprop": mode, "dgrad": mode, "wgrad": mode,
"patterns": {"x": .., "w": .., "g": ..}}}`` (the "patterns" entry is optional on load).

The file is written atomically (a temporary file in the same folder, then ``os.replace``), so an
interrupted dump never leaves a half-written file behind.
"""

from __future__ import annotations

import json
import os

from torch import nn

from adahop.atomic_io import atomic_write_bytes
from adahop.convert import adahop_layers
from adahop.policy import GEMMS


def modes_dict(model: nn.Module) -> dict[str, dict]:
    out = {}
    for fqn, layer in adahop_layers(model).items():
        if layer.calibrating:
            raise ValueError(f"layer {fqn!r} is still calibrating; nothing to dump yet")
        entry = {g: layer.modes[g] for g in GEMMS}
        if layer.patterns is not None:
            entry["patterns"] = dict(layer.patterns)
        out[fqn] = entry
    return out


def save_modes(model: nn.Module, path: str | os.PathLike) -> None:
    atomic_write_bytes(path, (json.dumps(modes_dict(model), indent=2, sort_keys=True) + "\n").encode())


def load_modes_dict(model: nn.Module, modes: dict) -> None:
    layers = adahop_layers(model)
    missing = sorted(set(layers) - set(modes))
    unknown = sorted(set(modes) - set(layers))
    if missing or unknown:
        raise ValueError(f"modes do not match the model's converted layers: missing {missing}, unknown {unknown}")
    for fqn, entry in modes.items():
        layers[fqn].set_modes({g: entry[g] for g in GEMMS if g in entry}, entry.get("patterns"))


def load_modes(model: nn.Module, path: str | os.PathLike) -> None:
    """Freeze every converted layer of ``model`` to the modes in the JSON file ``path``."""
    with open(path) as f:
        load_modes_dict(model, json.load(f))
