"""Drift of a calibrated model: re-measure every converted layer's patterns (and the policy's
statistics) on a few batches and compare them, and the modes the policy would pick from them,
with the frozen ones (docs/analyze.md, 'Drift during training').

The paper calibrates once and assumes the patterns stay; ``measure_drift`` checks it during
training. For each batch, one forward + backward of the converted model as it trains (its frozen
modes, training mode): a forward hook on every calibrated ``AdaHOPLinear`` keeps x (leading dims
flattened into tokens) and w, and a hook on its output keeps g; each is observed exactly as
calibration does (``observe_tensor`` with the layer's tau and OE k), into a fresh
``LayerCalibration``. Then each layer's voted patterns and the modes its own policy
(``AdaHOPConfig.policy_fn``, else the table at ``config.policy``) picks from that summary are set
against the layer's. The training state is left as it was: the parameters' ``.grad`` and each
layer's call counter (the stochastic-rounding sequence) are restored, and modes change only with
``apply=True`` (then the layer is frozen to the new modes and patterns, as ``set_modes`` does).
The GEMMs a precision schedule's BF16 phase switched (``layer.scheduled_bf16``, while they run
BF16) are the schedule's, not the policy's: not compared, and kept BF16 by ``apply``.

It is library, beside ``convert`` (it acts on a converted model), not part of the outlier study in
``analyze``: the trainer's ``drift`` option calls it, and ``train`` sits below ``analyze``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from adahop.convert import adahop_layers
from adahop.patterns.calibration import TENSOR_ROLES, LayerCalibration, observe_tensor
from adahop.policy import GEMMS, policy_result, table_policy

PROFILE_DIMS = {"x": (1,), "w": (1, 0), "g": (1,)}  # as the study (analyze.study.PROFILE_DIMS)


def lm_loss(model: nn.Module, batch) -> torch.Tensor:
    """The default loss: ``batch = (inputs, targets)``, mean cross-entropy of the model's logits
    (an output with a ``.logits`` attribute, as Hugging Face models return, works too)."""
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise ValueError(f"a batch must be (inputs, targets) for the default loss, got {type(batch).__name__}; "
                         "pass loss_fn(model, batch) -> scalar for other batches")
    inputs, targets = batch
    out = model(inputs)
    logits = getattr(out, "logits", out)
    if not isinstance(logits, torch.Tensor) or logits.shape[:-1] != targets.shape:
        raise ValueError(f"the model's output {tuple(getattr(logits, 'shape', ()))} does not match targets "
                         f"{tuple(targets.shape)} + [vocab]; pass loss_fn(model, batch)")
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def layer_policy(layer) -> Callable:
    """The policy a layer froze its modes with: its config's ``policy_fn``, else the table. A
    policy over the whole model (loss_aware) decides here for the layer alone, with its budget
    over the layer's own FLOPs: a re-measured layer is not compared with the others'."""
    cfg = layer.config
    if cfg.model_policy is not None:
        return lambda s: cfg.model_policy({0: s})[0]
    return cfg.policy_fn if cfg.policy_fn is not None else (lambda s: table_policy(s, cfg.policy))


def _observe(layer, cal: LayerCalibration, role: str, t: torch.Tensor) -> None:
    cfg = layer.config
    k = cfg.dgrad.oe_k if role == "g" else cfg.fprop.oe_k  # what AdaHOPLinear._observe passes
    cal.add(role, observe_tensor(t.detach(), tau=cfg.tau, k=k, profile_dims=PROFILE_DIMS[role]))


def measure_drift(model: nn.Module, batches: Iterable, *, loss_fn: Callable | None = None, apply: bool = False) -> dict:
    """Re-measure the calibrated layers of ``model`` on ``batches`` (see the module doc).

    ``batches``: what ``loss_fn(model, batch) -> scalar`` takes (default: ``(inputs, targets)``
    with the mean cross-entropy of the logits). Returns ``{"steps", "layers", "label_changes",
    "mode_changes", "changed": {layer: {"patterns": {role: [frozen, now]}, "modes": {gemm:
    [frozen, now]}}}}``, only the changes listed; with ``apply``, the changed layers run the new
    modes afterwards."""
    layers = {n: m for n, m in adahop_layers(model).items() if not m.calibrating and m.config.adaptive}
    if not layers:
        raise ValueError("measure_drift needs a calibrated adaptive model (adahop_lv2, adahop_lv1, adahop_measured, "
                         "adahop_loss_aware) with frozen modes: no converted layer has them")
    loss_fn = loss_fn or lm_loss
    cals = {n: LayerCalibration() for n in layers}
    params = [p for p in model.parameters() if p.requires_grad]
    grads = [p.grad for p in params]
    calls = {n: m.calls for n, m in layers.items()}
    handles = []

    def hook(name):
        def forward_hook(mod, args, out):
            x = args[0]
            _observe(mod, cals[name], "x", x.reshape(-1, x.shape[-1]))
            _observe(mod, cals[name], "w", mod.weight)
            if out.requires_grad:
                out.register_hook(lambda g: _observe(mod, cals[name], "g", g.reshape(-1, g.shape[-1])))
        return forward_hook

    was_training = model.training
    steps = 0
    try:
        for p in params:
            p.grad = None
        for name, m in layers.items():
            handles.append(m.register_forward_hook(hook(name)))
        model.train()
        for batch in batches:
            loss_fn(model, batch).backward()
            steps += 1
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
        for p, g in zip(params, grads):
            p.grad = g
        for n, m in layers.items():
            m.calls = calls[n]
    if steps == 0:
        raise ValueError("measure_drift got no batch")
    changed, labels, modes_changed = {}, 0, 0
    for name, layer in layers.items():
        cal = cals[name]
        if cal.steps == 0:
            continue  # no gradient reached it
        summary = cal.summary()
        patterns = {r: summary[r]["pattern"] for r in TENSOR_ROLES}
        # (with the config's own rules after the policy, as the freeze applies them)
        modes, oe_ks = layer.config.layer_modes(layer.layer_name, *policy_result(layer_policy(layer)(summary)))
        scheduled = {g for g in layer.scheduled_bf16 if layer.modes[g] == "bf16"}
        modes = {g: "bf16" if g in scheduled else m for g, m in modes.items()}
        oe_ks = {g: k for g, k in (oe_ks or {}).items() if g not in scheduled}  # (a BF16 GEMM runs no OE)
        entry = {}
        frozen_patterns = layer.patterns or {}
        p_diff = {r: [frozen_patterns.get(r), patterns[r]] for r in TENSOR_ROLES
                  if frozen_patterns.get(r) != patterns[r]}
        m_diff = {g: [layer.modes[g], modes[g]] for g in GEMMS if layer.modes[g] != modes[g]}
        labels += len(p_diff)
        modes_changed += len(m_diff)
        if p_diff:
            entry["patterns"] = p_diff
        if m_diff:
            entry["modes"] = m_diff
        if entry:
            changed[name] = entry
            if apply:
                layer.set_modes(modes, patterns, oe_ks=oe_ks or None)
    return {"steps": steps, "layers": len(layers), "label_changes": labels, "mode_changes": modes_changed,
            "changed": changed}
