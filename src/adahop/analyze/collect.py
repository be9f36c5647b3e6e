"""Capture each linear layer's X, W and G for one forward + backward of a plain model.

``find_linears`` picks the layers to study: every ``nn.Linear`` that ``convert_to_adahop_training``
would convert (the LM head stays out, as there), or those a ``module_filter(module, name)``
accepts. A model already converted is refused: the study quantizes the float tensors itself.

``capture_step`` runs ``loss_fn(model, batch)`` and its backward with hooks on those layers: a
forward hook keeps the input x (as x_TK: leading dims flattened into tokens) and puts a hook on
the output that keeps its gradient g_TN; the weight w_NK is the parameter. A layer called several
times in one forward (shared weights) gets its calls' tokens concatenated: its weight gradient is
the sum over the calls, which is the wgrad GEMM of the concatenation. The parameters' ``.grad``
are cleared after each step (no optimizer runs: the weights are the same at every step).

A layer is left out of a step, with the reason, when it was not called, when no gradient reached
its output, or when a dim is below 32 (one MXFP4 block) or a tensor holds NaN or Inf
(``capture_problem``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from adahop.analyze.observe import is_finite
from adahop.convert import default_module_filter
from adahop.drift import lm_loss
from adahop.linear import AdaHOPLinear

MIN_DIM = 32  # one MXFP4 block


def find_linears(model: nn.Module, module_filter: Callable[[nn.Module, str], bool] | None = None
                 ) -> dict[str, nn.Linear]:
    """The layers to study by qualified name, in the model's order (see the module doc)."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be an nn.Module, got {type(model).__name__}")
    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    converted = [name for name, m in linears.items() if isinstance(m, AdaHOPLinear)]
    if converted:
        raise ValueError(f"the model is converted already ({converted[0]!r} is an AdaHOPLinear): study the plain "
                         "model, before convert_to_adahop_training (the study quantizes the float tensors itself)")
    if not linears:
        raise ValueError(f"{type(model).__name__} has no nn.Linear layers: the study measures the GEMMs of linear "
                         "layers")
    keep = module_filter or default_module_filter(model)
    chosen = {name: m for name, m in linears.items() if keep(m, name)}
    if not chosen:
        shown = ", ".join(list(linears)[:5]) + (" ..." if len(linears) > 5 else "")
        raise ValueError(f"no linear layer passes the layer filter; the model's linear layers: {shown}")
    return chosen


@dataclass
class Captured:
    """One layer's tensors of one step (float32)."""

    x_TK: torch.Tensor
    w_NK: torch.Tensor
    g_TN: torch.Tensor


class _Recorder:
    def __init__(self, layer: nn.Linear):
        self.layer = layer
        self.xs: list[torch.Tensor] = []
        self.gs: dict[int, torch.Tensor] = {}

    def forward_hook(self, mod, args, out):
        if not args or not isinstance(args[0], torch.Tensor) or not isinstance(out, torch.Tensor):
            return
        call = len(self.xs)
        self.xs.append(args[0].detach().reshape(-1, mod.in_features).float())
        if out.requires_grad:
            def keep(g, call=call):
                self.gs[call] = g.detach().reshape(-1, mod.out_features).float().clone()
            out.register_hook(keep)

    def result(self) -> tuple[Captured | None, str | None]:
        if not self.xs:
            return None, "not called in the forward"
        if len(self.gs) < len(self.xs):
            return None, "no gradient reached its output (it does not affect the loss)"
        x = torch.cat(self.xs) if len(self.xs) > 1 else self.xs[0]
        g = torch.cat([self.gs[i] for i in range(len(self.xs))]) if len(self.xs) > 1 else self.gs[0]
        return Captured(x, self.layer.weight.detach().float(), g), None


def capture_problem(c: Captured) -> str | None:
    """Why a layer's tensors cannot be studied, or None."""
    tokens, k = c.x_TK.shape
    n = c.w_NK.shape[0]
    for what, size in (("in_features", k), ("out_features", n), ("tokens", tokens)):
        if size < MIN_DIM:
            return f"{what} = {size} < {MIN_DIM} (one MXFP4 block)"
    for role, t in (("x", c.x_TK), ("w", c.w_NK), ("g", c.g_TN)):
        if not is_finite(t):
            return f"{role} holds NaN or Inf"
    for role, t in (("x", c.x_TK), ("w", c.w_NK), ("g", c.g_TN)):
        if not bool(t.any()):
            return f"{role} is all zeros"
    return None


def capture_step(model: nn.Module, batch, layers: Mapping[str, nn.Linear],
                 loss_fn: Callable = lm_loss) -> tuple[float, dict[str, Captured], dict[str, str]]:
    """One forward + backward: ``(loss, {name: Captured}, {name: reason left out})``."""
    recorders = {name: _Recorder(m) for name, m in layers.items()}
    handles = [m.register_forward_hook(recorders[name].forward_hook) for name, m in layers.items()]
    try:
        with torch.enable_grad():
            loss = loss_fn(model, batch)
            if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                raise ValueError(f"loss_fn must return a scalar tensor, got {getattr(loss, 'shape', type(loss))}")
            if not loss.requires_grad:
                raise ValueError("the loss does not require grad: no parameter or input reaches it")
            loss.backward()
    finally:
        for h in handles:
            h.remove()
        for p in model.parameters():
            p.grad = None
    captured, skipped = {}, {}
    for name, rec in recorders.items():
        c, reason = rec.result()
        reason = reason or capture_problem(c)
        if reason:
            skipped[name] = reason
        else:
            captured[name] = c
    return loss.item(), captured, skipped
