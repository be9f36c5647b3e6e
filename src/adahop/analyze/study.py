"""``run_study``: the outlier study of a model on batches of real data (docs/analyze.md).

For ``steps`` batches: one forward + backward of the plain model (``collect.capture_step``; no
optimizer step, so every step sees the same weights and the steps differ in their data). Every
step, for every studied layer, the detector's statistics of X, W and G (``observe.tensor_stats``)
are recorded and fed to the layer's ``LayerCalibration``, exactly what calibration records. On
the first ``sqnr_steps`` steps, each of the layer's three GEMMs is also multiplied under every
strategy (``strategies.gemm_errors``): the expensive part, so by default one step. No dimension is
sampled: each GEMM is the one the step's batch gives (T = its tokens).

After the steps, each layer's patterns are the calibration vote over the steps and each policy
(a pure function of the calibration summary, as ``AdaHOPConfig.policy_fn``; by default lv2, lv1
and the measured policy, with its OE k chosen per GEMM and at ``policy_oe_k``) picks its modes,
run with OE k = ``policy_oe_k`` unless the policy chose k (``policy.policy_result``). The OE k
values measured include the measured policy's ladder (``patterns.quant_error.oe_k_ladder``).
``findings.summarize`` then computes the summary numbers, and ``report.write_report`` the report
folder.
"""

from __future__ import annotations

import functools
import math
import re
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import torch
from torch import nn

import adahop
from adahop.analyze.collect import capture_step, find_linears, lm_loss
from adahop.analyze.observe import tensor_stats
from adahop.analyze.strategies import (
    BLOCK_SIZE,
    DEFAULT_OE_KS,
    HADAMARD_SIZE,
    QuantCache,
    check_oe_ks,
    gemm_errors,
    layer_gemms,
    runnable_fp4_strategies,
    signs_seed,
    strategy_names,
    strategy_of_mode,
)
from adahop.config import DEFAULT_OE_K
from adahop.patterns.calibration import TENSOR_ROLES, LayerCalibration
from adahop.patterns.detect import DEFAULT_TAU, check_tau
from adahop.patterns.quant_error import oe_k_ladder
from adahop.policy import DEFAULT_HP_BUDGET, GEMMS, MeasuredPolicy, gemm_pattern_pairs, policy_result, table_policy

FORMAT = "adahop-outlier-study"
FORMAT_VERSION = 2  # 2: the measured policy (quantization statistics, picks with their k); no unit-RMS labels
DEFAULT_STEPS = 4
# Profiles of the quantization error along each tensor's feature dims (patterns.quant_error): the
# last dim of all three, and the weight's rows (N, dgrad's contraction dim) too.
PROFILE_DIMS = {"x": (1,), "w": (1, 0), "g": (1,)}
DEFAULT_SQNR_STEPS = 1


def default_policies(policy_oe_k: int = DEFAULT_OE_K,
                     hp_budget: float = DEFAULT_HP_BUDGET) -> dict[str, Callable[[Mapping], Mapping]]:
    """The strategy table at both levels (``policy.table_policy``) and the measured policy
    (``policy.MeasuredPolicy``) with ``hp_budget``: ``measured`` chooses each GEMM's OE k from
    the ladder of ``policy_oe_k``, ``measured_fixed_k`` runs OE with ``policy_oe_k`` (what a layer
    of the ``adahop_measured`` recipe runs while the layer takes k from its config)."""
    return {**{level: functools.partial(table_policy, level=level) for level in ("lv2", "lv1")},
            "measured": MeasuredPolicy(hp_budget),
            "measured_fixed_k": MeasuredPolicy(hp_budget, (policy_oe_k,) * 3)}


def _check_int(name: str, v, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
    return v


def block_and_kind(name: str) -> tuple[int | None, str]:
    """``layers.3.attention.wq`` -> (3, "attention.wq"): the first integer component is the
    block, what follows it the layer's kind (the whole name when there is no integer)."""
    parts = name.split(".")
    for i, p in enumerate(parts):
        if re.fullmatch(r"\d+", p):
            return int(p), ".".join(parts[i + 1:]) or name
    return None, name


def _progress(total: int, desc: str, enabled: bool, unit: str):
    if enabled:
        try:
            from tqdm.auto import tqdm

            return tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True, leave=False)
        except ImportError:
            pass
    return None


class _LayerRecord:
    def __init__(self, name: str, layer: nn.Linear):
        self.name = name
        self.block, self.kind = block_and_kind(name)
        self.in_features, self.out_features = layer.in_features, layer.out_features
        self.tokens: int | None = None
        self.steps = {r: [] for r in TENSOR_ROLES}
        self.calibration = LayerCalibration()
        self.first_w = None  # the weight's observation (the same at every step)
        self.gemms: dict[str, dict] = {}


