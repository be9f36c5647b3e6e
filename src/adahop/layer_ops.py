"""The three GEMMs of an AdaHOP linear layer as two ``torch.library`` custom ops, so that
``torch.compile`` traces a converted model whole (no graph break at a quantized layer) and a
CUDA graph can replay it.

Shapes (suffixes name the dims): x_TK activation (T tokens, K in features), w_NK weight, g_TN
output gradient, y_TN output, dx_TK, dw_NK.

    GEMM 1 fprop  y_TN  = x_TK  @ w_NK^T     contraction K
    GEMM 2 dgrad  dx_TK = g_TN  @ w_NK       contraction N
    GEMM 3 wgrad  dw_NK = g_TN^T @ x_TK      contraction T

(``gemm_geometry.GEOMETRY``: each operand's tensor, the dim it is quantized along, and the dims OE
selects from; the code below reads it.)

``adahop::linear_forward(x, weight, rng_state, numerics, needs_backward)`` runs fprop and returns
y with what wgrad will need of x (x quantized along T, and the OE columns); ``adahop::
linear_backward`` runs dgrad and wgrad. ``torch.library.register_autograd`` ties them together,
so autograd, Dynamo and AOTAutograd see one opaque forward and one opaque backward per layer,
with fake (meta) implementations that give the output shapes without running anything.
``adahop::linear_group_forward`` (the end of this file) runs the forwards of several layers that
read one activation, quantizing it once; their backwards are each layer's ``linear_backward``.

Why one op per direction, not one per quantize / GEMM / top-k: what runs between those kernels
(the OE slices' high-precision GEMMs and their writes into C, a cast) is small and needs no
fusion, while one op per direction keeps the schema a single description of the layer's
numerics, checked once (``numerics_key``), and gives Inductor nothing to re-order that could
change the bits. The host cost of the launches inside an op is what CUDA graphs remove.

Arguments:

* ``numerics``: a string (``numerics_key``) that says, for each GEMM, its mode and how each
  operand is quantized (block, scale mode, rounding, Hadamard size, random-sign seed, OE k), and
  which backend runs it. Layers with the same settings share it (and the compiled code);
* ``rng_state``: int64 ``[prefix, call]``, the layer's stochastic-rounding chain on the device
  (``formats.rng.SRStream``): each SR operand's seed is ``mix_seeds_from(prefix, call, gemm,
  operand)``, derived inside the kernels, so no seed is read back to the host and each replay of
  a graph draws new bits from the counter it finds.

The ops' implementations are the layer's numerics as documented in docs/method.md ('The three
GEMMs of a linear layer', 'Outlier extraction (OE)'); ``ops.backends`` runs them.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import warnings
from dataclasses import dataclass

import torch

from adahop.config import AdaHOPConfig, GemmConfig
from adahop.formats.mxfp4 import MXFP4Tensor, dequantize_mxfp4, fake_quantize_mxfp4_tiles
from adahop.formats.rng import SRStream
from adahop.gemm_geometry import DGRAD, FPROP, GEMMS, WGRAD, oe_outer_size
from adahop.ops.backends import get_backend
from adahop.ops.operand import OperandSpec, quantize_operand
from adahop.transforms.hadamard import inverse_block_hadamard, random_signs


@dataclass(frozen=True)
class GemmPlan:
    """One GEMM of one call: its mode and, for MXFP4 modes, how each operand is quantized."""

    mode: str
    a: OperandSpec | None
    b: OperandSpec | None
    oe_k: int

    @property
    def quantized(self) -> bool:
        return self.mode != "bf16"


def make_gemm_plan(mode: str, cfg, *, sr_seeds: tuple, signs_seed: int | None) -> GemmPlan:
    """The plan of one GEMM in ``mode`` with the settings of ``cfg`` (a ``GemmConfig``);
    ``sr_seeds``: the SR seeds of A and B (ints, ``SRStream``s or None), given to the operands
    that round stochastically (an RNE operand draws nothing, so it gets none)."""
    if mode == "bf16":
        return GemmPlan(mode, None, None, cfg.oe_k)
    iht = mode.startswith("iht")
    common = dict(
        block_size=cfg.block_size,
        scale_mode=cfg.scale_mode,
        hadamard_size=cfg.hadamard_size if iht else None,
        signs_seed=signs_seed if (iht and cfg.random_signs) else None,
    )
    a = OperandSpec(rounding=cfg.a_rounding, sr_seed=sr_seeds[0] if cfg.a_rounding == "sr" else None, **common)
    b = OperandSpec(rounding=cfg.b_rounding, sr_seed=sr_seeds[1] if cfg.b_rounding == "sr" else None, **common)
    return GemmPlan(mode, a, b, cfg.oe_k)


@dataclass(frozen=True)
class LayerPlan:
    fprop: GemmPlan
    dgrad: GemmPlan
    wgrad: GemmPlan
    backend: object
    needs_backward: bool = True  # False under no_grad / inference: nothing is saved for wgrad
    dgrad_weight: str = "master"  # AdaHOPConfig.dgrad_weight


# ---- the numerics key: the ops' one description of a layer's GEMMs ----------------------------
def numerics_key(config: AdaHOPConfig, modes: dict, signs_seeds: tuple, oe_ks: dict | None = None) -> str:
    """The ``numerics`` argument of the ops: the layer's modes, each GEMM's settings (from
    ``config``, already checked by ``GemmConfig``; ``oe_ks``: a layer's own OE k per GEMM, which
    a policy chose, in place of the config's) and random-sign seed, and the backend name."""
    gemms = []
    for gemm, signs in zip(GEMMS, signs_seeds):
        cfg = dataclasses.asdict(config.gemm(gemm))
        cfg["mode"] = modes[gemm]
        cfg["signs_seed"] = signs
        if oe_ks and gemm in oe_ks:
            cfg["oe_k"] = oe_ks[gemm]
        gemms.append(cfg)
    return json.dumps({"backend": config.backend, "gemms": gemms, "dgrad_weight": config.dgrad_weight},
                      sort_keys=True, separators=(",", ":"))


@functools.lru_cache(maxsize=1024)
def _templates(numerics: str) -> tuple[str, tuple[GemmPlan, ...], str]:
    """The backend name, the three GEMM plans of a numerics key and which weight dgrad
    multiplies by. The plans' SR operands hold the seed 0, a placeholder: the seeds are the
    call's (``layer_plan`` gives each its stream), and nothing quantizes with a template."""
    d = json.loads(numerics)
    plans = []
    for g in d["gemms"]:
        cfg = GemmConfig(**{f.name: g[f.name] for f in dataclasses.fields(GemmConfig)})  # (mode: the layer's)
        plans.append(make_gemm_plan(cfg.mode, cfg, sr_seeds=(0, 0), signs_seed=g["signs_seed"]))
    return d["backend"], tuple(plans), d["dgrad_weight"]


def layer_plan(numerics: str, rng_state: torch.Tensor, device: torch.device, needs_backward: bool) -> LayerPlan:
    """The plan of one call: the key's GEMM plans with each SR operand's seed an ``SRStream`` of
    ``rng_state``."""
    backend_name, templates, dgrad_weight = _templates(numerics)
    plans = []
    for gi, plan in enumerate(templates):
        if plan.quantized and (plan.a.stochastic or plan.b.stochastic):
            a, b = plan.a, plan.b
            if a.stochastic:
                a = dataclasses.replace(a, sr_seed=SRStream(rng_state, gi, 0))
            if b.stochastic:
                b = dataclasses.replace(b, sr_seed=SRStream(rng_state, gi, 1))
            plan = GemmPlan(plan.mode, a, b, plan.oe_k)
        plans.append(plan)
    return LayerPlan(*plans, backend=get_backend(backend_name, device), needs_backward=needs_backward,
                     dgrad_weight=dgrad_weight)


# GEMM modes whose B operand is only quantized (no high-precision slice of it, no selection by
# its norms): there the layer's weight (float32 under autocast) goes to the quantize kernel as it
# is, with ``cast_to`` the compute dtype, and is rounded in the kernel's loads (``kernels.quantize``,
# ``round_to_bf16``) instead of a cast kernel writing a bf16 copy that the quantize kernel reads.
PLAIN_MODES = ("mxfp4", "iht")


def mxfp4_gemm(plan: GemmPlan, backend, a, a_dim, b, b_dim, *, a_hp=None, b_hp=None, b_cols_hp=None, b_cols_idx=None,
               a_q=None, a_norms=None, b_cast_to=None, out_dtype):
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
    L2 norms of A's rows, if that kernel summed them (for OE-left); ``b_cast_to``: B is
    ``b.to(b_cast_to)`` (a plain mode's weight, cast by the quantize kernel)."""
    rows_idx = cols_idx = None
    if plan.mode == "iht+oe_left":
        rows_idx = backend.select_outer(a, 1 - a_dim, plan.oe_k, norms=a_norms)
    elif plan.mode == "iht+oe_right" and b_cols_idx is None:
        cols_idx = backend.select_outer(b, 1 - b_dim, plan.oe_k)
    if a_q is None:
        a_q = backend.quantize(a, a_dim, plan.a, zero_outer=rows_idx)
    # B may be the packed operand the forward saved (wgrad's x); mm_nt takes it as it is.
    b_q = b if isinstance(b, MXFP4Tensor) else backend.quantize(b, b_dim, plan.b, zero_outer=cols_idx,
                                                                cast_to=b_cast_to)
    c = backend.mm_nt(a_q, b_q, out_dtype)
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
def forward_gemms(x_TK: torch.Tensor, weight: torch.Tensor, plan: LayerPlan, x_quantized: tuple | None = None):
    """fprop, and what wgrad will need of x. Returns ``(y_TN, x_q, cols_hp, cols_idx)``: x_q is
    x quantized along T (packed) where wgrad is quantized and a backward will run, else None;
    ``cols_hp`` / ``cols_idx`` are the k columns of x that wgrad's OE-right computes in high
    precision (chosen here from x's column norms), else None. ``x_quantized``: what
    ``quantize_input`` gave for x and this plan, made once for the layers that read x
    (``linear_group_forward``)."""
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

    x_fprop = x_saved = x_col_norms = None
    if x_quantized is not None:
        x_fprop, x_saved, x_col_norms = x_quantized
    elif fp.quantized and wg.quantized and plan.needs_backward and _packs_both(backend):
        # x is A of fprop (along K) and B of wgrad (along T, packed, saved): one call
        # quantizes both orientations (one kernel from the same reads where that is faster),
        # and gives the column norms that wgrad's OE-right ranks.
        x_fprop, x_saved, x_col_norms = backend.quantize_and_pack(
            x_TK, fp.a, wg.b, col_norms=wg.mode == "iht+oe_right")

    # GEMM 1: fprop y_TN = x_TK @ w_NK^T, [T,K]@[K,N]->[T,N]; A = x (rows: tokens),
    # B = w^T (columns: output features). Both quantized along K.
    if not fp.quantized:
        y_TN = x_TK @ w_NK.t()
    else:
        y_TN = mxfp4_gemm(
            fp, backend, x_TK, FPROP.a.dim, w_NK, FPROP.b.dim,
            a_hp=lambda idx: x_TK if idx is None else x_TK[idx],
            b_hp=lambda: w_NK.t(),
            a_q=x_fprop,
            b_cast_to=x_TK.dtype if cast_in_kernel else None,
            out_dtype=x_TK.dtype,
        )
        x_fprop = None  # freed

    # What wgrad (dw_NK = g^T x) needs of x: x quantized along T, or (wgrad in bf16) x itself,
    # which the autograd context saves from the op's input; nothing when no backward will run
    # (evaluation would otherwise pay a quantization pass per layer).
    x_q = cols_hp = cols_idx = None
    if plan.needs_backward and wg.quantized:
        if wg.mode == "iht+oe_right":  # OE on B = x's columns (input features)
            cols_idx = backend.select_outer(x_TK, WGRAD.b.outer_dim, wg.oe_k, norms=x_col_norms)
        x_q = x_saved if x_saved is not None else backend.quantize_packed(x_TK, WGRAD.b.dim, wg.b,
                                                                          zero_outer=cols_idx)
        if cols_idx is not None:
            cols_hp = x_TK[:, cols_idx].contiguous()
    return y_TN, x_q, cols_hp, cols_idx


def _packs_both(backend) -> bool:
    return getattr(backend, "quantize_and_pack", None) is not None


def backward_gemms(g_TN: torch.Tensor, weight: torch.Tensor, plan: LayerPlan, *, needs_dx: bool, needs_dw: bool,
                   x_TK=None, x_q=None, cols_hp=None, cols_idx=None, dw_dtype: torch.dtype | None = None):
    """dgrad and wgrad. ``x_TK``: the activation (wgrad in bf16); ``x_q``, ``cols_hp``,
    ``cols_idx``: what ``forward_gemms`` returned (wgrad quantized). ``weight`` as in
    ``forward_weight``; ``dw_dtype``: the weight's dtype where ``weight`` is quantized. Returns
    ``(dx_TK, dw_NK)``, None where not asked."""
    backend = plan.backend
    g_TN = g_TN.contiguous()
    dx_TK = dw_NK = None
    g_dgrad = g_wgrad = g_row_norms = None
    if (needs_dx and needs_dw and plan.dgrad.quantized and plan.wgrad.quantized
            and getattr(backend, "quantize_both", None) is not None):
        # g is A of both backward GEMMs (along N for dgrad, along T for wgrad): one kernel
        # quantizes both orientations from the same reads, and sums the row norms that
        # dgrad's OE-left ranks.
        g_dgrad, g_wgrad, g_row_norms = backend.quantize_both(
            g_TN, plan.dgrad.a, plan.wgrad.a, row_norms=plan.dgrad.mode == "iht+oe_left")

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
                out_dtype=dw_dtype or weight.dtype,
            )
    return dx_TK, dw_NK


# ---- the custom ops ----------------------------------------------------------------------------
def _saved_shapes(numerics: str, T: int, K: int, needs_backward: bool):
    """Shapes of what ``linear_forward`` returns for wgrad: x's packed codes and scale bytes
    (x quantized along T: [K, TP / 2] and [K, TP / block], TP = T padded to the operand's
    alignment) and the OE columns ([T, k], [k]); None for each that is not returned."""
    _, (_, _, wg), _ = _templates(numerics)
    if not (needs_backward and wg.quantized):
        return None, None, None
    TP = wg.b.padded(T)
    k = min(wg.oe_k, K) if wg.mode == "iht+oe_right" else None
    return (K, TP // 2), (K, TP // wg.b.block_size), k


def _none(like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return like.new_empty((0,), dtype=dtype)


@torch.library.custom_op("adahop::linear_forward", mutates_args=())
def linear_forward(x: torch.Tensor, weight: torch.Tensor, rng_state: torch.Tensor, numerics: str,
                   needs_backward: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """fprop of one layer call: ``(y, x_codes, x_scales, cols_hp, cols_idx)``, the last four
    empty where wgrad does not need them (module doc)."""
    return run_forward(x, weight, rng_state, numerics, needs_backward)


def run_forward(x, weight, rng_state, numerics, needs_backward):
    """``linear_forward``'s implementation. ``weight``: the layer's weight or fprop's B already
    quantized (``forward_gemms``; train.quantized_all_gather runs the op so for its weights)."""
    plan = layer_plan(numerics, rng_state, x.device, needs_backward)
    y, x_q, cols_hp, cols_idx = forward_gemms(x, weight, plan)
    u8 = torch.uint8
    return (y, _none(x, u8) if x_q is None else x_q.codes, _none(x, u8) if x_q is None else x_q.scale_e8m0,
            _none(x, x.dtype) if cols_hp is None else cols_hp,
            _none(x, torch.int64) if cols_idx is None else cols_idx)


@linear_forward.register_fake
def _(x, weight, rng_state, numerics, needs_backward):
    return _forward_fake(x, weight, numerics, needs_backward)


def _forward_fake(x, weight, numerics, needs_backward):
    """``linear_forward``'s outputs as empty tensors of their shapes (its fake, and the group's)."""
    T, K = x.shape
    codes, scales, k = _saved_shapes(numerics, T, K, needs_backward)
    u8 = torch.uint8
    return (x.new_empty((T, weight.shape[0])),
            _none(x, u8) if codes is None else x.new_empty(codes, dtype=u8),
            _none(x, u8) if scales is None else x.new_empty(scales, dtype=u8),
            _none(x, x.dtype) if k is None else x.new_empty((T, k)),
            _none(x, torch.int64) if k is None else x.new_empty((k,), dtype=torch.int64))


@torch.library.custom_op("adahop::linear_backward", mutates_args=())
def linear_backward(g: torch.Tensor, weight: torch.Tensor, x: torch.Tensor, x_codes: torch.Tensor,
                    x_scales: torch.Tensor, cols_hp: torch.Tensor, cols_idx: torch.Tensor, rng_state: torch.Tensor,
                    numerics: str, needs_dx: bool, needs_dw: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """dgrad and wgrad of one layer call: ``(dx, dw)``, each empty where not asked. ``x``: the
    activation where wgrad runs in bf16 (else empty); the others as ``linear_forward`` returned
    them."""
    return run_backward(g, weight, x, x_codes, x_scales, cols_hp, cols_idx, rng_state, numerics, needs_dx, needs_dw)


def run_backward(g, weight, x, x_codes, x_scales, cols_hp, cols_idx, rng_state, numerics, needs_dx, needs_dw,
                 dw_dtype=None):
    """``linear_backward``'s implementation; ``weight`` as in ``run_forward`` (``dw_dtype``: the
    weight's dtype where it is quantized)."""
    dw_dtype = dw_dtype or weight.dtype
    plan = layer_plan(numerics, rng_state, g.device, True)
    T, K = g.shape[0], weight.shape[1]
    x_q = None
    if plan.wgrad.quantized and needs_dw:
        x_q = MXFP4Tensor(x_codes, x_scales, torch.Size((T, K)), WGRAD.b.dim, plan.wgrad.b.block_size)
    has_cols = plan.wgrad.mode == "iht+oe_right"
    dx, dw = backward_gemms(g, weight, plan, needs_dx=needs_dx, needs_dw=needs_dw, x_TK=x, x_q=x_q,
                            cols_hp=cols_hp if has_cols else None, cols_idx=cols_idx if has_cols else None,
                            dw_dtype=dw_dtype)
    return (_none(g, g.dtype) if dx is None else dx, _none(g, dw_dtype) if dw is None else dw)


@linear_backward.register_fake
def _(g, weight, x, x_codes, x_scales, cols_hp, cols_idx, rng_state, numerics, needs_dx, needs_dw):
    T, (N, K) = g.shape[0], weight.shape
    return (g.new_empty((T, K)) if needs_dx else _none(g, g.dtype),
            g.new_empty((N, K), dtype=weight.dtype) if needs_dw else _none(g, weight.dtype))


def _setup_context(ctx, inputs, output):
    x, weight, rng_state, numerics, needs_backward = inputs
    _, codes, scales, cols_hp, cols_idx = output
    _, (_, _, wg), _ = _templates(numerics)
    # wgrad in bf16 keeps x itself; a quantized wgrad keeps x's packed form (the saving).
    ctx.save_for_backward(weight, x if not wg.quantized else None, codes, scales, cols_hp, cols_idx, rng_state)
    ctx.numerics = numerics
    ctx.x_dtype = x.dtype
    ctx.mark_non_differentiable(codes, scales, cols_hp, cols_idx)


def _backward(ctx, grad_y, *_unused):
    weight, x, codes, scales, cols_hp, cols_idx, rng_state = ctx.saved_tensors
    needs_dx, needs_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    if x is None:
        x = _none(grad_y, ctx.x_dtype)
    dx, dw = torch.ops.adahop.linear_backward(grad_y, weight, x, codes, scales, cols_hp, cols_idx, rng_state,
                                              ctx.numerics, needs_dx, needs_dw)
    return (dx if needs_dx else None, dw if needs_dw else None, None, None, None)


torch.library.register_autograd("adahop::linear_forward", _backward, setup_context=_setup_context)


# ---- layers that read one activation (q, k and v; w1 and w3) -----------------------------------
# Each layer of such a group would quantize x itself, the same bits each time where its settings
# are the same (X's rounding is RNE: deterministic). ``adahop::linear_group_forward`` runs the
# group's forwards in one op and quantizes x once per distinct setting; everything else (the
# weights, the GEMMs, OE, the SR streams, the backward) stays each layer's own, so the results
# are those of the layers called one by one, bit for bit.
def _input_specs(fprop: GemmPlan, wgrad: GemmPlan, needs_backward: bool):
    """x's two operands under a plan: A of fprop and B of wgrad (None where that GEMM is BF16
    or, for wgrad, where no backward will run), and whether wgrad's OE-right ranks x's columns."""
    a = fprop.a if fprop.quantized else None
    b = wgrad.b if (wgrad.quantized and needs_backward) else None
    return a, b, b is not None and wgrad.mode == "iht+oe_right"


def input_key(numerics: str, needs_backward: bool) -> tuple | None:
    """What ``quantize_input`` makes of x under a layer's numerics key, as a hashable key: the
    layers whose keys are equal get the same tensors from it. None where there is nothing to
    share: no quantized GEMM reads x, or an operand of x rounds stochastically (each layer
    draws its own bits)."""
    backend_name, (fprop, _, wgrad), _ = _templates(numerics)
    a, b, col_norms = _input_specs(fprop, wgrad, needs_backward)
    if (a is None and b is None) or any(s is not None and s.stochastic for s in (a, b)):
        return None
    return backend_name, a, b, col_norms


def quantize_input(x_TK: torch.Tensor, plan: LayerPlan) -> tuple:
    """x quantized as ``forward_gemms`` would quantize it under ``plan``: ``(x_fprop, x_saved,
    x_col_norms)``: x along K for fprop (None where fprop is BF16), along T packed for wgrad
    (None where wgrad is BF16 or no backward will run), and x's column norms where one call
    makes both orientations and wgrad's OE-right ranks columns (else None: ``forward_gemms``
    takes them from x). Nothing is zeroed for OE: the slices OE computes in high precision are
    written over the GEMM's output, whatever the quantized operand holds there."""
    a, b, col_norms = _input_specs(plan.fprop, plan.wgrad, plan.needs_backward)
    backend = plan.backend
    if a is not None and b is not None and _packs_both(backend):
        return backend.quantize_and_pack(x_TK, a, b, col_norms=col_norms)
    return (None if a is None else backend.quantize(x_TK, FPROP.a.dim, a),
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
                         group_numerics: str, owners: list[int], needs_backward: bool) -> list[torch.Tensor]:
    """fprop of n layers that read one activation: ``xs``, the same values n times (one copy per
    layer: ``train.model.compute_copies``, whose gradients meet in float32), ``weights``,
    ``rng_states`` and the layers' numerics keys (``group_numerics``: ``group_numerics_key``)
    each layer's own. Returns ``linear_forward``'s five outputs per layer, layer after layer, except
    that x's saved codes and scales come once, at the first layer that uses them, and are empty
    at the others. x is quantized once per distinct ``input_key``, from the first copy that needs
    it. ``owners``: ``group_layers``'s owners (-1 for None), which the caller derives from the
    layers' keys and the op checks; the autograd context reads them, and cannot parse the
    numerics keys where Dynamo traces it."""
    keys, owners = _check_group(xs, weights, rng_states, group_numerics, owners, needs_backward)
    shared, out = {}, []
    for i, (x, weight, rng_state, numerics) in enumerate(zip(xs, weights, rng_states, keys)):
        plan = layer_plan(numerics, rng_state, x.device, needs_backward)
        owner = owners[i]
        x_quantized = None
        if owner is not None:
            if owner not in shared:
                shared[owner] = quantize_input(x, plan)
            x_quantized = shared[owner]
        y, x_q, cols_hp, cols_idx = forward_gemms(x, weight, plan, x_quantized=x_quantized)
        u8 = torch.uint8
        own = x_q is not None and owner in (None, i)
        out += [y, x_q.codes if own else _none(x, u8), x_q.scale_e8m0 if own else _none(x, u8),
                _none(x, x.dtype) if cols_hp is None else cols_hp,
                _none(x, torch.int64) if cols_idx is None else cols_idx]
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
def _(xs, weights, rng_states, group_numerics, owners, needs_backward):
    keys, owners = _check_group(xs, weights, rng_states, group_numerics, owners, needs_backward)
    out = []
    for i, (x, weight, numerics) in enumerate(zip(xs, weights, keys)):
        y, codes, scales, cols_hp, cols_idx = _forward_fake(x, weight, numerics, needs_backward)
        if owners[i] not in (None, i):
            codes, scales = _none(x, torch.uint8), _none(x, torch.uint8)
        out += [y, codes, scales, cols_hp, cols_idx]
    return out


def _group_setup_context(ctx, inputs, output):
    # (Dynamo may trace this and the backward: plain indexing only, no parsing of the keys)
    xs, weights, rng_states, group_numerics, owners, needs_backward = inputs
    saved, non_differentiable = [], []
    for i, (x, weight, rng_state) in enumerate(zip(xs, weights, rng_states)):
        src = owners[i] if owners[i] >= 0 else i  # whose outputs hold the x this layer's wgrad reads
        codes, scales = output[5 * src + 1], output[5 * src + 2]
        _, _, _, cols_hp, cols_idx = output[5 * i: 5 * i + 5]
        # no packed x (wgrad in BF16, or no backward): wgrad reads x itself
        saved += [weight, x if codes.numel() == 0 else None, codes, scales, cols_hp, cols_idx, rng_state]
        non_differentiable += output[5 * i + 1: 5 * i + 5]
    ctx.save_for_backward(*saved)
    ctx.mark_non_differentiable(*non_differentiable)
    ctx.keys = group_numerics.split(GROUP_SEPARATOR)
    ctx.x_dtype = xs[0].dtype


def _group_backward(ctx, grads):
    saved, n = ctx.saved_tensors, len(ctx.keys)
    needs_dx, needs_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    dxs, dws = [None] * n, [None] * n
    for i, numerics in enumerate(ctx.keys):
        weight, x, codes, scales, cols_hp, cols_idx, rng_state = saved[7 * i: 7 * i + 7]
        if not (needs_dx[i] or needs_dw[i]):
            continue
        if x is None:
            x = _none(grads[5 * i], ctx.x_dtype)
        dx, dw = torch.ops.adahop.linear_backward(grads[5 * i], weight, x, codes, scales, cols_hp, cols_idx,
                                                  rng_state, numerics, needs_dx[i], needs_dw[i])
        dxs[i], dws[i] = (dx if needs_dx[i] else None), (dw if needs_dw[i] else None)
    return dxs, dws, [None] * n, None, None, None


torch.library.register_autograd("adahop::linear_group_forward", _group_backward,
                                setup_context=_group_setup_context)
