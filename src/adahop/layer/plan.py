"""The plan of a layer call: for each of its three GEMMs the mode and how each operand is quantized,
and which backend runs them.

``numerics_key`` writes a layer's settings as one string, the ``numerics`` argument of the custom
ops (``layer.ops``): for each GEMM its mode and how each operand is quantized (block, scale mode,
rounding, Hadamard size, random-sign seed, OE k), which weight dgrad multiplies by, the backend
name, (only where they are on) ``fprop_mean_bias`` and ``fprop_unbias``, and ``wgrad_input`` where it is not
"packed". Layers with the same settings share it (and the compiled code). ``layer_plan`` turns a key and
the layer's ``rng_state`` (int64 ``[prefix, call]``, its stochastic-rounding chain on the device:
``formats.rng.SRStream``) into the plan of one call, each SR operand's seed an ``SRStream``, derived
inside the kernels, so that no seed is read back to the host and each replay of a CUDA graph draws
new bits from the counter it finds.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass

import torch

from adahop.config import AdaHOPConfig, GemmConfig
from adahop.formats.rng import SRStream
from adahop.gemm_geometry import GEMMS
from adahop.ops.backends import get_backend
from adahop.ops.operand import OperandSpec


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
    fprop_mean_bias: bool = False  # AdaHOPConfig.fprop_mean_bias (adahop.mean_bias)
    fprop_unbias: bool = False  # AdaHOPConfig.fprop_unbias (adahop.unbias)
    wgrad_input: str = "packed"  # AdaHOPConfig.wgrad_input: where a quantized wgrad's x comes from


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
    key = {"backend": config.backend, "gemms": gemms, "dgrad_weight": config.dgrad_weight}
    for option in FPROP_OPTIONS:  # (only where on: every other layer's key stays as it was)
        if getattr(config, option):
            key[option] = True
    if config.wgrad_input != "packed":  # (likewise)
        key["wgrad_input"] = config.wgrad_input
    return json.dumps(key, sort_keys=True, separators=(",", ":"))


@functools.lru_cache(maxsize=1024)
def numerics_templates(numerics: str) -> tuple[str, tuple[GemmPlan, ...], str]:
    """The backend name, the three GEMM plans of a numerics key and which weight dgrad
    multiplies by. The plans' SR operands hold the seed 0, a placeholder: the seeds are the
    call's (``layer_plan`` gives each its stream), and nothing quantizes with a template."""
    d = json.loads(numerics)
    plans = []
    for g in d["gemms"]:
        cfg = GemmConfig(**{f.name: g[f.name] for f in dataclasses.fields(GemmConfig)})  # (mode: the layer's)
        plans.append(make_gemm_plan(cfg.mode, cfg, sr_seeds=(0, 0), signs_seed=g["signs_seed"]))
    return d["backend"], tuple(plans), d["dgrad_weight"]


# The forward's options a numerics key carries where they are on (AdaHOPConfig's fields of these names).
FPROP_OPTIONS = ("fprop_mean_bias", "fprop_unbias")


@functools.lru_cache(maxsize=1024)
def numerics_fprop_options(numerics: str) -> dict[str, bool]:
    """``{option: on}`` for each of ``FPROP_OPTIONS`` under a numerics key (cached: a caller must
    not change the dict)."""
    d = json.loads(numerics)
    return {option: bool(d.get(option, False)) for option in FPROP_OPTIONS}


@functools.lru_cache(maxsize=1024)
def numerics_wgrad_input(numerics: str) -> str:
    """``AdaHOPConfig.wgrad_input`` under a numerics key: "packed" (x quantized along T by the
    forward, saved) or "recompute" (x kept, quantized by the backward)."""
    return json.loads(numerics).get("wgrad_input", "packed")


def numerics_fprop_mean_bias(numerics: str) -> bool:
    """Whether a numerics key takes the activation's mean out of fprop's operand
    (``AdaHOPConfig.fprop_mean_bias``)."""
    return numerics_fprop_options(numerics)["fprop_mean_bias"]


def layer_plan(numerics: str, rng_state: torch.Tensor, device: torch.device, needs_backward: bool) -> LayerPlan:
    """The plan of one call: the key's GEMM plans with each SR operand's seed an ``SRStream`` of
    ``rng_state``."""
    backend_name, templates, dgrad_weight = numerics_templates(numerics)
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
                     dgrad_weight=dgrad_weight, wgrad_input=numerics_wgrad_input(numerics),
                     **numerics_fprop_options(numerics))