def run_study(model: nn.Module, batches: Iterable, *, steps: int = DEFAULT_STEPS, sqnr_steps: int = DEFAULT_SQNR_STEPS,
              out: str | Path | None = None, loss_fn: Callable | None = None,
              module_filter: Callable[[nn.Module, str], bool] | None = None, tau: float = DEFAULT_TAU,
              oe_ks: Iterable[int] = DEFAULT_OE_KS, policy_oe_k: int = DEFAULT_OE_K,
              policies: Mapping[str, Callable[[Mapping], Mapping]] | None = None, seed: int = 0,
              progress: bool = True, info: Mapping | None = None) -> dict:
    """The outlier study of ``model`` on the first ``steps`` of ``batches`` (see the module doc).

    ``batches``: ``(inputs, targets)`` pairs for the default loss (mean cross-entropy of the
    logits), or anything ``loss_fn(model, batch) -> scalar`` takes. ``module_filter(module,
    name)``: which ``nn.Linear`` layers (default: those ``convert_to_adahop_training`` converts).
    ``oe_ks``: the OE k values measured (``policy_oe_k`` and its ladder are added); ``policies``:
    name -> pure function of a calibration summary (``AdaHOPConfig.policy_fn``), default
    ``default_policies(policy_oe_k)``;
    ``seed``: the random-signs seed of the ``iht_rs`` strategy (as ``AdaHOPConfig.seed``).
    ``info``: ``{"model": {...}, "data": {...}}`` descriptions kept in the report. With ``out``,
    the report folder is written there (``report.write_report``). Returns the study (the
    content of ``study.json``)."""
    from adahop.analyze.findings import summarize
    from adahop.analyze.report import check_out_dir, write_report

    _check_int("steps", steps, 1)
    _check_int("sqnr_steps", sqnr_steps, 0)
    sqnr_steps = min(sqnr_steps, steps)
    check_tau(tau)
    _check_int("policy_oe_k", policy_oe_k, 1)
    oe_ks = check_oe_ks((*check_oe_ks(oe_ks), policy_oe_k, *oe_k_ladder(policy_oe_k)))
    policies = dict(default_policies(policy_oe_k) if policies is None else policies)
    if not policies or not all(isinstance(n, str) and callable(f) for n, f in policies.items()):
        raise ValueError("policies must map names to functions summary -> {fprop, dgrad, wgrad: mode}")
    if out is not None:
        out = check_out_dir(out)
    layers = find_linears(model, module_filter)
    loss_fn = loss_fn or lm_loss
    records = {name: _LayerRecord(name, m) for name, m in layers.items()}
    skipped: dict[str, str] = {}
    cache = QuantCache()
    timing = {"capture_s": 0.0, "statistics_s": 0.0, "gemms_s": 0.0}
    losses = []
    start = time.perf_counter()
    was_training = model.training
    model.train()
    it = iter(batches)
    bar = _progress(steps, "outlier study", progress, "step")
    try:
        for step in range(steps):
            try:
                batch = next(it)
            except StopIteration:
                raise ValueError(f"the batches ran out after {step} of {steps} steps") from None
            t0 = time.perf_counter()
            loss, captured, left_out = capture_step(model, batch, layers, loss_fn)
            timing["capture_s"] += time.perf_counter() - t0
            losses.append(loss)
            for name, reason in left_out.items():
                if name not in skipped:
                    skipped[name] = f"step {step}: {reason}" if step else reason
            t0 = time.perf_counter()
            live = [n for n in records if n in captured and n not in skipped]
            shared: dict = {}  # one input read by several layers (wq, wk, wv): its statistics once
            for name in live:
                rec, c = records[name], captured[name]
                rec.tokens = rec.tokens or c.x_TK.shape[0]
                for role, t in (("x", c.x_TK), ("w", c.w_NK), ("g", c.g_TN)):
                    if role == "w" and rec.steps["w"]:  # no optimizer step: the first step's weight
                        s, obs = dict(rec.steps["w"][0]), rec.first_w
                    else:
                        key = (t.data_ptr(), tuple(t.shape), t.stride())
                        if key not in shared:
                            shared[key] = tensor_stats(t, tau=tau, k=policy_oe_k, profile_dims=PROFILE_DIMS[role])
                        s, obs = shared[key]
                        s = dict(s)
                        if role == "w":
                            rec.first_w = obs
                    rec.steps[role].append(s)
                    rec.calibration.add(role, obs)
            timing["statistics_s"] += time.perf_counter() - t0
            if step < sqnr_steps:
                t0 = time.perf_counter()
                inner = _progress(len(live), f"GEMMs of step {step + 1}", progress, "layer")
                for name in live:
                    _measure_gemms(records[name], captured[name], oe_ks, seed, cache)
                    if inner is not None:
                        inner.update()
                if inner is not None:
                    inner.close()
                timing["gemms_s"] += time.perf_counter() - t0
            cache.new_step()
            del captured
            if bar is not None:
                bar.set_postfix(loss=f"{loss:.3f}")
                bar.update()
    finally:
        if bar is not None:
            bar.close()
        model.train(was_training)
        cache.clear()
    timing["total_s"] = time.perf_counter() - start
    studied = [r for n, r in records.items() if n not in skipped]
    if not studied:
        reasons = "; ".join(f"{n}: {r}" for n, r in list(skipped.items())[:4])
        raise ValueError(f"every linear layer was left out of the study ({reasons}"
                         f"{' ...' if len(skipped) > 4 else ''})")
    layer_dicts = [_layer_dict(r, policies, policy_oe_k, sqnr_steps, oe_ks) for r in studied]
    info = dict(info or {})
    study = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "versions": {"adahop": adahop.__version__, "torch": torch.__version__},
        "model": info.get("model") or {"class": type(model).__name__,
                                        "parameters": sum(p.numel() for p in model.parameters())},
        "data": info.get("data") or {"description": "batches given to run_study"},
        "settings": {
            "steps": steps, "sqnr_steps": sqnr_steps, "tau": tau, "oe_ks": list(oe_ks), "policy_oe_k": policy_oe_k,
            "signs_seed": seed, "block_size": BLOCK_SIZE, "hadamard_size": HADAMARD_SIZE, "scale_mode": "even",
            "rounding": "rne", "high_precision": "bf16 operands, float32 accumulation", "reference": "float64",
            "backend": "reference", "torch_threads": torch.get_num_threads(),
        },
        "strategies": list(strategy_names(oe_ks)),
        "policies": list(policies),
        "losses": losses,
        "timing": timing,
        "layers": layer_dicts,
        "skipped": [{"name": n, "reason": r} for n, r in skipped.items()],
    }
    study["summary"] = summarize(study)
    if out is not None:
        write_report(study, out)
    return study


