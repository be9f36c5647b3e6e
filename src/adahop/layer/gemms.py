"""The three GEMMs of a layer call as plain functions: ``forward_gemms`` (fprop, and what wgrad
will need of x) and ``backward_gemms`` (dgrad and wgrad), each GEMM through ``mxfp4_gemm`` on the
plan's backend; the custom ops (``layer.ops``) run them.

Shapes (suffixes name the dims): x_TK activation (T tokens, K in features), w_NK weight, g_TN
output gradient, y_TN output, dx_TK, dw_NK.

    GEMM 1 fprop  y_TN  = x_TK  @ w_NK^T     contraction K
    GEMM 2 dgrad  dx_TK = g_TN  @ w_NK       contraction N
    GEMM 3 wgrad  dw_NK = g_TN^T @ x_TK      contraction T

(``gemm_geometry.GEOMETRY``: each operand's tensor, the dim it is quantized along, and the dims OE
selects from; the code below reads it.) The numerics are the layer's as documented in
docs/method.md ('The three GEMMs of a linear layer', 'Outlier extraction (OE)').
"""

from __future__ import annotations

import warnings

import torch

from adahop.formats.mxfp4 import MXFP4Tensor, dequantize_mxfp4, fake_quantize_mxfp4_tiles
from adahop.gemm_geometry import DGRAD, FPROP, GEMMS, WGRAD, oe_outer_size
from adahop.layer.plan import GemmPlan, LayerPlan
from adahop.mean_bias import add_mean_term, split_mean
from adahop.ops.operand import quantize_operand
from adahop.transforms.hadamard import inverse_block_hadamard, random_signs
from adahop.unbias import row_unbiasing, unbias_product

# GEMM modes whose B operand is only quantized (no high-precision slice of it, no selection by
# its norms): there the layer's weight (float32 under autocast) goes to the quantize kernel as it
# is, with ``cast_to`` the compute dtype, and is rounded in the kernel's loads (``kernels.quantize``,
# ``round_to_bf16``) instead of a cast kernel writing a bf16 copy that the quantize kernel reads.
PLAIN_MODES = ("mxfp4", "iht")


def mxfp4_gemm(plan: GemmPlan, backend, a, a_dim, b, b_dim, *, a_hp=None, b_hp=None, b_cols_hp=None, b_cols_idx=None,
               a_q=None, a_norms=None, a_bound=None, b_cast_to=None, out_dtype, unbias=False):
    """One GEMM of a layer as its plan (``make_gemm_plan``) says, on ``backend``: C = A @ B with
    both operands quantized to MXFP4 along the contraction (after the plan's Hadamard transform,
    with its rounding and scale mode), the product in ``out_dtype``, and for the OE modes the
    plan's ``oe_k`` outer slices computed in high precision.

    A is given as 2-D ``a`` (contraction along ``a_dim``) and B's transpose as 2-D ``b``
    (contraction along ``b_dim``): the NT form. OE slices are chosen, zeroed, computed in
    high precision and written over the MXFP4 result (whose zeroed slices are exactly 0).

    ``a_hp(rows)`` / ``b_hp`` give the high-precision matrices for OE; for wgrad's OE-right the
    saved columns come in ``b_cols_hp`` with their indices ``b_cols_idx``. ``a_q``: A already
    quantized (the backward's gradient: both orientations come from one kernel); ``a_norms``: the
    L2 norms of A's rows, if that kernel summed them (for OE-left); ``a_bound``: a bound on the
    magnitudes of A's rows for a backend that takes one (``layer.bounds``); ``b_cast_to``: B is
    ``b.to(b_cast_to)`` (a plain mode's weight, cast by the quantize kernel); ``unbias``: the
    MXFP4 product scaled by the operands' row factors (``adahop.unbias``) before the OE slices
    are written, B given as a tensor."""
    rows_idx = cols_idx = None
    if plan.mode == "iht+oe_left":
        rows_idx = backend.select_outer(a, 1 - a_dim, plan.oe_k, norms=a_norms)
    elif plan.mode == "iht+oe_right" and b_cols_idx is None:
        cols_idx = backend.select_outer(b, 1 - b_dim, plan.oe_k)
    if a_q is None:
        bound = {} if a_bound is None else {"row_bound": a_bound}
        a_q = backend.quantize(a, a_dim, plan.a, zero_outer=rows_idx, **bound)
    # B may be quantized already (wgrad's x: packed by the forward, or in the GEMM's form by the
    # backward); mm_nt takes it as it is.
    b_q = b if not isinstance(b, torch.Tensor) else backend.quantize(b, b_dim, plan.b, zero_outer=cols_idx,
                                                                     cast_to=b_cast_to)
    c = backend.mm_nt(a_q, b_q, out_dtype)
    if unbias:  # (OE's zeroed slices: their factors scale zeros, and the slices are written below)
        b_t = b if b_cast_to is None else b.to(b_cast_to)
        c = unbias_product(c, row_unbiasing(a, a_dim, plan.a), row_unbiasing(b_t, b_dim, plan.b))
    # The high-precision slices are GEMMs in the operands' dtype (bf16 under autocast), written
    # into C in C's dtype (wgrad's C is the parameter's, float32: see the backward).
    if rows_idx is not None:
        c[rows_idx] = (a_hp(rows_idx) @ b_hp()).to(c.dtype)
    if cols_idx is not None:
        c[:, cols_idx] = (a_hp(None) @ b_hp()[:, cols_idx]).to(c.dtype)
    if b_cols_idx is not None:
        c[:, b_cols_idx] = (a_hp(None) @ b_cols_hp).to(c.dtype)
    return c


