"""The loss-aware policy: a model's high-precision budget spent where its loss needs it.

The measured policy (``policy.MeasuredPolicy``) decides each layer alone, maximising the sum of
its three GEMMs' predicted SQNRs in dB under a share of that layer's FLOPs. Two things it cannot
see: a dB of output SQNR is worth more to the loss in one layer than in another, and in one GEMM
than in another. This policy scores every candidate mode of every GEMM by its predicted increase
of the loss and spends one budget over the whole model (docs/method.md, 'The loss-aware policy').

The estimate, per layer (x [T, K], w [N, K], g = dL/dy [T, N], L the mean loss over the T tokens
of a calibration step, ||.||^2 the squared norms the calibration records, ``ENERGY``):

* **fprop.** An error e on the output y moves the loss by g . e + 1/2 e^T H e. The first term
  averages out over tokens (the rounding errors are not aligned with the gradient); the second,
  with H the Fisher of the per-token losses (T sum_t g_t g_t^T, as dL/dy = g carries the 1/T of
  the mean), taken diagonal, is 1/2 T sum g^2 e^2. With e uncorrelated with g in magnitude,
  sum g^2 e^2 = ||g||^2 ||e||^2 / (T N); and the GEMM's predicted NSR (``predicted_gemm_nsr``,
  relative to ||x||^2 ||w||^2 / K, the output energy of operands uncorrelated with each other)
  gives ||e||^2 = nsr ||x||^2 ||w||^2 / K. So

      predicted loss increase = nsr * exposure,   exposure = ||g||^2 ||x||^2 ||w||^2 / (2 N K).

* **dgrad, wgrad.** Their errors do not change the loss the model computes: they reach it only
  through the weight updates they perturb. The same second-order estimate of an update error
  scales with the squared step size (lr^2 ||dW||^2 against ||W||^2, ~1e-6 per step), which the
  calibration does not know: a backward GEMM's relative error is weighed as ``backward_weight``
  times the same relative error of its layer's output. The default, 0, gives the backward no
  budget: each backward GEMM runs its best mode without high precision (naive MXFP4 or IHT,
  by predicted NSR), and the whole budget goes to the forward, which carries the loss (on a
  pretrained model, every recipe's gap is its forward's: benchmarks/results/
  pretrained_forward_smollm2_cpu_2026-12-06).

The choice is a multiple-choice knapsack over all GEMMs of all layers: each GEMM takes one
candidate (mode, OE k), a candidate costs its high-precision FLOPs (its share of the GEMM times
T K N, an integer), the total at most ``budget`` of the model's GEMM FLOPs (all three GEMMs of
every deciding layer). Greedy by marginal gain per FLOP: each GEMM starts at its cheapest
candidate of least predicted loss (no high precision), its better candidates reduced to their
convex hull (loss against cost), and the upgrades are taken in order of loss saved per FLOP while
they fit; a GEMM whose next upgrade does not fit takes no more. What is left is filled with the
single swap that saves most and fits, until none does. The budget is never exceeded (integer
FLOPs).

Undefined statistics give a defined result: a layer without a finite, non-negative exposure (an
older calibration without ``ENERGY``, a gradient that overflowed) takes the median of the others'
(1 when none has one); a GEMM without finite predictions runs ``iht``; a layer whose size is
unknown gets no high precision.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping
from dataclasses import dataclass

from adahop.gemm_geometry import GEMMS
from adahop.patterns.observation import ENERGY
from adahop.policy import NAIVE_MARGIN_DB, OE_MODES, MeasuredPolicy, check_hp_budget

# The share of the model's GEMM FLOPs (all three GEMMs) in high precision: 3% is at most 9% of the
# forward's, where this policy spends it (with ``backward_weight`` 0).
DEFAULT_LOSS_AWARE_BUDGET = 0.03
BACKWARD_WEIGHT = 0.0  # a backward GEMM's relative error against its layer's output's (module doc)
# Naive MXFP4 wins a near tie, as in the measured policy: its predicted NSR counts this much less.
NAIVE_FACTOR = 10 ** (-NAIVE_MARGIN_DB / 10)


def _stat(summary: Mapping, role: str, name: str) -> float:
    v = summary.get(role, {}).get(name, math.nan) if isinstance(summary.get(role), Mapping) else math.nan
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else math.nan


def layer_flops(summary: Mapping) -> int | None:
    """T K N of the layer's GEMMs (each of its three has these multiply-adds), from the mean
    shapes of its calibration tensors; None when unknown."""
    t, k, n = _stat(summary, "x", "rows"), _stat(summary, "x", "cols"), _stat(summary, "w", "rows")
    if not all(math.isfinite(v) and v >= 1 for v in (t, k, n)):
        return None
    return round(t) * round(k) * round(n)


def loss_exposure(summary: Mapping) -> float:
    """The predicted loss increase per unit of the forward's relative output error:
    ||g||^2 ||x||^2 ||w||^2 / (2 N K) (module doc); NaN when a statistic is missing or not finite."""
    k, n = _stat(summary, "x", "cols"), _stat(summary, "w", "rows")
    ex, ew, eg = (_stat(summary, r, ENERGY) for r in ("x", "w", "g"))
    with_numbers = (k, n, ex, ew, eg)
    if not all(math.isfinite(v) and v >= 0 for v in with_numbers) or k < 1 or n < 1:
        return math.nan
    value = eg * ex * ew / (2 * n * k)
    return value if math.isfinite(value) else math.nan


@dataclass(frozen=True)
class _Option:
    mode: str
    k: int | None
    loss: float  # predicted loss increase (module doc)
    nsr: float  # the predicted NSR it comes from (naive MXFP4's with its margin): the tie-break
    cost: int  # high-precision FLOPs
    hp_share: float


@dataclass(frozen=True)
class LossAwarePolicy:
    """The loss-aware policy (module doc): ``policy(summaries)`` for ``{layer: calibration
    summary}`` returns ``{layer: {fprop, dgrad, wgrad: mode, "oe_k": {gemm: k}}}``, at most
    ``budget`` of the layers' GEMM FLOPs in high precision together. ``oe_k``: as in
    ``MeasuredPolicy`` (None: each OE GEMM's k chosen from the ladder the calibration observed)."""

    budget: float = DEFAULT_LOSS_AWARE_BUDGET
    backward_weight: float = BACKWARD_WEIGHT
    oe_k: tuple[int, int, int] | None = None

    def __post_init__(self):
        check_hp_budget(self.budget)
        w = self.backward_weight
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not (math.isfinite(w) and w >= 0):
            raise ValueError(f"backward_weight must be a finite number >= 0, got {w!r}")
        if self.oe_k is not None:  # (checked as the measured policy checks it)
            object.__setattr__(self, "oe_k", MeasuredPolicy(oe_k=self.oe_k).oe_k)

    def options(self, summary: Mapping, gemm: str, exposure: float, flops: int | None) -> list[_Option]:
        """Every candidate of ``gemm`` with a finite prediction, priced; ``iht`` alone when none."""
        weight = 1.0 if gemm == "fprop" else self.backward_weight
        out = []
        for mode, k, db, hp in MeasuredPolicy(1.0, self.oe_k).candidates(summary, gemm):
            nsr = 0.0 if db == math.inf else 10 ** (-db / 10)
            nsr *= NAIVE_FACTOR if mode == "mxfp4" else 1.0
            if hp > 0 and flops is None:
                continue  # a size unknown: no price, no high precision
            cost = 0 if hp <= 0 else round(hp * flops)
            out.append(_Option(mode, k if mode in OE_MODES else None, weight * exposure * nsr, nsr, cost, hp))
        return out or [_Option("iht", None, 0.0, math.nan, 0, 0.0)]

    def decide(self, summaries: Mapping[Hashable, Mapping]) -> dict:
        """``{layer: {gemm: {"mode", "oe_k", "predicted_loss", "hp_share"}}}``: the choice and its
        reasons (module doc)."""
        names = list(summaries)
        flops = {n: layer_flops(summaries[n]) for n in names}
        exposure = {n: loss_exposure(summaries[n]) for n in names}
        known = sorted(v for v in exposure.values() if math.isfinite(v))
        fallback = known[len(known) // 2] if known else 1.0
        exposure = {n: v if math.isfinite(v) else fallback for n, v in exposure.items()}
        items = [(n, g) for n in names for g in GEMMS]
        options = {item: self.options(summaries[item[0]], item[1], exposure[item[0]], flops[item[0]])
                   for item in items}
        total = 3 * sum(f for f in flops.values() if f is not None)
        left = math.floor(self.budget * total)
        chosen = {}
        upgrades = []  # (gain per FLOP, order, item, step, option)
        for order, item in enumerate(items):
            opts = sorted(options[item], key=lambda o: (o.cost, o.loss, o.nsr if math.isfinite(o.nsr) else math.inf))
            hull = [opts[0]]
            for o in opts[1:]:  # the better ones for more FLOPs, on their lower convex hull
                if o.cost == hull[-1].cost or not o.loss < hull[-1].loss:
                    continue
                while len(hull) > 1 and _rate(hull[-2], hull[-1]) <= _rate(hull[-1], o):
                    hull.pop()
                hull.append(o)
            chosen[item] = hull[0]
            left -= hull[0].cost  # (0, unless a GEMM has no candidate without high precision)
            upgrades += [(_rate(a, b), order, item, step, b) for step, (a, b) in enumerate(zip(hull, hull[1:]))]
        if left < 0:  # the cheapest candidates alone exceed the budget: the cheapest of each, and no more
            return self._result(chosen)
        upgrades.sort(key=lambda u: (-u[0], u[1], u[3]))
        step_of = dict.fromkeys(items, 0)
        blocked = set()
        for _, _, item, step, option in upgrades:
            if item in blocked or step != step_of[item]:
                continue
            extra = option.cost - chosen[item].cost
            if extra > left:
                blocked.add(item)  # its later upgrades build on this one
                continue
            chosen[item], left, step_of[item] = option, left - extra, step + 1
        while True:  # the rest: the single swap that saves the most loss and fits
            best = None
            for item in items:
                for o in options[item]:
                    extra, saved = o.cost - chosen[item].cost, chosen[item].loss - o.loss
                    if saved > 0 and extra <= left and (best is None or saved > best[0]):
                        best = (saved, item, o, extra)
            if best is None:
                break
            _, item, o, extra = best
            chosen[item], left = o, left - extra
        return self._result(chosen)

    @staticmethod
    def _result(chosen: dict) -> dict:
        out: dict = {}
        for (name, gemm), o in chosen.items():
            out.setdefault(name, {})[gemm] = {"mode": o.mode, "oe_k": o.k, "predicted_loss": o.loss,
                                              "hp_share": o.hp_share}
        return out

    def __call__(self, summaries: Mapping[Hashable, Mapping]) -> dict:
        out = {}
        for name, picks in self.decide(summaries).items():
            modes = {g: picks[g]["mode"] for g in GEMMS}
            if self.oe_k is None:
                modes["oe_k"] = {g: p["oe_k"] for g, p in picks.items() if p["oe_k"] is not None}
            out[name] = modes
        return out


def _rate(a: _Option, b: _Option) -> float:
    """Loss saved per FLOP going from ``a`` to the costlier ``b``."""
    return (a.loss - b.loss) / (b.cost - a.cost)
