"""Calibrated modes as JSON: ``{layer: {"fprop": mode, "dgrad": mode, "wgrad": mode,
"patterns": {"x": .., "w": .., "g": ..}, "oe_k": {gemm: k}}}`` ("patterns" is optional on load;
"oe_k" is there for a layer whose policy chose its own OE k per GEMM).

The file is written atomically (a temporary file in the same folder, then ``os.replace``), so an
interrupted dump never leaves a half-written file behind.
"""

from __future__ import annotations

import json
import os

from torch import nn

from adahop.atomic_io import atomic_write_bytes
from adahop.convert import adahop_layers
from adahop.patterns.detect import check_patterns
from adahop.policy import GEMMS, policy_result


def modes_dict(model: nn.Module) -> dict[str, dict]:
    out = {}
    for fqn, layer in adahop_layers(model).items():
        if layer.calibrating:
            raise ValueError(f"layer {fqn!r} is still calibrating; nothing to dump yet")
        entry = {g: layer.modes[g] for g in GEMMS}
        if layer.patterns is not None:
            entry["patterns"] = dict(layer.patterns)
        if layer.oe_ks is not None:
            entry["oe_k"] = dict(layer.oe_ks)
        out[fqn] = entry
    return out


def save_modes(model: nn.Module, path: str | os.PathLike) -> None:
    atomic_write_bytes(path, (json.dumps(modes_dict(model), indent=2, sort_keys=True) + "\n").encode())


def load_modes_dict(model: nn.Module, modes: dict) -> None:
    """Freeze every converted layer of ``model`` to ``modes``. Every entry is checked before any
    layer changes, so a bad entry leaves the model as it was."""
    if not isinstance(modes, dict):
        raise ValueError(f"modes must be a JSON object {{layer: {{fprop, dgrad, wgrad[, patterns]}}}}, "
                         f"got {type(modes).__name__}")
    layers = adahop_layers(model)
    missing = sorted(set(layers) - set(modes))
    unknown = sorted(set(modes) - set(layers))
    if missing or unknown:
        raise ValueError(f"modes do not match the model's converted layers: missing {missing}, unknown {unknown}")
    checked = {}
    for fqn, entry in modes.items():
        if not isinstance(entry, dict):
            raise ValueError(f"modes of layer {fqn!r} must be an object {{fprop, dgrad, wgrad[, patterns]}}, "
                             f"got {entry!r}")
        extra = sorted(set(entry) - set(GEMMS) - {"patterns", "oe_k"})
        if extra:
            raise ValueError(f"layer {fqn!r}: unknown keys {extra}; allowed: {list(GEMMS) + ['patterns', 'oe_k']}")
        try:
            gemm_modes, oe_ks = policy_result({**{g: entry[g] for g in GEMMS if g in entry},
                                               **({"oe_k": entry["oe_k"]} if entry.get("oe_k") else {})})
            patterns = check_patterns(entry["patterns"]) if entry.get("patterns") is not None else None
        except ValueError as e:
            raise ValueError(f"layer {fqn!r}: {e}") from None
        checked[fqn] = (gemm_modes, patterns, oe_ks)
    for fqn, (gemm_modes, patterns, oe_ks) in checked.items():
        layers[fqn].set_modes(gemm_modes, patterns, oe_ks=oe_ks or None)


def load_modes(model: nn.Module, path: str | os.PathLike) -> None:
    """Freeze every converted layer of ``model`` to the modes in the JSON file ``path``."""
    try:
        with open(path) as f:
            modes = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not a modes JSON file: {e}") from None
    load_modes_dict(model, modes)
