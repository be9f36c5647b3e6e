"""The AdaHOP linear layer: the three GEMMs of ``y = x w^T`` with a mode each.

Shapes (suffixes name the dims): x_TK activation (T tokens, K in features), w_NK weight, g_TN
output gradient, y_TN output, dx_TK, dw_NK.

    GEMM 1 fprop  y_TN  = x_TK  @ w_NK^T     contraction K
    GEMM 2 dgrad  dx_TK = g_TN  @ w_NK       contraction N
    GEMM 3 wgrad  dw_NK = g_TN^T @ x_TK      contraction T

Each GEMM runs in one of the modes of ``policy.GEMM_MODES``:

* ``bf16``: high precision (the layer's compute dtype: bf16 under autocast, else x's dtype);
* ``mxfp4``: both operands MXFP4 along the contraction dim, no transform;
* ``iht``: block Hadamard along the contraction dim, then MXFP4 (``(A H)(H^T B) = A B``);
* ``iht+oe_left``: the k rows of A with the largest L2 norm go to a high-precision GEMM
  (``C[idx, :] = A[idx, :] B``), the rest (those rows zeroed) through IHT + MXFP4;
* ``iht+oe_right``: the same for the k columns of B (``C[:, idx] = A B[:, idx]``).

What the forward saves for the backward: x quantized along T (packed 4-bit + scales, Hadamard
already applied: this is the activation-memory saving), or x itself where wgrad runs in bf16, plus
the k high-precision columns of x where wgrad uses OE-right (chosen in the forward from x's
column norms). The weight is re-quantized along N in the backward from the parameter, which is
alive anyway: saving a second quantized copy would cost memory for nothing.

During calibration (adaptive recipes, training mode, grad enabled) every GEMM runs in high
precision while x and w are classified in the forward and g in the backward; after
``calibration_steps`` backward passes the layer votes its patterns, the policy picks the modes,
and they are frozen (and saved in the state_dict as extra state).
"""

from __future__ import annotations

import dataclasses
import warnings
import zlib
from dataclasses import dataclass

import torch
from torch import nn

from adahop.config import AdaHOPConfig, GemmConfig
from adahop.formats.mxfp4 import MXFP4Tensor
from adahop.formats.rng import mix_seeds, mix_seeds_from
from adahop.ops.backends import get_backend
from adahop.ops.operand import OperandSpec
from adahop.patterns.calibration import LayerCalibration, observe_tensor
from adahop.patterns.detect import check_patterns
from adahop.policy import GEMMS, check_modes, table_policy

EXTRA_STATE_VERSION = 1
GEMM_INDEX = {g: i for i, g in enumerate(GEMMS)}


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


def make_gemm_plan(mode: str, cfg: GemmConfig, *, sr_seeds: tuple[int | None, int | None], signs_seed: int) -> GemmPlan:
    if mode == "bf16":
        return GemmPlan(mode, None, None, cfg.oe_k)
    iht = mode.startswith("iht")
    common = dict(
        block_size=cfg.block_size,
        scale_mode=cfg.scale_mode,
        hadamard_size=cfg.hadamard_size if iht else None,
        signs_seed=signs_seed if (iht and cfg.random_signs) else None,
    )
    a = OperandSpec(rounding=cfg.a_rounding, sr_seed=sr_seeds[0], **common)
    b = OperandSpec(rounding=cfg.b_rounding, sr_seed=sr_seeds[1], **common)
    return GemmPlan(mode, a, b, cfg.oe_k)


@dataclass(frozen=True)
class LayerPlan:
    fprop: GemmPlan
    dgrad: GemmPlan
    wgrad: GemmPlan
    backend: object
    layer: AdaHOPLinear | None = None  # set while calibrating: receives the observations
    needs_backward: bool = True  # False under no_grad / inference: nothing is saved for wgrad


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