def _measure_gemms(rec: _LayerRecord, c, oe_ks, seed: int, cache: QuantCache) -> None:
    for gemm, op in layer_gemms(c.x_TK, c.w_NK, c.g_TN).items():
        errs = gemm_errors(op, oe_ks=oe_ks, signs=signs_seed(rec.name, gemm, seed), cache=cache,
                           weight_key=rec.name)
        m, kc, nc = op.shape
        d = rec.gemms.setdefault(gemm, {
            "M": m, "Kc": kc, "Nc": nc, "flops": op.flops, "hp_share": errs.hp_share,
            "sqnr_db": {s: [] for s in errs.sqnr_db}, "oe_energy_share": {s: [] for s in errs.oe_energy_share},
        })
        for s, v in errs.sqnr_db.items():
            d["sqnr_db"][s].append(v)
        for s, v in errs.oe_energy_share.items():
            d["oe_energy_share"][s].append(v)


def _mean(values) -> float:
    vals = [v for v in values if v is not None and math.isfinite(v)]
    return sum(vals) / len(vals) if vals else math.nan


def _layer_dict(rec: _LayerRecord, policies: Mapping, policy_oe_k: int, sqnr_steps: int, settings_oe_ks) -> dict:
    summary = rec.calibration.summary()
    patterns = {r: summary[r]["pattern"] for r in TENSOR_ROLES}
    pairs = gemm_pattern_pairs(patterns)
    n_steps = len(rec.steps["x"])
    step_pairs = [gemm_pattern_pairs({r: rec.steps[r][s]["pattern"] for r in TENSOR_ROLES}) for s in range(n_steps)]
    picks = {}
    for pname, fn in policies.items():
        try:
            modes, ks = policy_result(fn(summary))
        except ValueError as e:
            raise ValueError(f"policy {pname!r} on layer {rec.name!r}: {e}") from None
        picks[pname] = {}
        for g in GEMMS:
            k = ks.get(g, policy_oe_k) if modes[g] in ("iht+oe_left", "iht+oe_right") else None
            strategy = strategy_of_mode(modes[g], k)
            if strategy not in strategy_names(settings_oe_ks):
                raise ValueError(f"policy {pname!r} on layer {rec.name!r} picks {strategy} for {g}: OE k={k} was "
                                 f"not measured (measured: {list(settings_oe_ks)})")
            picks[pname][g] = {"mode": modes[g], "oe_k": k, "strategy": strategy}
    gemms = {}
    for g in GEMMS:
        d = {"pair": list(pairs[g]), "pairs": [list(p[g]) for p in step_pairs]}
        if g in rec.gemms:
            m = rec.gemms[g]
            cands = runnable_fp4_strategies(g, policy_oe_k)
            best = [max(cands, key=lambda s, i=i: m["sqnr_db"][s][i]) for i in range(sqnr_steps)]
            d.update({k: m[k] for k in ("M", "Kc", "Nc", "flops", "hp_share", "sqnr_db", "oe_energy_share")})
            d["mean_sqnr_db"] = {s: _mean(v) for s, v in m["sqnr_db"].items()}
            d["best"] = best
            d["best_sqnr_db"] = [m["sqnr_db"][s][i] for i, s in enumerate(best)]
        gemms[g] = d
    return {
        "name": rec.name, "block": rec.block, "kind": rec.kind, "in_features": rec.in_features,
        "out_features": rec.out_features, "tokens": rec.tokens,
        "tensors": {r: {"pattern": patterns[r], "votes": dict(rec.calibration.tensors[r].votes),
                        # the scalars: the profiles (one value per feature) would be most of the file
                        "mean": {k: v for k, v in summary[r].items() if k != "pattern" and not isinstance(v, list)},
                        "steps": rec.steps[r]} for r in TENSOR_ROLES},
        "gemms": gemms,
        "policies": picks,
    }
