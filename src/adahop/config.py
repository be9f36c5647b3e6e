"""Configuration: per-GEMM transform settings and the training recipes built from them.

``AdaHOPConfig.from_recipe_name(name)`` gives each recipe (docs/method.md, 'Recipes'):

==============  ===============================================================================
recipe          what it does
==============  ===============================================================================
``bf16``        every GEMM in high precision (the baseline)
``mxfp4``       naive MXFP4 on every GEMM, no transform
``mxfp4_iht``   block Hadamard along the inner dim (IHT) on every GEMM ("MXFP4 + Hadamard")
``tseng``       Tseng et al. 2025: random-sign Hadamard + SR on all operands of the backward
                GEMMs, ``rceil`` scales there (nothing saturates, so SR is unbiased: the role of
                their 3/4 pre-scaling). Their forward stays in BF16; **decision**: ours is naive
                MXFP4, so that every recipe quantizes all three GEMMs and they compare fairly.
``adahop_lv2``  AdaHOP: calibrate, then the strategy table; (col, col) pairs run in BF16
``adahop_lv1``  AdaHOP with (col, col) as IHT + OE-right (less memory, the paper's Lv1)
``adahop_measured``  calibrate, then the measured policy: each GEMM's mode from how well its
                operands quantize under each mode, at most ``hp_budget`` (8%) of the FLOPs in
                high precision (``policy.MeasuredPolicy``)
``adahop_loss_aware``  calibrate, then the loss-aware policy: the modes of every GEMM of the
                model chosen together, by their predicted effect on the loss, at most
                ``hp_budget`` (3%) of the model's GEMM FLOPs in high precision
                (``loss_aware_policy.LossAwarePolicy``)
==============  ===============================================================================

These are the numerics recipes. A recipe may add a precision schedule (a BF16 phase, BF16 blocks:
``adahop.schedule``): ``adahop.recipe(name)`` (``adahop.recipes``) gives every recipe, these and
the scheduled ones such as ``adahop_lv2_tail``, ``adahop train``'s default.

Rounding (docs/method.md, 'Stochastic rounding'): RNE for X and W, SR for G, unless a recipe says otherwise. Every
GEMM has its own ``GemmConfig`` (Hadamard size, random signs, OE k, rounding of each operand,
scale mode), so a policy or an experiment changes one GEMM without touching the others.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from adahop.formats.mxfp4 import DEFAULT_BLOCK_SIZE, ROUNDINGS, SCALE_MODES, check_block_size, check_choice
from adahop.formats.rng import check_seed
from adahop.loss_aware_policy import DEFAULT_LOSS_AWARE_BUDGET, LossAwarePolicy
from adahop.ops.backends import backend_choices, backend_names
from adahop.patterns.detect import DEFAULT_TAU, check_tau
from adahop.policy import DEFAULT_HP_BUDGET, GEMM_MODES, GEMMS, POLICIES, MeasuredPolicy, check_hp_budget, check_modes
from adahop.transforms.hadamard import DEFAULT_HADAMARD_SIZE, check_hadamard_size

# Where the MXFP4 GEMMs run: the backends of the registry in ops/backends (docs/kernels.md,
# 'Backends and dispatch'). "auto" picks the fastest one the device has. These are the built-in
# ones; AdaHOPConfig.backend also takes any registered later (backend_choices()).
BACKEND_NAMES = backend_names()
BACKEND_CHOICES = backend_choices()
DEFAULT_OE_K = 64
DEFAULT_CALIBRATION_STEPS = 30
CALIBRATION_GEMMS = ("bf16", "iht")
# Which weight dgrad multiplies by (docs/method.md, 'One weight for the forward and dgrad'):
# "master", the layer's weight quantized on its own (the paper), or "forward", the weight the
# forward GEMM multiplied by.
DGRAD_WEIGHTS = ("master", "forward")
# Where a quantized wgrad's x comes from (docs/method.md, 'What the forward keeps for wgrad'):
# "packed", x quantized along the tokens in the forward and saved (4.25 bits a value); or
# "recompute", x itself kept and quantized in the backward, which a compiled model need not keep
# at all (the partitioner recomputes x from what its producer keeps). The same quantized values.
WGRAD_INPUTS = ("packed", "recompute")
# The names (last component) of attention's value projections: adahop's Llama and Hugging Face's.
VALUE_PROJECTIONS = ("wv", "v_proj")


def is_value_projection(name: str) -> bool:
    """Whether the layer named ``name`` (its qualified name in the model) is an attention value
    projection (``VALUE_PROJECTIONS``), whose forward ``AdaHOPConfig.value_fprop`` sets."""
    return name.rsplit(".", 1)[-1] in VALUE_PROJECTIONS


@dataclass(frozen=True)
class GemmConfig:
    """How one GEMM C = A B is quantized when it runs in MXFP4.

    ``mode`` is used by non-adaptive recipes; adaptive ones take the mode from the policy after
    calibration. A is the left operand (X in fprop, G in dgrad, G^T in wgrad), B the right one
    (W^T, W, X)."""

    mode: str = "iht"
    hadamard_size: int = DEFAULT_HADAMARD_SIZE
    random_signs: bool = False
    oe_k: int = DEFAULT_OE_K
    a_rounding: str = "rne"
    b_rounding: str = "rne"
    scale_mode: str = "even"
    block_size: int = DEFAULT_BLOCK_SIZE

    def __post_init__(self):
        check_choice("mode", self.mode, GEMM_MODES)
        check_hadamard_size(self.hadamard_size)
        check_block_size(self.block_size)
        check_choice("a_rounding", self.a_rounding, ROUNDINGS)
        check_choice("b_rounding", self.b_rounding, ROUNDINGS)
        check_choice("scale_mode", self.scale_mode, SCALE_MODES)
        if not isinstance(self.random_signs, bool):
            raise ValueError(f"random_signs must be a bool, got {self.random_signs!r}")
        if isinstance(self.oe_k, bool) or not isinstance(self.oe_k, int) or self.oe_k < 1:
            raise ValueError(f"oe_k must be a positive int, got {self.oe_k!r}")


@dataclass(frozen=True)
class AdaHOPConfig:
    """Everything a converted layer needs to know. Build it with ``from_recipe_name``."""

    recipe: str = "adahop_lv2"
    fprop: GemmConfig = field(default_factory=GemmConfig)
    dgrad: GemmConfig = field(default_factory=lambda: GemmConfig(a_rounding="sr"))
    wgrad: GemmConfig = field(default_factory=lambda: GemmConfig(a_rounding="sr"))
    # Adaptive recipes calibrate and let ``policy`` choose each GEMM's mode: a level of the
    # strategy table ("lv2", "lv1"), "measured" (``policy.MeasuredPolicy``) or "loss_aware" (one
    # decision over all the layers converted together: ``model_policy``).
    adaptive: bool = True
    policy: str = "lv2"
    # Optional replacement of the table: summary -> {fprop, dgrad, wgrad: mode} (see policy.py).
    # With policy="measured" and none given, the config makes it: the measured policy with
    # ``hp_budget``, choosing each OE GEMM's k around its ``oe_k`` (remade whenever the config is).
    policy_fn: Callable[[Mapping], Mapping] | None = None
    # The measured policy's budget: the share of a layer's GEMM FLOPs in high precision; the
    # loss-aware policy's: the share of the GEMM FLOPs of all the layers converted together.
    hp_budget: float = DEFAULT_HP_BUDGET
    calibration_steps: int = DEFAULT_CALIBRATION_STEPS
    # What the GEMMs run while calibrating: "bf16" (the paper's calibration) or "iht" (every GEMM
    # IHT + MXFP4, the mxfp4_iht recipe's numerics: each layer's forward saves x packed, not in
    # BF16, for the backward, as the fixed MXFP4 recipes do; linear.py). X, W and G are observed
    # in BF16 either way.
    calibration_gemms: str = "bf16"
    # "forward": dgrad's W is the forward GEMM's dequantized weight (rotated back), which dgrad
    # quantizes in its own mode, so the backward differentiates the function the forward ran.
    # A plain-MXFP4 forward then quantizes W with one scale per 32 x 32 tile, and a plain-MXFP4
    # dgrad multiplies by the very same quantized W (formats.mxfp4.fake_quantize_mxfp4_tiles).
    dgrad_weight: str = "master"
    # The forward GEMM's mode in attention's value projections (``is_value_projection``), in place
    # of the policy's or the recipe's; None: theirs. Attention averages V's output over tokens,
    # which shrinks the activation's quantization error (different in every token) and keeps
    # the weight's (the same in every token, on activations whose largest channels every token
    # shares): IHT lowers the first and raises the second (docs/method.md, 'The value
    # projection's forward').
    value_fprop: str | None = None
    # Layers that read one activation (q, k, v; w1, w3 in ``llama.model``) quantize it once
    # where their settings for it agree: the same bits as quantizing it per layer, fewer passes
    # and fewer saved copies (``shared_input``; measured faster and smaller at 1B: docs/method.md,
    # 'Layers that read one activation'). False calls the layers one by one.
    share_input: bool = True
    tau: float = DEFAULT_TAU
    backend: str = "auto"
    seed: int = 0
    # Under FSDP2, all-gather each layer's weight as the forward GEMM's MXFP4 operand (4.25 bits a
    # value, not bf16's 16) once its modes allow, the same bits as gathering it whole
    # (adahop.quantized_all_gather; docs/distributed.md). The converted weights are set up for it;
    # the model is sharded with FSDP2's own fully_shard. Needs dgrad_weight "forward".
    quantized_all_gather: bool = False
    # Take the activation's mean over tokens out of the forward GEMM's MXFP4 operand and add it
    # back as a rank-one GEMV in x's dtype (``adahop.mean_bias``, which gives the numerics; the
    # backward is unchanged). Done above the backends (``layer.gemms``): every backend runs it.
    fprop_mean_bias: bool = False
    # Scale the forward GEMM's MXFP4 product by per-row factors of x and W that undo round to
    # nearest's shrink toward zero (``adahop.unbias``, which gives the numerics; the backward is
    # unchanged). Computed with the reference quantization on any backend: an experiment.
    fprop_unbias: bool = False
    # What a quantized wgrad reads of x (``WGRAD_INPUTS``): "packed", x quantized along the
    # tokens by the forward and saved; "recompute", x itself, quantized in the backward. The
    # second keeps nothing 4-bit from the forward: eager, autograd keeps x (bfloat16, more than
    # the packed form); under ``torch.compile`` the partitioner rematerializes x in the backward
    # from what its producer keeps anyway (RMSNorm's input, SwiGLU's two halves, attention's
    # output), so the layer's saved activation is gone, at the price of that recomputation and a
    # quantization pass over x in the backward.
    wgrad_input: str = "packed"

    def __post_init__(self):
        for gemm in GEMMS:
            if not isinstance(getattr(self, gemm), GemmConfig):
                raise ValueError(f"{gemm} must be a GemmConfig, got {getattr(self, gemm)!r}")
        check_choice("policy", self.policy, POLICIES)
        check_hp_budget(self.hp_budget)
        check_choice("backend", self.backend, backend_choices())
        check_choice("calibration_gemms", self.calibration_gemms, CALIBRATION_GEMMS)
        check_choice("dgrad_weight", self.dgrad_weight, DGRAD_WEIGHTS)
        check_choice("wgrad_input", self.wgrad_input, WGRAD_INPUTS)
        if self.dgrad_weight == "forward":
            if self.fprop.b_rounding != "rne":
                raise ValueError("dgrad_weight 'forward' recomputes the forward's weight in the backward: "
                                 f"fprop's b_rounding must be 'rne', got {self.fprop.b_rounding!r}")
        if self.value_fprop is not None:
            check_choice("value_fprop", self.value_fprop, GEMM_MODES)
            if not self.adaptive and set(self.fixed_modes().values()) == {"bf16"}:
                raise ValueError(f"value_fprop is for recipes with MXFP4 GEMMs; recipe {self.recipe!r} runs every "
                                 "GEMM in BF16")
        check_tau(self.tau)
        check_seed(self.seed)
        for flag in ("adaptive", "share_input", "quantized_all_gather", "fprop_mean_bias", "fprop_unbias"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{flag} must be a bool, got {getattr(self, flag)!r}")
        steps = self.calibration_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"calibration_steps must be an int >= 1, got {steps!r}")
        if not self.adaptive:
            check_modes(self.fixed_modes())
        if self.quantized_all_gather:
            if self.dgrad_weight != "forward":
                raise ValueError("quantized_all_gather gathers only the forward GEMM's quantized weight: it needs "
                                 f"dgrad_weight 'forward' (--dgrad-weight forward), got {self.dgrad_weight!r}")
            if not self.adaptive and set(self.fixed_modes().values()) == {"bf16"}:
                raise ValueError(f"quantized_all_gather: recipe {self.recipe!r} runs no MXFP4 GEMM, there is nothing "
                                 "to gather quantized")
        for option in ("fprop_mean_bias", "fprop_unbias"):
            if getattr(self, option):
                self._check_fprop_option(option)
        if self.policy == "loss_aware" and self.policy_fn is not None:
            raise ValueError("policy 'loss_aware' decides over all the layers at once (model_policy); a per-layer "
                             "policy_fn cannot replace it: give policy_fn with policy 'lv2', 'lv1' or 'measured'")
        if self.policy == "measured" and (self.policy_fn is None or isinstance(self.policy_fn, _ConfigMeasuredPolicy)):
            # k is part of the choice (from k/4 to 2k of each GEMM's oe_k: quant_error.oe_k_ladder)
            object.__setattr__(self, "policy_fn", _ConfigMeasuredPolicy(self.hp_budget, None))

    def _check_fprop_option(self, option: str) -> None:
        """fprop_mean_bias's and fprop_unbias's limits: both need the weight in high precision (the
        GEMV; the weight's factors), and an MXFP4 forward to act on."""
        if self.quantized_all_gather:
            raise ValueError(f"{option} needs the weight in high precision in the forward: it cannot be combined "
                             "with quantized_all_gather")
        if not self.adaptive and self.fprop.mode == "bf16":
            raise ValueError(f"{option} is for recipes with an MXFP4 forward; recipe {self.recipe!r} runs fprop "
                             "in BF16")

    @property
    def model_policy(self) -> LossAwarePolicy | None:
        """The policy over the whole model (``{layer: summary} -> {layer: modes}``) of policy
        "loss_aware", with ``hp_budget`` (``calibration_group`` runs it); None for a per-layer
        policy."""
        return LossAwarePolicy(self.hp_budget) if self.policy == "loss_aware" else None

    def gemm(self, name: str) -> GemmConfig:
        check_choice("gemm", name, GEMMS)
        return getattr(self, name)

    def fixed_modes(self) -> dict[str, str]:
        """The per-GEMM modes of a non-adaptive recipe."""
        return {g: self.gemm(g).mode for g in GEMMS}

    def layer_modes(self, name: str, modes: Mapping[str, str], oe_ks: Mapping[str, int] | None = None
                    ) -> tuple[dict[str, str], dict[str, int] | None]:
        """``modes`` (and the OE k per GEMM a policy chose) of the layer named ``name`` after the
        config's own rules: ``value_fprop`` in a value projection (its forward's k, if the
        policy chose one, dropped: an OE mode there runs the config's)."""
        modes, oe_ks = dict(modes), dict(oe_ks) if oe_ks else None
        if self.value_fprop is not None and is_value_projection(name):
            modes["fprop"] = self.value_fprop
            if oe_ks:
                oe_ks.pop("fprop", None)
        return modes, oe_ks or None

    def replace(self, **changes) -> AdaHOPConfig:
        return dataclasses.replace(self, **changes)

    def with_gemm_settings(self, **changes) -> AdaHOPConfig:
        """The same config with ``changes`` (GemmConfig fields, e.g. ``oe_k=8``) applied to all
        three GEMMs."""
        return dataclasses.replace(
            self, **{g: dataclasses.replace(self.gemm(g), **changes) for g in GEMMS}
        )

    def to_dict(self) -> dict:
        """Plain data (JSON-ready). A custom ``policy_fn`` is recorded by its name only: a function
        cannot be stored, and a calibrated model's modes are in its state_dict anyway."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for gemm in GEMMS:
            d[gemm] = dataclasses.asdict(d[gemm])
        fn = d["policy_fn"]
        if isinstance(fn, _ConfigMeasuredPolicy):
            d["policy_fn"] = None  # made from the other fields again
        elif fn is not None:
            d["policy_fn"] = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
        return d

    @classmethod
    def from_dict(cls, d: Mapping) -> AdaHOPConfig:
        """The config ``to_dict`` wrote (``policy_fn`` comes back as None: see ``to_dict``)."""
        if not isinstance(d, Mapping):
            raise ValueError(f"an AdaHOPConfig is read from a mapping, got {type(d).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown AdaHOPConfig fields {unknown}; known: {sorted(known)}")
        fields = {k: v for k, v in d.items() if k != "policy_fn"}
        for gemm in GEMMS:
            if gemm in fields:
                g = fields[gemm]
                if not isinstance(g, Mapping):
                    raise ValueError(f"{gemm} must be a mapping of GemmConfig fields, got {g!r}")
                gemm_known = {f.name for f in dataclasses.fields(GemmConfig)}
                if set(g) - gemm_known:
                    raise ValueError(f"unknown GemmConfig fields {sorted(set(g) - gemm_known)} in {gemm}")
                fields[gemm] = GemmConfig(**g)
        return cls(**fields)

    @classmethod
    def from_recipe_name(cls, name: str, **overrides) -> AdaHOPConfig:
        """One of ``RECIPES``; keyword overrides replace fields of the result. A scheduled recipe
        (``adahop.recipes.SCHEDULED_RECIPES``, e.g. ``adahop_lv2_tail``) is a ValueError naming
        ``adahop.recipe``, which gives its config and its schedule: a config alone would drop the
        schedule without a word."""
        if name not in RECIPES:
            if name in SCHEDULED_RECIPE_REFUSALS:
                raise ValueError(SCHEDULED_RECIPE_REFUSALS[name])
            raise ValueError(f"unknown recipe {name!r}; known recipes: {tuple(RECIPES)}")
        return dataclasses.replace(RECIPES[name](), **overrides)


class _ConfigMeasuredPolicy(MeasuredPolicy):
    """The measured policy an ``AdaHOPConfig`` with policy="measured" makes from its own fields
    (a subclass only to tell it from one a user passes as ``policy_fn``)."""


def _uniform(recipe: str, mode: str) -> AdaHOPConfig:
    return AdaHOPConfig(
        recipe=recipe,
        fprop=GemmConfig(mode=mode),
        dgrad=GemmConfig(mode=mode, a_rounding="sr"),
        wgrad=GemmConfig(mode=mode, a_rounding="sr"),
        adaptive=False,
    )


def bf16() -> AdaHOPConfig:
    return _uniform("bf16", "bf16")


def mxfp4() -> AdaHOPConfig:
    return _uniform("mxfp4", "mxfp4")


def mxfp4_iht() -> AdaHOPConfig:
    return _uniform("mxfp4_iht", "iht")


def tseng() -> AdaHOPConfig:
    backward = GemmConfig(
        mode="iht", random_signs=True, a_rounding="sr", b_rounding="sr", scale_mode="rceil"
    )
    return AdaHOPConfig(
        recipe="tseng", fprop=GemmConfig(mode="mxfp4"), dgrad=backward, wgrad=backward, adaptive=False
    )


def adahop_lv2() -> AdaHOPConfig:
    return AdaHOPConfig(recipe="adahop_lv2", policy="lv2")


def adahop_lv1() -> AdaHOPConfig:
    return AdaHOPConfig(recipe="adahop_lv1", policy="lv1")


def adahop_measured() -> AdaHOPConfig:
    return AdaHOPConfig(recipe="adahop_measured", policy="measured")


def adahop_loss_aware() -> AdaHOPConfig:
    return AdaHOPConfig(recipe="adahop_loss_aware", policy="loss_aware", hp_budget=DEFAULT_LOSS_AWARE_BUDGET)


# Why from_recipe_name refuses each recipe of adahop.recipes.SCHEDULED_RECIPES (numerics plus a
# precision schedule), by name. adahop.recipes fills it as it defines them: it is built on this
# module, which therefore cannot import it (no import cycle: tests/test_layout.py), and the package
# imports it, so it is filled before any call.
SCHEDULED_RECIPE_REFUSALS: dict[str, str] = {}

RECIPES: dict[str, Callable[[], AdaHOPConfig]] = {
    "bf16": bf16,
    "mxfp4": mxfp4,
    "mxfp4_iht": mxfp4_iht,
    "tseng": tseng,
    "adahop_lv2": adahop_lv2,
    "adahop_lv1": adahop_lv1,
    "adahop_measured": adahop_measured,
    "adahop_loss_aware": adahop_loss_aware,
}