def _warn_oe_clamp(plan: LayerPlan, T: int, N: int, K: int) -> None:
    dims = {"T": T, "N": N, "K": K}
    for gemm in GEMMS:
        p = getattr(plan, gemm)
        size = oe_outer_size(gemm, p.mode, dims)  # the outer dim OE selects from
        if size is not None and p.oe_k >= size:
            warnings.warn(
                f"AdaHOPLinear [{T}, {K}] -> [{T}, {N}]: {gemm} OE k={p.oe_k} >= the dim it selects from "
                f"({size}): k is clamped, so that GEMM runs entirely in high precision",
                stacklevel=3,
            )


# ---- one weight for the forward and dgrad (AdaHOPConfig.dgrad_weight = "forward") ---------------
def forward_weight(weight: torch.Tensor, plan: LayerPlan, dtype: torch.dtype) -> torch.Tensor:
    """The weight the forward GEMM multiplies by, dequantized into ``weight``'s [N, K] layout
    (float32; ``weight`` in the compute ``dtype`` where fprop is BF16).

    * plain ``mxfp4`` with ``dgrad_weight="forward"``: the weight quantized with one scale per
      32 x 32 tile (``fake_quantize_mxfp4_tiles``), which fprop's blocks along K and dgrad's
      along N both reproduce exactly: one quantized W in both GEMMs;
    * otherwise fprop's quantized B (``w``, or ``w H`` for the IHT modes: reference numerics,
      which every backend matches bit for bit), rotated back; under OE-right, the rows fprop
      computes in high precision are the weight's own.

    Recomputed where it is needed rather than saved (W's rounding is RNE: the same bits each
    time), so nothing weight-sized is kept from the forward to the backward.

    ``weight`` may also be that quantized B itself, an ``MXFP4Tensor`` (plain ``mxfp4`` or ``iht``
    fprop; what ``train.quantized_all_gather`` gathers): it is dequantized and rotated back, the
    same values as from the weight it was quantized from."""
    fp = plan.fprop
    rows = None
    if isinstance(weight, MXFP4Tensor):
        w_f = dequantize_mxfp4(weight, keep_padding=True)
    else:
        w = weight.to(dtype)
        if not fp.quantized:
            return w
        if fp.mode == "mxfp4" and plan.dgrad_weight == "forward":
            return fake_quantize_mxfp4_tiles(w, block_size=fp.b.block_size, scale_mode=fp.b.scale_mode)
        rows = plan.backend.select_outer(w, FPROP.b.outer_dim, fp.oe_k) if fp.mode == "iht+oe_right" else None
        zeroed = w if rows is None else w.index_fill(FPROP.b.outer_dim, rows, 0)
        w_f = dequantize_mxfp4(quantize_operand(zeroed, FPROP.b.dim, fp.b), keep_padding=True)
    if fp.b.hadamard_size is not None:
        signs = None
        if fp.b.signs_seed is not None:
            signs = random_signs(w_f.shape[-1], fp.b.signs_seed, device=w_f.device)
        w_f = inverse_block_hadamard(w_f, dim=-1, size=fp.b.hadamard_size, signs=signs)
    w_f = w_f[:, : weight.shape[1]]
    if rows is not None:
        w_f[rows] = w[rows].to(w_f.dtype)
    return w_f.contiguous()


