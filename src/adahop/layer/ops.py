"""The three GEMMs of an AdaHOP linear layer as two ``torch.library`` custom ops, so that
``torch.compile`` traces a converted model whole (no graph break at a quantized layer) and a
CUDA graph can replay it.

``adahop::linear_forward(x, weight, rng_state, numerics, needs_backward)`` runs fprop and returns
y with what wgrad will need of x (x quantized along T, and the OE columns); ``adahop::
linear_backward`` runs dgrad and wgrad. ``torch.library.register_autograd`` ties them together,
so autograd, Dynamo and AOTAutograd see one opaque forward and one opaque backward per layer,
with fake (meta) implementations that give the output shapes without running anything. (The
ops' names are part of compiled graphs: they stay as they are.)

Why one op per direction, not one per quantize / GEMM / top-k: what runs between those kernels
(the OE slices' high-precision GEMMs and their writes into C, a cast) is small and needs no
fusion, while one op per direction keeps the schema a single description of the layer's
numerics, checked once (``layer.plan.numerics_key``), and gives Inductor nothing to re-order that
could change the bits. The host cost of the launches inside an op is what CUDA graphs remove.

Arguments: ``numerics``, the layer's ``numerics_key`` (``layer.plan``); ``rng_state``, int64
``[prefix, call]``, the layer's stochastic-rounding chain on the device (``formats.rng.SRStream``):
each SR operand's seed is ``mix_seeds_from(prefix, call, gemm, operand)``, derived inside the
kernels. The implementations are ``layer.gemms``'s functions on the plan's backend
(``ops.backends``).
"""

from __future__ import annotations

import torch

from adahop.formats.mxfp4 import MXFP4Tensor
from adahop.gemm_geometry import WGRAD
from adahop.layer.bounds import gradient_bounds, recomputable, wgrad_input_bound
from adahop.layer.gemms import backward_gemms, forward_gemms
from adahop.layer.plan import layer_plan, numerics_templates, numerics_wgrad_input


