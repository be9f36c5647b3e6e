"""Hugging Face ``transformers`` models: convert, train with their own loss, save and load.

A ``transformers`` causal LM (``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``MistralForCausalLM``,
...) is an ``nn.Module`` whose projections are ``nn.Linear``: ``convert_to_adahop_training``
converts it as it is (every linear but ``lm_head``), and ``model(input_ids, labels=...).loss``
trains it. Nothing here is needed for that. What is needed is saving: ``save_pretrained``
writes safetensors, which hold tensors only, while an AdaHOP layer's calibration, patterns and
modes are its extra state (plain Python data), so the model's own ``save_pretrained`` fails on
a converted model. This module's two functions write and read them beside the weights::

    from adahop.hf import from_pretrained, save_pretrained
    save_pretrained(model, "out/")                       # the HF files + adahop_config.json
                                                         # (+ adahop_modes.json once calibrated)
    model = from_pretrained(LlamaForCausalLM, "out/")    # converted, with the same modes

``install_save_pretrained(model)`` makes the model's own ``save_pretrained`` do the same, for
code that calls it (the ``transformers.Trainer``'s checkpoints: ``adahop.hf_trainer``).

Side files rather than the state dict: safetensors cannot hold the extra state, and the modes
file is ``modes_io``'s format (``adahop train`` writes its ``modes.json`` with ``save_modes``
too: modes, patterns and a measured policy's OE k), readable and loadable on its own with
``adahop.load_modes``. ``adahop_config.json`` holds the
``AdaHOPConfig`` and the names of the converted layers, so loading converts the same layers
with the same numerics. A model saved while still calibrating keeps its weights only: its votes
are not written, and the loaded model calibrates afresh (a warning says so).

Needs ``pip install "adahop[hf]"`` for the models; this module itself does not import
``transformers`` (the model class comes from the caller).
"""

from __future__ import annotations

import json
import os
import types
import warnings
from pathlib import Path

import torch
from torch import nn

from adahop.atomic_io import atomic_write_bytes
from adahop.config import AdaHOPConfig
from adahop.convert import adahop_layers, convert_to_adahop_training, is_calibrated
from adahop.modes_io import load_modes, save_modes

CONFIG_FILE = "adahop_config.json"
MODES_FILE = "adahop_modes.json"
FORMAT = "adahop-hf"
FORMAT_VERSION = 1