# ---- the two directions, as plain functions (the ops' implementations) --------------------------
def forward_gemms(x_TK: torch.Tensor, weight: torch.Tensor, plan: LayerPlan, x_quantized: tuple | None = None,
                  x_bound: torch.Tensor | None = None):
    """fprop, and what wgrad will need of x. Returns ``(y_TN, x_q, cols_hp, cols_idx)``: x_q is
    x quantized along T (packed) where wgrad is quantized and a backward will run, else None;
    ``cols_hp`` / ``cols_idx`` are the k columns of x that wgrad's OE-right computes in high
    precision (chosen here from x's column norms), else None. ``x_quantized``: what
    ``quantize_input`` gave for x and this plan, made once for the layers that read x
    (``linear_group_forward``); ``x_bound``: a bound on the magnitudes of x's rows, where the
    backend takes one (``layer.bounds``).

    With ``plan.fprop_mean_bias`` (a quantized fprop), fprop's A is x with its mean over the T
    rows taken out and the mean's product with the weight is added back (``adahop.mean_bias``);
    wgrad's x is x itself, and nothing of x is quantized ahead for fprop (``x_quantized``'s
    first part must be None: ``grouped.input_key`` shares nothing for such a layer)."""
    # The parameter itself is saved and cast again in the backward: saving the cast copy
    # (bf16 under autocast) would hold 2 bytes per weight for the whole step. A plain fprop
    # mode casts it in its quantize kernel (PLAIN_MODES); the others use a cast copy.
    # ``weight`` may be fprop's B already quantized (an ``MXFP4Tensor``, plain or IHT fprop:
    # train.quantized_all_gather), which the GEMM takes as it is.
    fp, wg = plan.fprop, plan.wgrad
    cast_in_kernel = fp.mode in PLAIN_MODES
    if isinstance(weight, MXFP4Tensor):
        assert cast_in_kernel, f"a quantized weight reaches fprop mode {fp.mode!r}"
    elif plan.dgrad_weight == "forward" and fp.mode == "mxfp4":
        weight = forward_weight(weight, plan, x_TK.dtype)  # tile-quantized: fprop re-quantizes it exactly
    w_NK = weight if cast_in_kernel else weight.to(x_TK.dtype)
    backend = plan.backend
    _warn_oe_clamp(plan, x_TK.shape[0], weight.shape[0], weight.shape[1])

    mean_bias = plan.fprop_mean_bias and fp.quantized
    x_fprop = x_saved = x_col_norms = None
    if x_quantized is not None:
        x_fprop, x_saved, x_col_norms = x_quantized
        assert not (mean_bias and x_fprop is not None), "x quantized ahead reaches a mean-split fprop"
    elif (fp.quantized and wg.quantized and plan.needs_backward and backend.has_quantize_and_pack and not mean_bias
          and plan.wgrad_input == "packed"):
        # x is A of fprop (along K) and B of wgrad (along T, packed, saved): one call
        # quantizes both orientations (one kernel from the same reads where that is faster),
        # and gives the column norms that wgrad's OE-right ranks.
        bound = {} if x_bound is None else {"row_bound": x_bound}
        x_fprop, x_saved, x_col_norms = backend.quantize_and_pack(
            x_TK, fp.a, wg.b, col_norms=wg.mode == "iht+oe_right", **bound)

    # GEMM 1: fprop y_TN = x_TK @ w_NK^T, [T,K]@[K,N]->[T,N]; A = x (rows: tokens),
    # B = w^T (columns: output features). Both quantized along K.
    # With the mean split (adahop.mean_bias) A is r = x - mu everywhere in the GEMM, OE's
    # high-precision slices included (they are written over C, and the mean's term comes after).
    # r is made here, above the backend, which quantizes it as any operand: every backend runs
    # the option with its usual bits.
    if not fp.quantized:
        y_TN = x_TK @ w_NK.t()
    else:
        mu_1K, a_TK = split_mean(x_TK) if mean_bias else (None, x_TK)
        y_TN = mxfp4_gemm(
            fp, backend, a_TK, FPROP.a.dim, w_NK, FPROP.b.dim,
            a_hp=lambda idx: a_TK if idx is None else a_TK[idx],
            b_hp=lambda: w_NK.t(),
            a_q=x_fprop,
            # x's bound is not r's: a backend that takes bounds finds r's rows' own (one more pass)
            a_bound=None if mean_bias else x_bound,
            b_cast_to=x_TK.dtype if cast_in_kernel else None,
            out_dtype=x_TK.dtype,
            unbias=plan.fprop_unbias,
        )
        if mean_bias:
            y_TN = add_mean_term(y_TN, mu_1K, w_NK)
        x_fprop = a_TK = None  # freed

    # What wgrad (dw_NK = g^T x) needs of x: x quantized along T, or (wgrad in bf16, or
    # ``wgrad_input`` "recompute": the backward quantizes it) x itself, which the autograd context
    # saves from the op's input; nothing when no backward will run (evaluation would otherwise pay
    # a quantization pass per layer).
    x_q = cols_hp = cols_idx = None
    if plan.needs_backward and wg.quantized and plan.wgrad_input == "packed":
        if wg.mode == "iht+oe_right":  # OE on B = x's columns (input features)
            cols_idx = backend.select_outer(x_TK, WGRAD.b.outer_dim, wg.oe_k, norms=x_col_norms)
        x_q = x_saved if x_saved is not None else backend.quantize_packed(x_TK, WGRAD.b.dim, wg.b,
                                                                          zero_outer=cols_idx)
        if cols_idx is not None:
            cols_hp = x_TK[:, cols_idx].contiguous()
    return y_TN, x_q, cols_hp, cols_idx


