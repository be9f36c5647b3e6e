"""Bounds on the magnitudes of a layer's activation and gradient, taken by PyTorch ops outside the
custom ops, for backends whose GEMM form needs each row's scale before its first element is
written (``hopper_fp8``: ``formats.e4m3_rows``).

With a bound per row, the quantize kernels write the e4m3 form in one pass; without one, they find
each row's largest block exponent in a pass of their own over the transformed operand first, which
costs as much as the writing pass (docs/kernels.md, 'Row bounds from the producer'). A bound here
is each row's largest magnitude, ``t.abs().amax(dim)``: taken where the layer calls its op (x in
the module's forward, g in the op's autograd backward), it is part of the graph that
``torch.compile`` builds, and Inductor can fuse it into the kernel that produces x or g (RMSNorm,
the SwiGLU product, the residual's gradient), which reads or writes those values anyway. A maximum
is exact in any order, so compiled and eager runs agree; where Inductor takes it before its
rounding to bfloat16, the bound's slack covers the difference (``formats.e4m3_rows``).
"""

from __future__ import annotations

import torch

from adahop.layer import plan
from adahop.layer.plan import numerics_templates


def magnitude_bound(t: torch.Tensor, dim: int) -> torch.Tensor:
    """float32 ``t.abs().amax(dim)`` of a 2-D ``t``: each slice's largest magnitude along ``dim``
    (NaN where a slice holds NaN; 0 for slices of no elements). Of ``t`` detached: no gradient
    flows through a bound, and autograd keeps nothing for one. As the infinity norm: one
    reduction kernel in eager mode, where ``abs()`` would first write a copy of ``t`` (three
    passes over it instead of one: 0.165 ms against the quantize's 0.08 for x [32768, 2048] on
    the H100); Inductor lowers it to the same maximum of magnitudes."""
    if t.shape[dim] == 0:
        return torch.zeros(t.shape[1 - dim], dtype=torch.float32, device=t.device)
    return torch.linalg.vector_norm(t.detach(), float("inf"), dim).float()


@torch.compiler.assume_constant_result
def bounds_wanted(numerics: str, device: str) -> tuple[bool, bool, bool, bool]:
    """Whether fprop's, dgrad's and wgrad's A (x along K, g along N, g along T) and wgrad's B
    where the backward quantizes x (x along T, ``AdaHOPConfig.wgrad_input`` "recompute") take a
    row bound under a numerics key (``layer.plan.numerics_key``): the GEMM is quantized and its
    backend, as it resolves on ``device`` (where ``layer.plan`` resolves it for the call), takes
    bounds. A constant for ``torch.compile``: Dynamo runs it once per key and device instead of
    tracing the key's JSON parsing and the device query of ``auto``."""
    backend_name, gemms, _ = numerics_templates(numerics)
    takes = bool(getattr(plan.get_backend(backend_name, torch.device(device)), "takes_row_bounds", False))
    wanted = [takes and g.quantized for g in gemms]
    if plan.numerics_fprop_mean_bias(numerics):  # fprop quantizes x less its mean, which x's bound does not bound
        wanted[0] = False
    wanted.append(wanted[2] and plan.numerics_wgrad_input(numerics) == "recompute")
    return tuple(wanted)


def input_bound(x_TK: torch.Tensor, numerics: str) -> torch.Tensor | None:
    """The bound fprop's A (x along K: rows are tokens) takes, or None where the backend takes
    none or fprop is BF16."""
    return magnitude_bound(x_TK, 1) if bounds_wanted(numerics, str(x_TK.device))[0] else None


def gradient_bounds(g_TN: torch.Tensor, numerics: str, needs_dx: bool, needs_dw: bool):
    """``(row_bound, col_bound)`` of the output's gradient g [T, N]: the bounds dgrad's A (g along
    N: rows are tokens) and wgrad's A (g along T: rows are output features) take, None for each
    GEMM that is BF16 or not run, or where the backend takes none. Both from one read of g
    (``adahop::row_col_magnitudes``) where both are wanted: compiled, Inductor could fuse the
    rows' maxima into g's producer, but the columns' are a reduction of their own, a read of g
    either way."""
    _, dgrad, wgrad, _ = bounds_wanted(numerics, str(g_TN.device))
    rows, cols = dgrad and needs_dx, wgrad and needs_dw
    if rows and cols:
        return tuple(torch.ops.adahop.row_col_magnitudes(g_TN.detach()))
    return (magnitude_bound(g_TN, 1) if rows else None, magnitude_bound(g_TN, 0) if cols else None)


def recomputable(x_TK: torch.Tensor) -> torch.Tensor:
    """x as the backward reads it where the layer keeps x for wgrad (a BF16 wgrad, or
    ``AdaHOPConfig.wgrad_input`` "recompute"): compiled, a copy; eager, x itself (a copy would
    cost a pass over x).

    AOTAutograd's min-cut partitioner never recomputes a tensor that the backward reads through
    an op it cannot fuse, such as the layer's backward op: it would save x. Read through a copy
    (an op it fuses), the forward's x may be recomputed from what its producer keeps (a norm's
    input, SwiGLU's halves), and the copy is what the recomputing kernel writes, at no extra pass."""
    return x_TK.clone() if torch.compiler.is_compiling() else x_TK


def wgrad_input_bound(x_TK: torch.Tensor, numerics: str, needs_dw: bool) -> torch.Tensor | None:
    """The bound wgrad's B takes where the backward quantizes x (``AdaHOPConfig.wgrad_input``
    "recompute": x along T, whose rows are x's columns), or None: wgrad BF16 or not run, x packed
    by the forward, or a backend that takes none. Compiled, the maximum over the tokens can come
    out of the kernel that recomputes x."""
    return magnitude_bound(x_TK, 0) if needs_dw and bounds_wanted(numerics, str(x_TK.device))[3] else None


@torch.library.custom_op("adahop::row_col_magnitudes", mutates_args=())
def row_col_magnitudes(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(magnitude_bound(t, 1), magnitude_bound(t, 0))`` of a 2-D ``t`` from one read
    (``kernels.magnitude``; the backends that take bounds run the Triton kernels anyway)."""
    from adahop.kernels.magnitude import row_col_absmax

    return row_col_absmax(t)


@row_col_magnitudes.register_fake
def _(t):
    return t.new_empty((t.shape[0],), dtype=torch.float32), t.new_empty((t.shape[1],), dtype=torch.float32)
