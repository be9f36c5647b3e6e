"""Layers that read one activation (q, k and v; w1 and w3) as one custom op,
``adahop::linear_group_forward``: the forwards of the group's layers, with x quantized once per
distinct setting; their backwards are each layer's ``adahop::linear_backward`` (``layer.ops``).

Each layer of such a group would quantize x itself, the same bits each time where its settings
are the same (X's rounding is RNE: deterministic). The group op runs the group's forwards in one op
and quantizes x once per distinct setting; everything else (the weights, the GEMMs, OE, the SR
streams, the backward) stays each layer's own, so the results are those of the layers called one
by one, bit for bit. ``shared_input`` makes the groups.
"""

from __future__ import annotations

import functools

import torch

from adahop.gemm_geometry import FPROP, WGRAD
from adahop.layer.bounds import gradient_bounds, recomputable, wgrad_input_bound
from adahop.layer.gemms import forward_gemms
from adahop.layer.ops import empty_output, forward_fake
from adahop.layer.plan import GemmPlan, LayerPlan, layer_plan, numerics_fprop_mean_bias, numerics_templates


def _input_specs(fprop: GemmPlan, wgrad: GemmPlan, needs_backward: bool):
    """x's two operands under a plan: A of fprop and B of wgrad (None where that GEMM is BF16
    or, for wgrad, where no backward will run), and whether wgrad's OE-right ranks x's columns."""
    a = fprop.a if fprop.quantized else None
    b = wgrad.b if (wgrad.quantized and needs_backward) else None
    return a, b, b is not None and wgrad.mode == "iht+oe_right"


def input_key(numerics: str, needs_backward: bool) -> tuple | None:
    """What ``quantize_input`` makes of x under a layer's numerics key, as a hashable key: the
    layers whose keys are equal get the same tensors from it. None where there is nothing to
    share: no quantized GEMM reads x, an operand of x rounds stochastically (each layer
    draws its own bits), or fprop quantizes x with its mean taken out (``adahop.mean_bias``)."""
    if numerics_fprop_mean_bias(numerics):
        return None
    backend_name, (fprop, _, wgrad), _ = numerics_templates(numerics)
    a, b, col_norms = _input_specs(fprop, wgrad, needs_backward)
    if (a is None and b is None) or any(s is not None and s.stochastic for s in (a, b)):
        return None
    return backend_name, a, b, col_norms


def quantize_input(x_TK: torch.Tensor, plan: LayerPlan, x_bound: torch.Tensor | None = None) -> tuple:
    """x quantized as ``forward_gemms`` would quantize it under ``plan``: ``(x_fprop, x_saved,
    x_col_norms)``: x along K for fprop (None where fprop is BF16), along T packed for wgrad
    (None where wgrad is BF16 or no backward will run), and x's column norms where one call
    makes both orientations and wgrad's OE-right ranks columns (else None: ``forward_gemms``
    takes them from x). Nothing is zeroed for OE: the slices OE computes in high precision are
    written over the GEMM's output, whatever the quantized operand holds there. ``x_bound``: a
    bound on the magnitudes of x's rows, for a backend that takes one (``layer.bounds``)."""
    a, b, col_norms = _input_specs(plan.fprop, plan.wgrad, plan.needs_backward)
    backend = plan.backend
    bound = {} if x_bound is None else {"row_bound": x_bound}
    if a is not None and b is not None and backend.has_quantize_and_pack:
        return backend.quantize_and_pack(x_TK, a, b, col_norms=col_norms, **bound)
    return (None if a is None else backend.quantize(x_TK, FPROP.a.dim, a, **bound),
            None if b is None else backend.quantize_packed(x_TK, WGRAD.b.dim, b), None)


GROUP_SEPARATOR = "\t"


def group_numerics_key(keys) -> str:
    """The ``group_numerics`` argument of ``linear_group_forward``: the layers' numerics keys,
    separated by tabs (a key is JSON, whose strings escape every control character, so it holds
    no raw tab). Not line breaks: Inductor's GPU code cites each op's arguments in a one-line
    comment, and a line break there ends the comment and makes the file fail to import. A join,
    which Dynamo traces as a constant (``json.dumps`` would break the graph)."""
    return GROUP_SEPARATOR.join(keys)


@functools.lru_cache(maxsize=256)
def group_layers(group_numerics: str, needs_backward: bool) -> tuple[tuple[str, ...], tuple[int | None, ...]]:
    """A group's layers' numerics keys (``group_numerics_key``), and for each layer the index of
    the first layer with the same ``input_key`` (itself where none before it has one), whose
    quantized x it uses; None where it has nothing to share."""
    keys = group_numerics.split(GROUP_SEPARATOR)
    owners, first = [], {}
    for i, numerics in enumerate(keys):
        key = input_key(numerics, needs_backward)
        owners.append(None if key is None else first.setdefault(key, i))
    return tuple(keys), tuple(owners)