def backward_gemms(g_TN: torch.Tensor, weight: torch.Tensor, plan: LayerPlan, *, needs_dx: bool, needs_dw: bool,
                   x_TK=None, x_q=None, cols_hp=None, cols_idx=None, dw_dtype: torch.dtype | None = None,
                   g_bounds: tuple = (None, None), x_col_bound: torch.Tensor | None = None):
    """dgrad and wgrad. ``x_TK``: the activation (wgrad in bf16, or ``plan.wgrad_input``
    "recompute": quantized here as the forward would have); ``x_q``, ``cols_hp``, ``cols_idx``:
    what ``forward_gemms`` returned (wgrad quantized, x packed). ``weight`` as in
    ``forward_weight``; ``dw_dtype``: the weight's dtype where ``weight`` is quantized;
    ``g_bounds``: bounds on the magnitudes of g's rows and columns, ``x_col_bound`` on x's
    columns (wgrad's B rows, where x is quantized here) (``layer.bounds``), each None where the
    backend takes none. Returns ``(dx_TK, dw_NK)``, None where not asked."""
    g_row_bound, g_col_bound = g_bounds
    backend = plan.backend
    g_TN = g_TN.contiguous()
    dx_TK = dw_NK = None
    g_dgrad = g_wgrad = g_row_norms = None
    if (needs_dx and needs_dw and plan.dgrad.quantized and plan.wgrad.quantized
            and backend.has_quantize_both):
        # g is A of both backward GEMMs (along N for dgrad, along T for wgrad): one kernel
        # quantizes both orientations from the same reads, and sums the row norms that
        # dgrad's OE-left ranks.
        both = {} if g_row_bound is None else {"bounds": (g_row_bound, g_col_bound)}
        g_dgrad, g_wgrad, g_row_norms = backend.quantize_both(
            g_TN, plan.dgrad.a, plan.wgrad.a, row_norms=plan.dgrad.mode == "iht+oe_left", **both)

    # GEMM 2: dgrad dx_TK = g_TN @ w_NK, [T,N]@[N,K]->[T,K]; A = g (rows: tokens, quantized
    # along N), B = w (columns: input features, quantized along N = dim 0 of w).
    if needs_dx:
        dg = plan.dgrad
        cast_in_kernel = dg.mode in PLAIN_MODES  # as in the forward
        w_dgrad = weight if plan.dgrad_weight == "master" else forward_weight(weight, plan, g_TN.dtype)
        w_NK = w_dgrad if cast_in_kernel else w_dgrad.to(g_TN.dtype)
        if not dg.quantized:
            dx_TK = g_TN @ w_NK
        else:
            dx_TK = mxfp4_gemm(
                dg, backend, g_TN, DGRAD.a.dim, w_NK, DGRAD.b.dim,
                a_hp=lambda idx: g_TN if idx is None else g_TN[idx],
                b_hp=lambda: w_NK,
                a_q=g_dgrad,
                a_norms=g_row_norms,
                a_bound=g_row_bound,
                b_cast_to=g_TN.dtype if cast_in_kernel else None,
                out_dtype=g_TN.dtype,
            )
            g_dgrad = None  # freed before wgrad

    # GEMM 3: wgrad dw_NK = g_TN^T @ x_TK, [N,T]@[T,K]->[N,K]; A = g^T (quantized along T =
    # dim 0 of g), B = x (columns: input features; quantized along T in the forward).
    if needs_dw:
        wg = plan.wgrad
        if not wg.quantized:
            dw_NK = g_TN.t() @ x_TK
        else:
            if plan.wgrad_input == "recompute":
                # x quantized along T as the forward would have packed it (the same columns for
                # OE-right, chosen from x's column norms; RNE or its SR stream: the same bits), in
                # the backend's GEMM form: nothing packed to unpack.
                if wg.mode == "iht+oe_right":
                    cols_idx = backend.select_outer(x_TK, WGRAD.b.outer_dim, wg.oe_k)
                    cols_hp = x_TK[:, cols_idx].contiguous()
                bound = {} if x_col_bound is None else {"row_bound": x_col_bound}
                x_q = backend.quantize(x_TK, WGRAD.b.dim, wg.b, zero_outer=cols_idx, **bound)
            # OE-left of wgrad (rows of g^T) needs x in high precision: the policy never
            # asks for it (check_modes refuses it). The MXFP4 GEMM writes dw in the
            # parameter's dtype (float32 master weights under autocast): its fp32
            # accumulation is kept rather than rounded to bf16, and autograd has no cast
            # to make (0.18 ms at (14336, 4096) on the H200).
            dw_NK = mxfp4_gemm(
                wg, backend, g_TN, WGRAD.a.dim, x_q, WGRAD.b.dim,
                a_hp=lambda idx: g_TN.t(),
                b_cols_hp=cols_hp, b_cols_idx=cols_idx,
                a_q=g_wgrad,
                a_bound=g_col_bound,
                out_dtype=dw_dtype or weight.dtype,
            )
    return dx_TK, dw_NK
