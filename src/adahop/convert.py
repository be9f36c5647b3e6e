"""``convert_to_adahop_training``: swap a model's ``nn.Linear`` modules for ``AdaHOPLinear``.

The swapped modules share the original parameters (nothing is copied; optimizers built before or
after the swap see the same tensors; but with ``AdaHOPConfig.quantized_all_gather``, whose weights
become new parameters for FSDP2). By default every ``nn.Linear`` is converted except the LM
head (the LM head, embeddings, norms and attention's own matmuls stay in high precision: see
docs/method.md, 'The three GEMMs of a linear layer'). The LM head is recognised as a Linear whose
weight is tied to an ``nn.Embedding`` or whose name ends in ``lm_head``, ``output`` or ``head``;
pass ``module_filter_fn`` to decide yourself.

The size rule. Converting a layer costs the quantization of X [T, K], W [N, K] and G [T, N]
(memory-bound: work in T*K + N*K + T*N) and saves part of the three GEMMs' time (compute-bound:
work in T*N*K). The saving over the cost goes as 1 / (1/N + 1/K + 1/T): for the tokens of a
training step (T in the tens of thousands) it is set by the harmonic mean of the two dims,
``layer_size`` = 2 N K / (N + K) (a square layer's width; between the smaller dim and twice
it). So a layer is left in BF16 when its ``layer_size`` is below ``min_features``, the torchao
float8 filter's idea (it leaves small layers in BF16 where float8 is slower) in one number. The
smaller dim alone would not order the measured shapes: (2048, 8192) pays and (2048, 2048) does
not. ``size_filter(min_features)`` is the rule alone; ``default_module_filter(model,
min_features=...)`` is it with the LM-head rule. benchmarks/bench_linear.py's section ``sizes``
measures, per (out_features, in_features), whether an AdaHOPLinear forward + backward is faster
than BF16's: ``HOPPER_MIN_FEATURES`` is the threshold it measured on the H200 and the H100, for
the tokens per step it was measured at. ``MIN_FEATURES``, the default, is 0 (every layer but the
LM head): the rule is a speed setting to ask for, not a default, because at the measured
threshold every layer of the 125M model and the attention of models up to 1B parameters (and
Llama-8B's K and V projections) would stay BF16, and a recipe asked for would silently train
little or nothing in MXFP4 (torchao's and torchtitan's small-layer filters are opt-in for the
same reason). ``bf16_linears(model)`` lists, after the conversion, the ``nn.Linear`` layers left
in BF16 and why.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections import Counter
from collections.abc import Callable

import torch
from torch import nn

from adahop.calibration_group import CalibrationGroup
from adahop.config import AdaHOPConfig
from adahop.linear import AdaHOPLinear

LM_HEAD_NAMES = ("lm_head", "output", "head")
# The smallest layer_size converted by default; 0 converts every size.
MIN_FEATURES = 0
# Where MXFP4 pays on Hopper: a layer_size from which an AdaHOPLinear forward + backward
# (hopper_fp8) beats BF16 nn.Linear in every shape measured, on an H200 and an H100 at 32,768
# tokens per step, eager and replayed from a CUDA graph alike. Every shape from layer_size 3277
# ((2048, 8192), (8192, 2048): 1.02-1.12x) up pays; those at 2731 ((2048, 4096), (4096, 2048))
# run at 0.79-1.04x and stay BF16; none below is faster than BF16, most are 2-10x slower
# (benchmarks/results/layer_sizes_h200_2026-12-06, layer_sizes_h100_2026-12-06). More tokens
# per step lower it.
HOPPER_MIN_FEATURES = 3072


def layer_size(in_features: int, out_features: int) -> float:
    """The size the rule compares with ``min_features``: the harmonic mean of the two dims,
    2 * in * out / (in + out) (see the module doc)."""
    return 2 * in_features * out_features / (in_features + out_features)


def _below(mod: nn.Module, min_features: int) -> bool:
    """``layer_size(mod) < min_features``, in integers."""
    return 2 * mod.in_features * mod.out_features < min_features * (mod.in_features + mod.out_features)


def check_min_features(min_features) -> int:
    """``min_features``: an int >= 0 (a bool is refused: it is an int to Python, not a size)."""
    if isinstance(min_features, bool) or not isinstance(min_features, int) or min_features < 0:
        raise ValueError(f"min_features must be an int >= 0 (0 converts every size), got {min_features!r}")
    return min_features


def size_filter(min_features: int) -> Callable[[nn.Module, str], bool]:
    """The size rule alone as a ``module_filter_fn``: accept a Linear whose ``layer_size``
    (the harmonic mean of in_features and out_features) is at least ``min_features`` (see the
    module doc)."""
    check_min_features(min_features)

    def keep(mod: nn.Module, fqn: str) -> bool:
        return not _below(mod, min_features)

    return keep


def _bf16_reason(mod: nn.Module, fqn: str, embedding_weights: set[int], min_features: int) -> str | None:
    """Why the default filter leaves ``mod`` in BF16, or None when it converts it."""
    if fqn.rsplit(".", 1)[-1] in LM_HEAD_NAMES:
        return f"LM head (name ends in {fqn.rsplit('.', 1)[-1]!r})"
    if id(mod.weight) in embedding_weights:
        return "LM head (weight tied to an nn.Embedding)"
    if _below(mod, min_features):
        # (rounded down: a size just below the threshold never reads as equal to it)
        size = math.floor(10 * layer_size(mod.in_features, mod.out_features)) / 10
        return (f"size: layer_size({mod.in_features}, {mod.out_features}) = {size:g} < min_features = "
                f"{min_features}")
    return None


def is_plain_linear(mod: nn.Module) -> bool:
    """True for a layer ``convert_to_adahop_training`` can convert: an ``nn.Linear``, or a subclass
    of it that keeps ``nn.Linear``'s forward (x @ W.T + b on its ``weight`` [out, in]; e.g. torch's
    ``NonDynamicallyQuantizableLinear``). A subclass with its own forward computes something else
    with the same parameters (an AdaHOPLinear in its place would change the model), and an
    AdaHOPLinear is converted already."""
    return (isinstance(mod, nn.Linear) and not isinstance(mod, AdaHOPLinear)
            and type(mod).forward is nn.Linear.forward)


def _linear_like(model: nn.Module) -> str:
    """What in ``model`` looks like a linear layer but is not convertible, by type with counts
    (for the warning of a conversion that converted nothing): nn.Linear subclasses with their own
    forward, and other modules holding a 2-D ``weight`` that are not embeddings (GPT-2's
    ``Conv1D``, which keeps its weight as [in, out] and is no nn.Linear)."""
    found = Counter(type(m).__qualname__ for m in model.modules()
                    if not is_plain_linear(m) and not isinstance(m, (AdaHOPLinear, nn.Embedding))
                    and isinstance(getattr(m, "weight", None), torch.Tensor) and m.weight.dim() == 2)
    return ", ".join(f"{n} {name}" for name, n in found.most_common()) or "none"


def _warn_nothing_converted(model: nn.Module, refused: int) -> None:
    """A conversion that left the model without one AdaHOPLinear would train it in full
    precision while the caller believes it MXFP4: said, not refused (a filter may mean it)."""
    why = (f"the module_filter_fn refused all {refused} convertible nn.Linear layers" if refused
           else "the model has no nn.Linear with nn.Linear's forward")
    warnings.warn(f"convert_to_adahop_training converted no layer: {why}; other layers with a 2-D weight, not "
                  f"converted: {_linear_like(model)} (a layer of another class, e.g. GPT-2's Conv1D, which keeps "
                  "its weight as [in, out], must be replaced by an nn.Linear first); the model stays in full "
                  "precision", stacklevel=3)


def _embedding_weights(model: nn.Module) -> set[int]:
    return {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}


def default_module_filter(model: nn.Module, *, min_features: int = MIN_FEATURES) -> Callable[[nn.Module, str], bool]:
    """Convert every nn.Linear but the LM head and those whose ``layer_size`` (the harmonic mean
    of in_features and out_features) is below ``min_features`` (default ``MIN_FEATURES``; see
    the module doc)."""
    check_min_features(min_features)
    embedding_weights = _embedding_weights(model)

    def keep(mod: nn.Module, fqn: str) -> bool:
        return _bf16_reason(mod, fqn, embedding_weights, min_features) is None

    return keep


def bf16_linears(model: nn.Module, *, min_features: int = MIN_FEATURES) -> dict[str, str]:
    """The ``nn.Linear`` layers of a converted ``model`` left in BF16, by qualified name, each
    with why: the LM-head rule, the size rule at ``min_features`` (pass the value the conversion
    used), or, for a layer both rules accept, the ``module_filter_fn`` the conversion was given.
    (Before the conversion every Linear is listed.)"""
    check_min_features(min_features)
    embedding_weights = _embedding_weights(model)
    return {fqn: _bf16_reason(mod, fqn, embedding_weights, min_features) or "refused by the module_filter_fn given"
            for fqn, mod in model.named_modules() if is_plain_linear(mod)}


def convert_to_adahop_training(
    model: nn.Module,
    *,
    config: AdaHOPConfig,
    module_filter_fn: Callable[[nn.Module, str], bool] | None = None,
) -> nn.Module:
    """Replace, in place, each ``nn.Linear`` of ``model`` accepted by ``module_filter_fn(module,
    fqn)`` with an ``AdaHOPLinear`` sharing its parameters. Returns ``model``.

    Converted are ``nn.Linear`` and its subclasses that keep its forward (``is_plain_linear``),
    except the projection of an ``nn.MultiheadAttention``, which reads its weight and never
    calls it. A model that is itself an ``nn.Linear`` is converted and returned (it cannot be
    swapped in place). Already-converted layers are left alone. When the model ends up with no
    AdaHOPLinear at all, a UserWarning says why (no convertible layer, naming the 2-D-weight
    layers found, e.g. GPT-2's ``Conv1D``; or the filter refused them all). With
    ``config.quantized_all_gather`` the converted weights become new parameters
    (``adahop.quantized_all_gather.install``, for FSDP2): build the optimizer after."""
    if not isinstance(config, AdaHOPConfig):
        raise ValueError(f"config must be an AdaHOPConfig (see AdaHOPConfig.from_recipe_name), "
                         f"got {type(config).__name__}")
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be an nn.Module, got {type(model).__name__}")
    keep = module_filter_fn or default_module_filter(model)

    if is_plain_linear(model):
        if keep(model, ""):
            model = AdaHOPLinear.from_float(model, config=config, name="")
            converted = {"": model}
        else:
            _warn_nothing_converted(model, refused=1)
            return model
    else:
        converted = {}
        refused = 0
        for fqn, mod in list(model.named_modules()):
            if isinstance(mod, nn.MultiheadAttention):  # its out_proj's forward is never called
                continue
            for child_name, child in list(mod.named_children()):
                child_fqn = f"{fqn}.{child_name}" if fqn else child_name
                if not is_plain_linear(child):
                    continue
                if keep(child, child_fqn):
                    converted[child_fqn] = AdaHOPLinear.from_float(child, config=config, name=child_fqn)
                    setattr(mod, child_name, converted[child_fqn])
                else:
                    refused += 1
        if not adahop_layers(model) and not isinstance(model, AdaHOPLinear):
            _warn_nothing_converted(model, refused)
    if config.adaptive and config.model_policy is not None:  # they freeze together (calibration_group)
        CalibrationGroup(converted.values())
    if config.quantized_all_gather:  # (imported here: torch.distributed's FSDP2, for this option only)
        from adahop.quantized_all_gather import install

        install(model, layers=converted)
    return model


def adahop_layers(model: nn.Module) -> dict[str, AdaHOPLinear]:
    """The converted layers of ``model`` by qualified name."""
    return {fqn: m for fqn, m in model.named_modules() if isinstance(m, AdaHOPLinear)}


def is_calibrated(model: nn.Module) -> bool:
    """True when every converted layer has frozen modes."""
    return all(not m.calibrating for m in adahop_layers(model).values())


@contextlib.contextmanager
def calibration_parts(model: nn.Module, parts: int):
    """While active, each converted layer of ``model`` takes ``parts`` consecutive training calls
    (forward and backward each) as the parts of one micro-batch, split along its rows, and makes
    them one calibration observation (``patterns.calibration.observe_parts``): the same labels
    and statistics as one call on the whole micro-batch, to float rounding. What the trainer's
    ``calibration_micro_batches`` runs its calibration steps in. Every split micro-batch must be
    run whole inside; parts left over when it ends (an interrupted step) are dropped."""
    if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1:
        raise ValueError(f"parts must be an int >= 1, got {parts!r}")
    layers = list(adahop_layers(model).values())
    for layer in layers:
        layer.calibration_parts = parts
    try:
        yield
    finally:
        for layer in layers:
            layer.calibration_parts = 1
            for pending in layer._parts.values():
                pending.clear()


def finish_calibration(model: nn.Module) -> dict[str, dict]:
    """Freeze every still-calibrating adaptive layer now (from the steps seen so far); returns
    their modes. (A layer under a policy over the whole model freezes its group with it.)"""
    calibrating = {fqn: m for fqn, m in adahop_layers(model).items() if m.calibrating}
    for m in calibrating.values():
        if m.calibrating:
            m.finish_calibration()
    return {fqn: dict(m.modes) for fqn, m in calibrating.items()}