def _saved_shapes(numerics: str, T: int, K: int, needs_backward: bool):
    """Shapes of what ``linear_forward`` returns for wgrad: x's packed codes and scale bytes
    (x quantized along T: [K, TP / 2] and [K, TP / block], TP = T padded to the operand's
    alignment) and the OE columns ([T, k], [k]); None for each that is not returned (with
    ``wgrad_input`` "recompute": none, the backward quantizes x)."""
    _, (_, _, wg), _ = numerics_templates(numerics)
    if not (needs_backward and wg.quantized and numerics_wgrad_input(numerics) == "packed"):
        return None, None, None
    TP = wg.b.padded(T)
    k = min(wg.oe_k, K) if wg.mode == "iht+oe_right" else None
    return (K, TP // 2), (K, TP // wg.b.block_size), k


def empty_output(like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return like.new_empty((0,), dtype=dtype)


@torch.library.custom_op("adahop::linear_forward", mutates_args=())
def linear_forward(x: torch.Tensor, weight: torch.Tensor, rng_state: torch.Tensor, numerics: str,
                   needs_backward: bool, x_bound: torch.Tensor | None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """fprop of one layer call: ``(y, x_codes, x_scales, cols_hp, cols_idx)``, the last four
    empty where wgrad does not need them (module doc). ``x_bound``: a bound on the magnitudes of
    x's rows, for a backend that takes one (``layer.bounds.input_bound``), else None."""
    return run_forward(x, weight, rng_state, numerics, needs_backward, x_bound)


def run_forward(x, weight, rng_state, numerics, needs_backward, x_bound=None):
    """``linear_forward``'s implementation. ``weight``: the layer's weight or fprop's B already
    quantized (``forward_gemms``; train.quantized_all_gather runs the op so for its weights)."""
    plan = layer_plan(numerics, rng_state, x.device, needs_backward)
    y, x_q, cols_hp, cols_idx = forward_gemms(x, weight, plan, x_bound=x_bound)
    u8 = torch.uint8
    return (y, empty_output(x, u8) if x_q is None else x_q.codes,
            empty_output(x, u8) if x_q is None else x_q.scale_e8m0,
            empty_output(x, x.dtype) if cols_hp is None else cols_hp,
            empty_output(x, torch.int64) if cols_idx is None else cols_idx)


@linear_forward.register_fake
def _(x, weight, rng_state, numerics, needs_backward, x_bound):
    return forward_fake(x, weight, numerics, needs_backward)


def forward_fake(x, weight, numerics, needs_backward):
    """``linear_forward``'s outputs as empty tensors of their shapes (its fake, and the group's)."""
    T, K = x.shape
    codes, scales, k = _saved_shapes(numerics, T, K, needs_backward)
    u8 = torch.uint8
    return (x.new_empty((T, weight.shape[0])),
            empty_output(x, u8) if codes is None else x.new_empty(codes, dtype=u8),
            empty_output(x, u8) if scales is None else x.new_empty(scales, dtype=u8),
            empty_output(x, x.dtype) if k is None else x.new_empty((T, k)),
            empty_output(x, torch.int64) if k is None else x.new_empty((k,), dtype=torch.int64))


@torch.library.custom_op("adahop::linear_backward", mutates_args=())
def linear_backward(g: torch.Tensor, weight: torch.Tensor, x: torch.Tensor, x_codes: torch.Tensor,
                    x_scales: torch.Tensor, cols_hp: torch.Tensor, cols_idx: torch.Tensor, rng_state: torch.Tensor,
                    numerics: str, needs_dx: bool, needs_dw: bool, g_row_bound: torch.Tensor | None,
                    g_col_bound: torch.Tensor | None, x_col_bound: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """dgrad and wgrad of one layer call: ``(dx, dw)``, each empty where not asked. ``x``: the
    activation where wgrad runs in bf16 or quantizes it here (``wgrad_input`` "recompute"), else
    empty; the others as ``linear_forward`` returned them; ``g_row_bound`` / ``g_col_bound``:
    bounds on the magnitudes of g's rows / columns (``layer.bounds.gradient_bounds``),
    ``x_col_bound`` on x's columns where x is quantized here (``layer.bounds.wgrad_input_bound``),
    None where the backend takes none."""
    return run_backward(g, weight, x, x_codes, x_scales, cols_hp, cols_idx, rng_state, numerics, needs_dx, needs_dw,
                        g_bounds=(g_row_bound, g_col_bound), x_col_bound=x_col_bound)


def run_backward(g, weight, x, x_codes, x_scales, cols_hp, cols_idx, rng_state, numerics, needs_dx, needs_dw,
                 dw_dtype=None, g_bounds=(None, None), x_col_bound=None):
    """``linear_backward``'s implementation; ``weight`` as in ``run_forward`` (``dw_dtype``: the
    weight's dtype where it is quantized)."""
    dw_dtype = dw_dtype or weight.dtype
    plan = layer_plan(numerics, rng_state, g.device, True)
    T, K = g.shape[0], weight.shape[1]
    x_q = None
    if plan.wgrad.quantized and needs_dw and plan.wgrad_input == "packed":
        x_q = MXFP4Tensor(x_codes, x_scales, torch.Size((T, K)), WGRAD.b.dim, plan.wgrad.b.block_size)
    has_cols = plan.wgrad.mode == "iht+oe_right"
    dx, dw = backward_gemms(g, weight, plan, needs_dx=needs_dx, needs_dw=needs_dw, x_TK=x, x_q=x_q,
                            cols_hp=cols_hp if has_cols else None, cols_idx=cols_idx if has_cols else None,
                            dw_dtype=dw_dtype, g_bounds=g_bounds, x_col_bound=x_col_bound)
    return (empty_output(g, g.dtype) if dx is None else dx, empty_output(g, dw_dtype) if dw is None else dw)


@linear_backward.register_fake
def _(g, weight, x, x_codes, x_scales, cols_hp, cols_idx, rng_state, numerics, needs_dx, needs_dw,
      g_row_bound, g_col_bound, x_col_bound):
    T, (N, K) = g.shape[0], weight.shape
    return (g.new_empty((T, K)) if needs_dx else empty_output(g, g.dtype),
            g.new_empty((N, K), dtype=weight.dtype) if needs_dw else empty_output(g, weight.dtype))


def _setup_context(ctx, inputs, output):
    x, weight, rng_state, numerics, needs_backward, _x_bound = inputs
    _, codes, scales, cols_hp, cols_idx = output
    _, (_, _, wg), _ = numerics_templates(numerics)
    # wgrad in bf16 keeps x itself; a quantized wgrad keeps x's packed form (the saving), or x
    # itself where the backward quantizes it (wgrad_input "recompute").
    keeps_x = not wg.quantized or numerics_wgrad_input(numerics) == "recompute"
    ctx.save_for_backward(weight, x if keeps_x else None, codes, scales, cols_hp, cols_idx, rng_state)
    ctx.numerics = numerics
    ctx.x_dtype = x.dtype
    ctx.mark_non_differentiable(codes, scales, cols_hp, cols_idx)


def _backward(ctx, grad_y, *_unused):
    weight, x, codes, scales, cols_hp, cols_idx, rng_state = ctx.saved_tensors
    needs_dx, needs_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    if x is None:
        x = empty_output(grad_y, ctx.x_dtype)
    elif needs_dw:  # (kept for a BF16 wgrad, or to quantize here)
        x = recomputable(x)
    row_bound, col_bound = gradient_bounds(grad_y, ctx.numerics, needs_dx, needs_dw)
    x_col_bound = wgrad_input_bound(x, ctx.numerics, needs_dw)
    dx, dw = torch.ops.adahop.linear_backward(grad_y, weight, x, codes, scales, cols_hp, cols_idx, rng_state,
                                              ctx.numerics, needs_dx, needs_dw, row_bound, col_bound, x_col_bound)
    return (dx if needs_dx else None, dw if needs_dw else None, None, None, None, None)


torch.library.register_autograd("adahop::linear_forward", _backward, setup_context=_setup_context)