class _AdaHOPLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TK, weight, plan: LayerPlan):
        # The parameter itself is saved and cast again in the backward: saving the cast copy
        # (bf16 under autocast) would hold 2 bytes per weight for the whole step. A plain fprop
        # mode casts it in its quantize kernel (PLAIN_MODES); the others use a cast copy.
        fp, wg = plan.fprop, plan.wgrad
        cast_in_kernel = plan.layer is None and fp.mode in PLAIN_MODES
        w_NK = weight if cast_in_kernel else weight.to(x_TK.dtype)
        backend = plan.backend
        if plan.layer is not None:
            plan.layer._observe("x", x_TK)
            plan.layer._observe("w", w_NK)

        x_fprop = x_saved = x_col_norms = None
        if (fp.quantized and wg.quantized and plan.needs_backward
                and getattr(backend, "quantize_and_pack", None) is not None):
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
                fp, backend, x_TK, 1, w_NK, 1,
                a_hp=lambda idx: x_TK if idx is None else x_TK[idx],
                b_hp=lambda: w_NK.t(),
                a_q=x_fprop,
                b_cast_to=x_TK.dtype if cast_in_kernel else None,
                out_dtype=x_TK.dtype,
            )
            x_fprop = None  # freed

        # What wgrad (dw_NK = g^T x) needs of x: x quantized along T, or x itself (nothing when
        # no backward will run: evaluation would otherwise pay a quantization pass per layer).
        ctx.wgrad_x_q = None
        ctx.wgrad_cols = False
        saved = [weight]
        if not plan.needs_backward:
            pass
        elif not wg.quantized:
            saved.append(x_TK)
        else:
            cols_idx = None
            if wg.mode == "iht+oe_right":  # OE on B = x's columns (input features)
                cols_idx = backend.select_outer(x_TK, 1, wg.oe_k, norms=x_col_norms)
            x_q = x_saved if x_saved is not None else backend.quantize_packed(x_TK, 0, wg.b, zero_outer=cols_idx)
            ctx.wgrad_x_q = (x_q.shape, x_q.dim, x_q.block_size)
            saved += [x_q.codes, x_q.scale_e8m0]
            if cols_idx is not None:
                ctx.wgrad_cols = True
                saved += [x_TK[:, cols_idx].contiguous(), cols_idx]
        ctx.save_for_backward(*saved)
        ctx.plan = plan
        return y_TN

    @staticmethod
    def backward(ctx, g_TN):
        plan = ctx.plan
        backend = plan.backend
        g_TN = g_TN.contiguous()
        saved = list(ctx.saved_tensors)
        weight = saved.pop(0)
        if plan.layer is not None:
            plan.layer._observe("g", g_TN)
        dx_TK = dw_NK = None
        g_dgrad = g_wgrad = g_row_norms = None
        if (ctx.needs_input_grad[0] and ctx.needs_input_grad[1] and plan.dgrad.quantized
                and plan.wgrad.quantized and getattr(backend, "quantize_both", None) is not None):
            # g is A of both backward GEMMs (along N for dgrad, along T for wgrad): one kernel
            # quantizes both orientations from the same reads, and sums the row norms that
            # dgrad's OE-left ranks.
            g_dgrad, g_wgrad, g_row_norms = backend.quantize_both(
                g_TN, plan.dgrad.a, plan.wgrad.a, row_norms=plan.dgrad.mode == "iht+oe_left")

        # GEMM 2: dgrad dx_TK = g_TN @ w_NK, [T,N]@[N,K]->[T,K]; A = g (rows: tokens, quantized
        # along N), B = w (columns: input features, quantized along N = dim 0 of w).
        if ctx.needs_input_grad[0]:
            dg = plan.dgrad
            cast_in_kernel = dg.mode in PLAIN_MODES  # as in the forward
            w_NK = weight if cast_in_kernel else weight.to(g_TN.dtype)
            if not dg.quantized:
                dx_TK = g_TN @ w_NK
            else:
                dx_TK = mxfp4_gemm(
                    dg, backend, g_TN, 1, w_NK, 0,
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
        if ctx.needs_input_grad[1]:
            wg = plan.wgrad
            if not wg.quantized:
                x_TK = saved.pop(0)
                dw_NK = g_TN.t() @ x_TK
            else:
                shape, dim, block = ctx.wgrad_x_q
                x_q = MXFP4Tensor(saved.pop(0), saved.pop(0), shape, dim, block)
                cols_hp = cols_idx = None
                if ctx.wgrad_cols:
                    cols_hp, cols_idx = saved.pop(0), saved.pop(0)
                # OE-left of wgrad (rows of g^T) needs x in high precision: the policy never
                # asks for it (check_modes refuses it). The MXFP4 GEMM writes dw in the
                # parameter's dtype (float32 master weights under autocast): its fp32
                # accumulation is kept rather than rounded to bf16, and autograd has no cast
                # to make (0.18 ms at (14336, 4096) on the H200).
                dw_NK = mxfp4_gemm(
                    wg, backend, g_TN, 0, x_q, 0,
                    a_hp=lambda idx: g_TN.t(),
                    b_cols_hp=cols_hp, b_cols_idx=cols_idx,
                    a_q=g_wgrad,
                    out_dtype=weight.dtype,
                )
        if plan.layer is not None:
            plan.layer._after_calibration_step()
        return dx_TK, dw_NK, None


class AdaHOPLinear(nn.Linear):
    """``nn.Linear`` whose three GEMMs run in MXFP4 with AdaHOP's per-GEMM strategy.

    Build it with ``from_float`` (or ``convert_to_adahop_training``) so that it shares the
    original module's parameters. State beyond the parameters (calibration votes, patterns,
    modes, the counter of training calls that seeds stochastic rounding) is the module's extra
    state: it is in ``state_dict()`` and restored by ``load_state_dict``. A layer that is high
    precision for good (``runs_plain_linear``: the bf16 recipe) is ``F.linear`` and counts no
    calls."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None, *,
                 config: AdaHOPConfig | None = None, name: str = ""):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        config = AdaHOPConfig() if config is None else config
        if not isinstance(config, AdaHOPConfig):
            raise ValueError(f"config must be an AdaHOPConfig, got {type(config).__name__}")
        self.config = config
        self.layer_name = name
        self.layer_id = zlib.crc32(name.encode())  # stable across processes (unlike hash())
        self.calls = 0
        self.calibration = LayerCalibration() if config.adaptive else None
        self.patterns: dict | None = None
        self.modes: dict | None = None if config.adaptive else config.fixed_modes()
        # False: the layer does not freeze itself when calibration ends; the caller merges the
        # observations first (e.g. across data-parallel ranks) and calls finish_calibration.
        self.freeze_when_calibrated = True
        self._oe_clamp_warned = False
        self._static_plan = None  # (config, key, seed chain prefix, GEMM plans without SR seeds): _plan
        self._register_load_state_dict_pre_hook(self._fill_missing_extra_state, with_module=False)

    @classmethod
    def from_float(cls, mod: nn.Linear, *, config: AdaHOPConfig, name: str = "") -> AdaHOPLinear:
        """Wrap ``mod`` (built on the meta device, then given ``mod``'s own parameters)."""
        if not isinstance(mod, nn.Linear):
            raise ValueError(f"from_float takes an nn.Linear, got {type(mod).__name__}")
        with torch.device("meta"):
            new = cls(mod.in_features, mod.out_features, bias=mod.bias is not None, config=config, name=name)
        new.weight = mod.weight
        new.bias = mod.bias
        new.train(mod.training)
        return new

    # ---- calibration --------------------------------------------------------------------------
    @property
    def calibrating(self) -> bool:
        return self.modes is None

    def _observe(self, role: str, t: torch.Tensor) -> None:
        k = {"x": self.config.fprop.oe_k, "w": self.config.fprop.oe_k, "g": self.config.dgrad.oe_k}[role]
        self.calibration.add(role, observe_tensor(t, tau=self.config.tau, k=k))

    def _after_calibration_step(self) -> None:
        if (self.freeze_when_calibrated and self.calibrating
                and self.calibration.steps >= self.config.calibration_steps):
            self.finish_calibration()

    def finish_calibration(self) -> dict:
        """Vote the patterns, let the policy pick the modes, freeze them. Returns the modes."""
        if not self.config.adaptive:
            raise ValueError(f"recipe {self.config.recipe!r} is not adaptive: it has no calibration")
        if self.calibration.steps == 0:
            raise ValueError(f"layer {self.layer_name!r} has observed no backward pass yet")
        summary = self.calibration.summary()
        policy = self.config.policy_fn
        modes = policy(summary) if policy is not None else table_policy(summary, self.config.policy)
        self.modes = check_modes(modes)
        self.patterns = {r: summary[r]["pattern"] for r in ("x", "w", "g")}
        return dict(self.modes)

    def set_modes(self, modes: dict, patterns: dict | None = None) -> None:
        """Freeze the layer's modes (e.g. loaded from JSON): no calibration afterwards."""
        modes = check_modes(modes)
        patterns = check_patterns(patterns) if patterns is not None else self.patterns
        self.modes, self.patterns = modes, patterns

    # ---- forward -------------------------------------------------------------------------------
    def _plan(self, device: torch.device, observe: bool, tokens: int, needs_backward: bool = True) -> LayerPlan:
        modes = self._BF16_MODES if self.calibrating else self.modes
        call = self.calls
        if needs_backward:  # forwards without a backward (evaluation) leave the SR sequence alone
            # (a plain attribute: written past nn.Module.__setattr__'s checks, once per forward)
            self.__dict__["calls"] = call + 1
        # SR seeds = mix_seeds(seed, layer_id, call, gemm, operand); signs seeds = mix_seeds(seed,
        # layer_id, gemm, 2), fixed per layer and GEMM. What does not depend on the call (the
        # chain's fixed prefix, the signs seeds, the plans of GEMMs without SR) is made once per
        # (config, layer, modes); an operand without SR gets no seed (RNE draws nothing). The
        # config is frozen: a new one (``layer.config = ...``) is a new object.
        key = (self.layer_id, tuple(modes[g] for g in GEMMS))
        static = self._static_plan
        if static is None or static[0] is not self.config or static[1] != key:
            static = self._static_plan = (self.config, key, *self._make_static_plan(modes))
        _, _, prefix, templates = static
        call_state = None
        plans = []
        for _gemm, gi, template in templates:
            if template.quantized and (template.a.rounding == "sr" or template.b.rounding == "sr"):
                if call_state is None:
                    call_state = mix_seeds_from(prefix, call)
                a, b = template.a, template.b
                if a.rounding == "sr":
                    a = dataclasses.replace(a, sr_seed=mix_seeds_from(call_state, gi, 0))
                if b.rounding == "sr":
                    b = dataclasses.replace(b, sr_seed=mix_seeds_from(call_state, gi, 1))
                template = GemmPlan(template.mode, a, b, template.oe_k)
            plans.append(template)
        if not self._oe_clamp_warned:
            self._warn_oe_clamp(modes, tokens)
        return LayerPlan(
            *plans,
            backend=get_backend(self.config.backend, device),
            layer=self if observe else None,
            needs_backward=needs_backward,
        )

    _BF16_MODES = {g: "bf16" for g in GEMMS}

    def _make_static_plan(self, modes: dict) -> tuple:
        """The chain prefix of the SR seeds and, per GEMM, its plan without SR seeds."""
        prefix = mix_seeds(self.config.seed, self.layer_id)
        templates = []
        for gemm in GEMMS:
            gi = GEMM_INDEX[gemm]
            signs_seed = mix_seeds_from(prefix, gi, 2)
            plan = make_gemm_plan(modes[gemm], self.config.gemm(gemm), sr_seeds=(None, None), signs_seed=signs_seed)
            templates.append((gemm, gi, plan))
        return prefix, tuple(templates)

    def _warn_oe_clamp(self, modes: dict, tokens: int) -> None:
        outer = {  # size of the outer dim OE selects from, per (gemm, mode)
            ("fprop", "iht+oe_left"): tokens, ("fprop", "iht+oe_right"): self.out_features,
            ("dgrad", "iht+oe_left"): tokens, ("dgrad", "iht+oe_right"): self.in_features,
            ("wgrad", "iht+oe_right"): self.in_features,
        }
        for gemm in GEMMS:
            size = outer.get((gemm, modes[gemm]))
            k = self.config.gemm(gemm).oe_k
            if size is not None and k >= size and not self._oe_clamp_warned:
                self._oe_clamp_warned = True
                warnings.warn(
                    f"{self.layer_name or 'AdaHOPLinear'}: {gemm} OE k={k} >= the dim it selects "
                    f"from ({size}): k is clamped, so that GEMM runs entirely in high precision",
                    stacklevel=4,
                )

    @property
    def runs_plain_linear(self) -> bool:
        """True for a layer whose GEMMs are all high precision for good (the bf16 recipe): it is
        ``nn.Linear``'s own ``F.linear``, the same GEMMs as the layer's bf16 mode (under
        autocast: bf16 operands, fp32 accumulation, the weight's gradient cast to fp32), and
        ``torch.compile`` can trace it."""
        return not self.config.adaptive and all(m == "bf16" for m in self.modes.values())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise ValueError(f"input must be a floating-point tensor, got {getattr(x, 'dtype', type(x))}")
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise ValueError(f"input's last dim must be in_features={self.in_features}, got shape {tuple(x.shape)}")
        if self.runs_plain_linear:
            return nn.functional.linear(x, self.weight, self.bias)
        return self._forward_adahop(x)

    # torch.compile does not trace the quantized path: it calls Triton kernels through their own
    # launcher, draws stochastic-rounding seeds from a host counter and calibrates on the host.
    # A compiled model (``train.compile.compile_blocks``) runs it eagerly between its compiled
    # parts (a graph break at each such layer).
    @torch.compiler.disable
    def _forward_adahop(self, x: torch.Tensor) -> torch.Tensor:
        device_type = x.device.type
        if torch.is_autocast_enabled(device_type):
            dtype = torch.get_autocast_dtype(device_type)
        else:
            dtype = x.dtype
        observe = self.calibrating and self.training and torch.is_grad_enabled()
        x_TK = x.reshape(-1, self.in_features).to(dtype)
        needs_backward = torch.is_grad_enabled() and (x_TK.requires_grad or self.weight.requires_grad)
        plan = self._plan(x.device, observe, x_TK.shape[0], needs_backward)
        with torch.autocast(device_type, enabled=False):
            y = _AdaHOPLinearFunction.apply(x_TK, self.weight, plan)
            if self.bias is not None:
                y = y + self.bias.to(dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    # ---- state ---------------------------------------------------------------------------------
    def get_extra_state(self) -> dict:
        return {
            "version": EXTRA_STATE_VERSION,
            "recipe": self.config.recipe,
            "calls": self.calls,
            "calibration": None if self.calibration is None else self.calibration.to_dict(),
            "patterns": None if self.patterns is None else dict(self.patterns),
            "modes": None if self.modes is None else dict(self.modes),
        }

    def set_extra_state(self, state: dict) -> None:
        if not isinstance(state, dict) or state.get("version") != EXTRA_STATE_VERSION:
            raise ValueError(f"unrecognised AdaHOPLinear extra state: {state!r}")
        self.calls = int(state["calls"])
        if state.get("recipe") != self.config.recipe:
            warnings.warn(
                f"{self.layer_name or 'AdaHOPLinear'}: the checkpoint was made with recipe "
                f"{state.get('recipe')!r} but this layer runs {self.config.recipe!r}; its "
                "calibration and modes are not loaded (the layer keeps its own)",
                stacklevel=2,
            )
            return
        if state["calibration"] is not None and self.config.adaptive:
            self.calibration = LayerCalibration.from_dict(state["calibration"])
        self.patterns = state["patterns"]
        if state["modes"] is not None:
            self.modes = check_modes(state["modes"])
        elif self.config.adaptive:
            self.modes = None
        else:
            raise ValueError(f"checkpoint has no modes for non-adaptive recipe {self.config.recipe!r}")

    def _fill_missing_extra_state(self, state_dict, prefix, *args) -> None:
        # A checkpoint of the unconverted model has no extra state: keep ours.
        key = prefix + "_extra_state"
        if key not in state_dict and any(k.startswith(prefix) for k in state_dict):
            state_dict[key] = self.get_extra_state()

    def extra_repr(self) -> str:
        base = super().extra_repr()
        cfg = self.config
        if self.calibrating:
            status = f"calibrating {self.calibration.steps}/{cfg.calibration_steps} steps (bf16 meanwhile)"
        else:
            status = "modes: " + ", ".join(f"{g}={self.modes[g]}" for g in GEMMS)
        pats = ""
        if self.patterns is not None:
            pats = "patterns: " + ", ".join(f"{r}={self.patterns[r]}" for r in ("x", "w", "g")) + ", "
        return f"{base}, recipe={cfg.recipe}, {pats}{status}"