def tensor_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` without the AdaHOP layers' extra state (what safetensors holds)."""
    return {k: v for k, v in model.state_dict().items() if not k.endswith("._extra_state")}


def save_pretrained(model: nn.Module, save_directory: str | os.PathLike, **kwargs) -> Path:
    """``model.save_pretrained(save_directory, **kwargs)`` for a converted model: the weights as
    the model's own method writes them, plus ``adahop_config.json`` (the layers' config and
    names) and, when every layer is calibrated, ``adahop_modes.json``. Returns the folder."""
    if "state_dict" in kwargs:
        raise ValueError("save_pretrained writes the model's own state dict; do not pass state_dict")
    check_savable(model)
    out = Path(save_directory)
    type(model).save_pretrained(model, out, state_dict=tensor_state_dict(model), **kwargs)
    write_adahop_files(model, out)
    return out


def check_savable(model: nn.Module) -> AdaHOPConfig:
    """The one ``AdaHOPConfig`` of a converted ``transformers`` model's layers (what
    ``adahop_config.json`` holds); a ValueError for any other model."""
    layers = adahop_layers(model)
    if not layers:
        raise ValueError("the model holds no AdaHOPLinear: save it with its own save_pretrained")
    if not hasattr(model, "save_pretrained"):
        raise ValueError(f"{type(model).__name__} has no save_pretrained: not a transformers model")
    configs = {id(layer.config): layer.config for layer in layers.values()}
    if len(configs) != 1:
        raise ValueError("the model's AdaHOP layers have different configs; adahop_config.json holds one")
    (config,) = configs.values()
    return config


def write_adahop_files(model: nn.Module, out: str | os.PathLike) -> None:
    """Write ``adahop_config.json`` and, when every layer is calibrated, ``adahop_modes.json``
    into ``out`` (a folder the model's weights are written to)."""
    out = Path(out)
    config = check_savable(model)
    meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "adahop": config.to_dict(),
            "layers": sorted(adahop_layers(model))}
    atomic_write_bytes(out / CONFIG_FILE, (json.dumps(meta, indent=1) + "\n").encode())
    if is_calibrated(model):
        save_modes(model, out / MODES_FILE)
    else:
        (out / MODES_FILE).unlink(missing_ok=True)  # a previous save's modes would not be this model's
        warnings.warn("the model is still calibrating: only its weights are saved, and the loaded model "
                      "calibrates afresh", stacklevel=3)


def install_save_pretrained(model: nn.Module) -> nn.Module:
    """Make a converted model's own ``model.save_pretrained`` save as ``adahop.hf.save_pretrained``
    does (the weights without the layers' extra state, and the adahop files beside them), so that
    code that calls it, a ``transformers.Trainer`` saving a checkpoint or ``trainer.save_model``,
    keeps the modes instead of failing on the extra state. It is set on this model object only
    (an instance attribute; the class is left alone). ``state_dict``, if given (the Trainer passes
    one under some parallel setups), is saved without its extra state; the adahop files are
    written where ``is_main_process`` (default True) holds. Returns ``model``."""
    check_savable(model)
    if getattr(model.save_pretrained, "__func__", None) is _save_pretrained_with_modes:
        return model  # installed already

    model.save_pretrained = types.MethodType(_save_pretrained_with_modes, model)
    return model


def _save_pretrained_with_modes(model: nn.Module, save_directory, *args, state_dict=None, **kwargs):
    state_dict = tensor_state_dict(model) if state_dict is None else {
        k: v for k, v in state_dict.items() if not k.endswith("._extra_state")}
    result = type(model).save_pretrained(model, save_directory, *args, state_dict=state_dict, **kwargs)
    if kwargs.get("is_main_process", True):
        write_adahop_files(model, save_directory)
    return result


def read_adahop_config(path: str | os.PathLike) -> tuple[AdaHOPConfig, list[str]] | None:
    """The ``AdaHOPConfig`` and converted layer names ``save_pretrained`` wrote in ``path``
    (None for a folder without ``adahop_config.json``)."""
    file = Path(path) / CONFIG_FILE
    if not file.is_file():
        return None
    try:
        meta = json.loads(file.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{file} is not valid JSON: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{file} is not an adahop config of format {FORMAT} version {FORMAT_VERSION}")
    return AdaHOPConfig.from_dict(meta["adahop"]), list(meta["layers"])


def from_pretrained(model_cls, path: str | os.PathLike, *, config: AdaHOPConfig | None = None, **kwargs):
    """``model_cls.from_pretrained(path, **kwargs)``, converted: with the saved
    ``AdaHOPConfig`` and layers (or ``config``, converting the default layers, for a plain HF
    folder or to change the numerics), and frozen to the saved modes where there are some and
    the recipe is the saved one."""
    path = Path(path)
    saved = read_adahop_config(path)
    if config is None and saved is None:
        raise ValueError(f"{path} has no {CONFIG_FILE} (not written by adahop.hf.save_pretrained): "
                         "pass config=AdaHOPConfig.from_recipe_name(...) to convert a plain model")
    model = model_cls.from_pretrained(path, **kwargs)
    if config is None:
        config, names = saved
        wanted = set(names)
        convert_to_adahop_training(model, config=config, module_filter_fn=lambda mod, fqn: fqn in wanted)
        missing = sorted(wanted - set(adahop_layers(model)))
        if missing:
            raise ValueError(f"{path}: the saved layers {missing[:3]}{'...' if len(missing) > 3 else ''} "
                             f"are not linear layers of {type(model).__name__}")
    else:
        convert_to_adahop_training(model, config=config)
    if (path / MODES_FILE).is_file():
        if saved is not None and saved[0].recipe != config.recipe:
            warnings.warn(f"{path}: the saved modes are of recipe {saved[0].recipe!r}, the model runs "
                          f"{config.recipe!r}; they are not loaded", stacklevel=2)
        else:
            load_modes(model, path / MODES_FILE)
    return model