@torch.library.custom_op("adahop::linear_group_forward", mutates_args=())
def linear_group_forward(xs: list[torch.Tensor], weights: list[torch.Tensor], rng_states: list[torch.Tensor],
                         group_numerics: str, owners: list[int], needs_backward: bool,
                         x_bound: torch.Tensor | None) -> list[torch.Tensor]:
    """fprop of n layers that read one activation: ``xs``, the same values n times (one copy per
    layer: ``llama.model.compute_copies``, whose gradients meet in float32), ``weights``,
    ``rng_states`` and the layers' numerics keys (``group_numerics``: ``group_numerics_key``)
    each layer's own. Returns ``linear_forward``'s five outputs per layer, layer after layer, except
    that x's saved codes and scales come once, at the first layer that uses them, and are empty
    at the others. x is quantized once per distinct ``input_key``, from the first copy that needs
    it. ``owners``: ``group_layers``'s owners (-1 for None), which the caller derives from the
    layers' keys and the op checks; the autograd context reads them, and cannot parse the
    numerics keys where Dynamo traces it. ``x_bound``: a bound on the magnitudes of x's rows
    (``layer.bounds.input_bound``), for the layers whose backend takes one, else None."""
    keys, owners = _check_group(xs, weights, rng_states, group_numerics, owners, needs_backward)
    shared, out = {}, []
    for i, (x, weight, rng_state, numerics) in enumerate(zip(xs, weights, rng_states, keys)):
        plan = layer_plan(numerics, rng_state, x.device, needs_backward)
        bound = x_bound if plan.backend.takes_row_bounds else None
        owner = owners[i]
        x_quantized = None
        if owner is not None:
            if owner not in shared:
                shared[owner] = quantize_input(x, plan, bound)
            x_quantized = shared[owner]
        y, x_q, cols_hp, cols_idx = forward_gemms(x, weight, plan, x_quantized=x_quantized, x_bound=bound)
        u8 = torch.uint8
        own = x_q is not None and owner in (None, i)
        out += [y, x_q.codes if own else empty_output(x, u8), x_q.scale_e8m0 if own else empty_output(x, u8),
                empty_output(x, x.dtype) if cols_hp is None else cols_hp,
                empty_output(x, torch.int64) if cols_idx is None else cols_idx]
    return out


def _check_group(xs, weights, rng_states, group_numerics, owners, needs_backward):
    """The group's numerics keys and owners (``group_layers``), after checking the arguments."""
    keys, want = group_layers(group_numerics, needs_backward)
    if list(owners) != [-1 if o is None else o for o in want]:
        raise ValueError(f"owners {list(owners)} do not match the layers' numerics, which give {list(want)}")
    n = len(keys)
    if not (len(xs) == len(weights) == len(rng_states) == n):
        raise ValueError(f"a group of {n} layers takes {n} inputs, weights and rng states; got "
                         f"{len(xs)}, {len(weights)} and {len(rng_states)}")
    if any(x.shape != xs[0].shape for x in xs):
        raise ValueError(f"a group's inputs are copies of one activation, got shapes {[tuple(x.shape) for x in xs]}")
    return keys, want


@linear_group_forward.register_fake
def _(xs, weights, rng_states, group_numerics, owners, needs_backward, x_bound):
    keys, owners = _check_group(xs, weights, rng_states, group_numerics, owners, needs_backward)
    out = []
    for i, (x, weight, numerics) in enumerate(zip(xs, weights, keys)):
        y, codes, scales, cols_hp, cols_idx = forward_fake(x, weight, numerics, needs_backward)
        if owners[i] not in (None, i):
            codes, scales = empty_output(x, torch.uint8), empty_output(x, torch.uint8)
        out += [y, codes, scales, cols_hp, cols_idx]
    return out


def _group_setup_context(ctx, inputs, output):
    # (Dynamo may trace this and the backward: plain indexing only, no parsing of the keys)
    xs, weights, rng_states, group_numerics, owners, needs_backward, _x_bound = inputs
    saved, non_differentiable = [], []
    for i, (weight, rng_state) in enumerate(zip(weights, rng_states)):
        src = owners[i] if owners[i] >= 0 else i  # whose outputs hold the x this layer's wgrad reads
        codes, scales = output[5 * src + 1], output[5 * src + 2]
        _, _, _, cols_hp, cols_idx = output[5 * i: 5 * i + 5]
        # no packed x (wgrad in BF16 or quantized in the backward, or no backward): wgrad reads x itself
        # (the first copy for every layer: the same values, and one tensor kept where the copies
        # would be several)
        saved += [weight, xs[0] if codes.numel() == 0 else None, codes, scales, cols_hp, cols_idx, rng_state]
        non_differentiable += output[5 * i + 1: 5 * i + 5]
    ctx.save_for_backward(*saved)
    ctx.mark_non_differentiable(*non_differentiable)
    ctx.keys = group_numerics.split(GROUP_SEPARATOR)
    ctx.x_dtype = xs[0].dtype


def _group_backward(ctx, grads):
    saved, n = ctx.saved_tensors, len(ctx.keys)
    needs_dx, needs_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    dxs, dws = [None] * n, [None] * n
    x_read = None  # (the layers keep one x, xs[0]: read through one copy where compiled)
    for i, numerics in enumerate(ctx.keys):
        weight, x, codes, scales, cols_hp, cols_idx, rng_state = saved[7 * i: 7 * i + 7]
        if not (needs_dx[i] or needs_dw[i]):
            continue
        if x is None:
            x = empty_output(grads[5 * i], ctx.x_dtype)
        elif needs_dw[i]:  # (kept for a BF16 wgrad, or to quantize here)
            x_read = recomputable(x) if x_read is None else x_read
            x = x_read
        row_bound, col_bound = gradient_bounds(grads[5 * i], numerics, needs_dx[i], needs_dw[i])
        x_col_bound = wgrad_input_bound(x, numerics, needs_dw[i])
        dx, dw = torch.ops.adahop.linear_backward(grads[5 * i], weight, x, codes, scales, cols_hp, cols_idx,
                                                  rng_state, numerics, needs_dx[i], needs_dw[i], row_bound, col_bound,
                                                  x_col_bound)
        dxs[i], dws[i] = (dx if needs_dx[i] else None), (dw if needs_dw[i] else None)
    return dxs, dws, [None] * n, None, None, None, None


torch.library.register_autograd("adahop::linear_group_forward", _group_backward,
                                setup_context=_group_setup_context)
