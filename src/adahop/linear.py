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

The GEMMs run as two custom ops (``layer.ops``: ``adahop::linear_forward`` / ``linear_backward``),
which ``torch.compile`` traces without a graph break.

During calibration (adaptive recipes, training mode, grad enabled) every GEMM runs in high
precision (or, with ``calibration_gemms="iht"``, in IHT + MXFP4) while x and w are classified in
the forward and g in the backward; after
``calibration_steps`` backward passes the layer votes its patterns, the policy picks the modes,
and they are frozen (and saved in the state_dict as extra state). The observations stay on the
device and add up there (``patterns.calibration``): a calibration step reads nothing back to the
host, except the one that reaches ``calibration_steps``, whose freeze reads the summary once.
Calibration runs eagerly (its statistics are many small ops, and their running sums Python-held
state): a compiled model breaks its graph at a calibrating layer, and compiles once more, without
breaks, when the modes freeze.
"""

from __future__ import annotations

import warnings
import zlib

import torch
from torch import nn

from adahop.calibration_group import CalibrationGroup
from adahop.config import AdaHOPConfig
from adahop.formats.rng import mix_seeds, mix_seeds_from
from adahop.gemm_geometry import GEMM_INDEX
from adahop.layer import (  # noqa: F401  (GemmPlan, LayerPlan, make_gemm_plan, mxfp4_gemm: public here)
    PLAIN_MODES,
    GemmPlan,
    LayerPlan,
    input_key,
    layer_plan,
    make_gemm_plan,
    mxfp4_gemm,
    numerics_key,
)
from adahop.layer.bounds import input_bound
from adahop.patterns.calibration import LayerCalibration, observe_on_device, tensor_part
from adahop.patterns.detect import check_patterns
from adahop.policy import GEMMS, QUANT_POLICIES, policy_result, table_policy

EXTRA_STATE_VERSION = 1


class _CalibratingLinearFunction(torch.autograd.Function):
    """A calibration step of one layer: the three GEMMs in high precision (the layer's bf16
    modes, the same operations as ``layer.gemms`` runs for them), x and w observed in the forward,
    g in the backward, and the freeze after the last calibration step's backward."""

    @staticmethod
    def forward(ctx, x_TK, weight, layer):
        w_NK = weight.to(x_TK.dtype)
        layer._observe("x", x_TK)
        layer._observe("w", w_NK)
        ctx.save_for_backward(x_TK, weight)
        ctx.layer = layer
        return x_TK @ w_NK.t()

    @staticmethod
    def backward(ctx, g_TN):
        x_TK, weight = ctx.saved_tensors
        g_TN = g_TN.contiguous()
        ctx.layer._observe("g", g_TN)
        dx_TK = g_TN @ weight.to(g_TN.dtype) if ctx.needs_input_grad[0] else None
        dw_NK = g_TN.t() @ x_TK if ctx.needs_input_grad[1] else None
        ctx.layer._after_calibration_step()
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
        self.layer_name = name
        self.layer_id = zlib.crc32(name.encode())  # stable across processes (unlike hash())
        # The stochastic-rounding chain on the device, int64 [prefix, call]: prefix =
        # mix_seeds(config.seed, layer_id), call = the training forwards so far (formats.rng.SRStream;
        # not in the state_dict as a tensor: its call count is part of the extra state).
        self.register_buffer("rng_state", torch.zeros(2, dtype=torch.int64, device=device), persistent=False)
        self.config = config  # (sets rng_state's prefix)
        self.calibration = LayerCalibration() if config.adaptive else None
        self.oe_ks: dict | None = None  # the OE k per GEMM a policy chose (None: the config's)
        self.patterns: dict | None = None
        self.modes: dict | None = None if config.adaptive else config.layer_modes(name, config.fixed_modes())[0]
        # The GEMMs a precision schedule's BF16 phase switched (adahop.schedule.apply_bf16_phase):
        # their BF16 is the schedule's, not the policy's, so a re-decision of the modes
        # (adahop.drift) leaves them alone. Not in the state_dict: a training loop applies its
        # schedule before every step, a resumed one too.
        self.scheduled_bf16: tuple[str, ...] = ()
        # False: the layer does not freeze itself when calibration ends; the caller merges the
        # observations first (e.g. across data-parallel ranks) and calls finish_calibration.
        self.freeze_when_calibrated = True
        # The layers this one freezes with under a policy over the whole model (loss_aware):
        # set by convert_to_adahop_training (None: a group of this layer alone, made when needed).
        self.calibration_group: CalibrationGroup | None = None
        # How many consecutive training calls make one calibration observation: a micro-batch
        # run as that many parts (``convert.calibration_parts``); the parts of x and g wait in
        # ``_parts`` (small per-row and per-column statistics) until the last one comes.
        self.calibration_parts = 1
        self._parts: dict[str, list] = {"x": [], "g": []}
        self._register_load_state_dict_pre_hook(self._fill_missing_extra_state, with_module=False)

    @property
    def config(self) -> AdaHOPConfig:
        return self._config

    @config.setter
    def config(self, config: AdaHOPConfig) -> None:
        if not isinstance(config, AdaHOPConfig):
            raise ValueError(f"config must be an AdaHOPConfig, got {type(config).__name__}")
        self.__dict__["_config"] = config
        if self.rng_state.device.type != "meta":
            self.rng_state[0] = mix_seeds(config.seed, self.layer_id)
        self._refresh_numerics()

    @property
    def modes(self) -> dict | None:
        """Each GEMM's frozen mode; None while calibrating."""
        return self._modes

    @modes.setter
    def modes(self, modes: dict | None) -> None:
        self.__dict__["_modes"] = None if modes is None else dict(modes)
        self._refresh_numerics()

    @property
    def calls(self) -> int:
        """Training forwards so far (they seed stochastic rounding); reads the device counter."""
        return int(self.rng_state[1])

    @calls.setter
    def calls(self, value: int) -> None:
        self.rng_state[1] = int(value)

    @classmethod
    def from_float(cls, mod: nn.Linear, *, config: AdaHOPConfig, name: str = "") -> AdaHOPLinear:
        """Wrap ``mod`` (built on the meta device, then given ``mod``'s own parameters)."""
        if not isinstance(mod, nn.Linear):
            raise ValueError(f"from_float takes an nn.Linear, got {type(mod).__name__}")
        with torch.device("meta"):
            new = cls(mod.in_features, mod.out_features, bias=mod.bias is not None, config=config, name=name)
        new.weight = mod.weight
        new.bias = mod.bias
        new.rng_state = torch.zeros(2, dtype=torch.int64, device=mod.weight.device)
        new.config = config  # the prefix, now on a real device
        new.train(mod.training)
        return new

    # ---- calibration --------------------------------------------------------------------------
    @property
    def calibrating(self) -> bool:
        return self.modes is None

    def _observe(self, role: str, t: torch.Tensor) -> None:
        k = {"x": self.config.fprop.oe_k, "w": self.config.fprop.oe_k, "g": self.config.dgrad.oe_k}[role]
        parts = self._parts.get(role)
        if role == "w" and self.calibration_parts > 1 and len(self._parts["x"]) != 1:
            return  # a later part's weight (x is observed first): the same tensor as the first's
        # The quantization statistics (patterns.quant_error) are what the measured and loss-aware
        # policies read, and cost about a third more calibration time: only for them. The weight's
        # error profile along dim 0 too: dgrad quantizes it along N.
        part = tensor_part(t, k=k, quant=self.config.policy in QUANT_POLICIES,
                           profile_dims=(1, 0) if role == "w" else (1,))
        # (all on the device: the observation is added there, and read back at the freeze)
        if parts is None or self.calibration_parts == 1:
            self.calibration.add(role, observe_on_device([part], tau=self.config.tau, k=k))
            return
        parts.append(part)
        if len(parts) == self.calibration_parts:  # the micro-batch is whole: one observation
            self.calibration.add(role, observe_on_device(parts, tau=self.config.tau, k=k))
            parts.clear()

    def _after_calibration_step(self) -> None:
        # (the step count is host-side: only the freeze reads the observations back)
        if (self.freeze_when_calibrated and self.calibrating
                and self.calibration.steps >= self.config.calibration_steps):
            self.finish_calibration(wait_for_group=True)

    def finish_calibration(self, *, wait_for_group: bool = False) -> dict | None:
        """Vote the patterns, let the policy pick the modes, freeze them. Returns the modes. The
        calibration's one read of the device: its summary (``LayerCalibration.summary``).

        Under a policy over the whole model (``config.model_policy``) the layer's group decides
        (``calibration_group``): with ``wait_for_group`` (this layer's steps are complete) once
        every member's are, else now, freezing every calibrating member; returns None while the
        layer still waits."""
        if not self.config.adaptive:
            raise ValueError(f"recipe {self.config.recipe!r} is not adaptive: it has no calibration")
        if self.calibration.steps == 0:
            raise ValueError(f"layer {self.layer_name!r} has observed no backward pass yet")
        if self.config.model_policy is not None:
            group = self.calibration_group or CalibrationGroup([self])
            if wait_for_group:
                group.layer_complete(self)
            else:
                group.freeze()
            return None if self.calibrating else dict(self.modes)
        summary = self.calibration.summary()
        policy = self.config.policy_fn
        result = policy(summary) if policy is not None else table_policy(summary, self.config.policy)
        self.freeze_with(summary, result)
        return dict(self.modes)

    def freeze_with(self, summary: dict, result) -> None:
        """Freeze the layer with a policy's ``result`` for its calibration ``summary`` (the
        config's own rules applied after it: ``AdaHOPConfig.layer_modes``)."""
        modes, oe_ks = self.config.layer_modes(self.layer_name, *policy_result(result))
        self.patterns = {r: summary[r]["pattern"] for r in ("x", "w", "g")}
        self.__dict__["oe_ks"] = oe_ks or None
        self.modes = modes  # (after oe_ks: the numerics follow both)

    def set_modes(self, modes: dict, patterns: dict | None = None, oe_ks: dict | None = None) -> None:
        """Freeze the layer's modes (e.g. loaded from JSON): no calibration afterwards. ``oe_ks``:
        an OE k per GEMM in place of the config's (what the measured policy may choose)."""
        modes, oe_ks = policy_result({**modes, **({"oe_k": oe_ks} if oe_ks else {})})
        patterns = check_patterns(patterns) if patterns is not None else self.patterns
        self.patterns = patterns
        self.__dict__["oe_ks"] = oe_ks or None
        self.modes = modes

    # ---- forward -------------------------------------------------------------------------------
    def _refresh_numerics(self) -> None:
        """Make the ops' description of this layer's GEMMs (``layer.plan.numerics_key``) for the
        current config and modes. It is made here, when either changes, and not in the forward,
        so that a compiled forward only reads it (a string, guarded as a constant). Random-sign
        seeds are mix_seeds(seed, layer_id, gemm, 2): fixed per layer and GEMM, and part of the
        key only where a GEMM uses them."""
        config, modes = self.__dict__.get("_config"), self.__dict__.get("_modes")
        if config is None:
            return
        if modes is None:  # calibrating
            modes = self._IHT_MODES if config.calibration_gemms == "iht" else self._BF16_MODES
        prefix = mix_seeds(config.seed, self.layer_id)
        signs = tuple(mix_seeds_from(prefix, GEMM_INDEX[g], 2) if config.gemm(g).random_signs else None
                      for g in GEMMS)
        numerics = numerics_key(config, modes, signs, self.__dict__.get("oe_ks"))
        self.__dict__["_numerics"] = numerics
        # (made here for the same reason: ``shared_input`` compares them in a compiled forward)
        self.__dict__["_input_keys"] = tuple(None if key is None else repr(key)
                                             for key in (input_key(numerics, False), input_key(numerics, True)))

    def input_key(self, needs_backward: bool) -> str | None:
        """What this layer's GEMMs make of x (``layer.grouped.input_key``, as a string): layers
        that read one x and have equal keys can quantize it once (``shared_input``)."""
        return self._input_keys[1] if needs_backward else self._input_keys[0]  # (Dynamo 2.11 cannot index by a bool)

    @property
    def numerics(self) -> str:
        """The ops' description of this layer's GEMMs now (``layer.plan.numerics_key``): what an
        operand quantized ahead of a call (adahop.quantized_all_gather's weight) must match."""
        return self._numerics

    def _plan(self, device: torch.device, needs_backward: bool = True) -> LayerPlan:
        """The plan of the next call (its SR seeds read the current counter): for inspection;
        the forward passes the same through the ops."""
        return layer_plan(self._numerics, self.rng_state.clone(), device, needs_backward)

    _BF16_MODES = {g: "bf16" for g in GEMMS}
    _IHT_MODES = {g: "iht" for g in GEMMS}

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

    def _forward_adahop(self, x: torch.Tensor) -> torch.Tensor:
        x_TK = self.compute_input(x)
        needs_backward = self.needs_backward(x_TK)
        with torch.autocast(x.device.type, enabled=False):
            if self.calibrating and self.training and torch.is_grad_enabled():
                y = self._calibration_step(x_TK, needs_backward)
            else:
                y = torch.ops.adahop.linear_forward(x_TK, self.weight, self.call_rng_state(needs_backward),
                                                    self._numerics, needs_backward,
                                                    input_bound(x_TK, self._numerics))[0]
            if self.bias is not None:
                y = y + self.bias.to(x_TK.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def compute_input(self, x: torch.Tensor) -> torch.Tensor:
        """x as the ops take it: 2-D ``[T, in_features]``, in autocast's compute dtype where
        autocast is on (else x's own)."""
        device_type = x.device.type
        dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype
        return x.reshape(-1, self.in_features).to(dtype)

    def needs_backward(self, x_TK: torch.Tensor) -> bool:
        """Whether a backward can follow this call: what the forward must keep for wgrad."""
        return torch.is_grad_enabled() and (x_TK.requires_grad or self.weight.requires_grad)

    def call_rng_state(self, needs_backward: bool) -> torch.Tensor:
        """The SR chain state of a call: a forward with a backward advances the counter
        (evaluation leaves the SR sequence alone). The copy is what this call's backward reads."""
        rng_state = self.rng_state.clone()
        if needs_backward:
            self.rng_state[1] += 1
        return rng_state

    @torch.compiler.disable
    def _calibration_step(self, x_TK: torch.Tensor, needs_backward: bool) -> torch.Tensor:
        """A calibration forward (eager; its observations stay on the device until the freeze). With
        ``calibration_gemms="iht"`` the GEMMs run the ops with IHT + MXFP4 modes while x and w
        are observed here and g by a hook on the output's gradient (which also counts the step:
        the backward op keeps the numerics it was called with, so a freeze there is safe)."""
        if self.config.calibration_gemms == "bf16":
            # BF16 GEMMs draw no SR bits: the parts of a split micro-batch count as one call, so
            # that the draws after calibration are the unsplit run's (the trainer aligns a
            # data-parallel rank's counter once for them too)
            if needs_backward and not self._parts["x"]:
                self.rng_state[1] += 1
            return _CalibratingLinearFunction.apply(x_TK, self.weight, self)
        self._observe("x", x_TK)
        self._observe("w", self.weight.to(x_TK.dtype))
        y = torch.ops.adahop.linear_forward(x_TK, self.weight, self.call_rng_state(needs_backward), self._numerics,
                                            needs_backward, input_bound(x_TK, self._numerics))[0]
        if y.requires_grad:
            y.register_hook(self._calibration_backward)
        return y

    def _calibration_backward(self, g_TN: torch.Tensor) -> None:
        self._observe("g", g_TN)
        self._after_calibration_step()

    # ---- state ---------------------------------------------------------------------------------
    def get_extra_state(self) -> dict:
        return {
            "version": EXTRA_STATE_VERSION,
            "recipe": self.config.recipe,
            "calls": self.calls,
            "calibration": None if self.calibration is None else self.calibration.to_dict(),
            "patterns": None if self.patterns is None else dict(self.patterns),
            "modes": None if self.modes is None else dict(self.modes),
            "oe_k": None if self.oe_ks is None else dict(self.oe_ks),  # (absent before: the config's k)
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
            self.set_modes(state["modes"], oe_ks=state.get("oe_k"))
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
            status = (f"calibrating {self.calibration.steps}/{cfg.calibration_steps} steps "
                      f"({cfg.calibration_gemms} meanwhile)")
        else:
            status = "modes: " + ", ".join(f"{g}={self.modes[g]}" for g in GEMMS)
        pats = ""
        if self.patterns is not None:
            pats = "patterns: " + ", ".join(f"{r}={self.patterns[r]}" for r in ("x", "w", "g")) + ", "
        return f"{base}, recipe={cfg.recipe}, {pats}{status}"
