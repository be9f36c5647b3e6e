"""AdaHOP's strategy: from the outlier patterns of X, W, G to a mode for each of the three GEMMs.

Each GEMM is written C = A B with A: [M, Kc] and B: [Kc, Nc] and read as fed to the matmul; a
transposed tensor swaps row and column (docs/method.md, 'Strategy per GEMM'; the operands and
which of them is transposed come from ``gemm_geometry.GEOMETRY``):

    GEMM   A    B    pair of patterns
    fprop  X    W^T  (pat(X),       flip(pat(W)))
    dgrad  G    W    (pat(G),       pat(W))
    wgrad  G^T  X    (flip(pat(G)), pat(X))

For A, "row" means outer-dim (M) outliers and "col" inner-dim ones; for B, "row" is inner-dim and
"col" outer-dim. The inner Hadamard transform (IHT) tames inner-dim outliers only; outlier
extraction (OE) moves the k largest outer-dim slices to the high-precision path:

    A \\ B   row   none          col
    row     iht   iht+oe_left   iht+oe_right
    none    iht   iht           iht+oe_right
    col     iht   iht           Lv2: bf16   Lv1: iht+oe_right

OE-left in wgrad would need X in high precision, which the forward does not keep: iht there.

The policy is a pure function of a calibration summary (per role: pattern and mean statistics,
see ``patterns.calibration``) so that a better policy can replace the table without touching the
layers (``AdaHOPConfig.policy_fn``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from adahop.gemm_geometry import GEMMS, GEOMETRY
from adahop.patterns.detect import PATTERNS

GEMM_MODES = ("bf16", "mxfp4", "iht", "iht+oe_left", "iht+oe_right")
POLICY_LEVELS = ("lv1", "lv2")  # the strategy table's levels
# AdaHOPConfig.policy: a table level, the measured policy, or the loss-aware policy (a decision over
# the whole model: adahop.loss_aware_policy)
POLICIES = (*POLICY_LEVELS, "measured", "loss_aware")
# The policies that read the calibration's quantization statistics (patterns.quant_error), which
# cost about a third more calibration time: only they record them.
QUANT_POLICIES = ("measured", "loss_aware")

_TABLE = {
    ("row", "row"): "iht",
    ("row", "none"): "iht+oe_left",
    ("row", "col"): "iht+oe_right",
    ("none", "row"): "iht",
    ("none", "none"): "iht",
    ("none", "col"): "iht+oe_right",
    ("col", "row"): "iht",
    ("col", "none"): "iht",
    ("col", "col"): None,  # level-dependent
}
_COL_COL = {"lv2": "bf16", "lv1": "iht+oe_right"}


def flip(pattern: str) -> str:
    """Pattern of the transposed tensor."""
    return {"row": "col", "col": "row", "none": "none"}[pattern]


def gemm_pattern_pairs(patterns: Mapping[str, str]) -> dict[str, tuple[str, str]]:
    """(A, B) pattern pair of each GEMM from the patterns of x, w, g."""
    for role in ("x", "w", "g"):
        if patterns.get(role) not in PATTERNS:
            raise ValueError(f"pattern of {role!r} must be one of {PATTERNS}, got {patterns.get(role)!r}")
    return {name: (flip(patterns[gm.a.role]) if gm.a_transposed else patterns[gm.a.role],
                   flip(patterns[gm.b.role]) if gm.b_transposed else patterns[gm.b.role])
            for name, gm in GEOMETRY.items()}


def table_mode(pair: tuple[str, str], level: str) -> str:
    """Mode of the strategy table for a pattern pair (before the wgrad fallback)."""
    if level not in POLICY_LEVELS:
        raise ValueError(f"policy level must be one of {POLICY_LEVELS}, got {level!r}")
    mode = _TABLE[pair]
    return _COL_COL[level] if mode is None else mode


def modes_from_patterns(patterns: Mapping[str, str], level: str = "lv2") -> dict[str, str]:
    """The AdaHOP table: per-GEMM modes from the patterns of x, w and g."""
    modes = {gemm: table_mode(pair, level) for gemm, pair in gemm_pattern_pairs(patterns).items()}
    if modes["wgrad"] == "iht+oe_left":
        modes["wgrad"] = "iht"  # needs X in high precision, which is not saved
    return modes


def table_policy(summary: Mapping[str, Mapping], level: str) -> dict[str, str]:
    """The default policy: the table applied to the voted patterns of a calibration summary."""
    return modes_from_patterns({r: summary[r]["pattern"] for r in ("x", "w", "g")}, level)


def check_modes(modes: Mapping[str, str]) -> dict[str, str]:
    """Validate a {fprop, dgrad, wgrad} -> mode mapping."""
    if not isinstance(modes, Mapping) or set(modes) != set(GEMMS):
        raise ValueError(f"modes must map exactly {GEMMS} to a mode, got {modes!r}")
    for gemm in GEMMS:
        if modes[gemm] not in GEMM_MODES:
            raise ValueError(f"mode of {gemm} must be one of {GEMM_MODES}, got {modes[gemm]!r}")
    if modes["wgrad"] == "iht+oe_left":
        raise ValueError(
            "wgrad cannot use iht+oe_left: it needs X in high precision, which the forward does "
            "not keep; use iht or iht+oe_right"
        )
    return {g: modes[g] for g in GEMMS}


# ---- the measured policy -------------------------------------------------------------------------
# docs/method.md, 'Strategy per GEMM': each GEMM's error predicted from how well its two operands
# quantize (patterns.quant_error), the modes chosen under a budget of high-precision FLOPs.

DEFAULT_HP_BUDGET = 0.08  # share of a layer's GEMM FLOPs in high precision (BF16 GEMMs + OE slices)
NSR_BF16 = 2.0**-16 / 3  # one operand rounded to BF16 (relative spacing 2**-7, uniform rounding error)
# (role, quantization dim) of A and B in each GEMM (gemm_geometry.GEOMETRY): OE takes the slices of
# the other dim, rows of a tensor quantized along dim 1 and columns of one along dim 0.
GEMM_OPERANDS = {name: ((gm.a.role, gm.a.dim), (gm.b.role, gm.b.dim)) for name, gm in GEOMETRY.items()}
OE_MODES = ("iht+oe_left", "iht+oe_right")
# Naive MXFP4 wins a near tie: IHT (and OE, which runs IHT) must be predicted this much better.
# The prediction of IHT minus naive MXFP4 is off by 0.3 dB (sd) on SmolLM2-135M's fprop and dgrad,
# mostly where the two are far apart; 0.1 dB turned its one GEMM below naive MXFP4 (by 0.10 dB)
# into naive MXFP4, at 0.001 dB of the mean (docs/method.md, 'Strategy per GEMM').
NAIVE_MARGIN_DB = 0.1


def _operand(summary: Mapping, role: str, d: int) -> dict:
    s = summary[role]
    outer = "rows" if d == 1 else "cols"
    return {"stats": s, "d": d, "outer": s.get(outer, math.nan), "share": f"share_{outer}"}


def _nsr(op: dict, what: str, k: int | None = None) -> float:
    key = f"nsr_{what}_d{op['d']}" if k is None else f"nsr_oe_d{op['d']}@{k}"
    v = op["stats"].get(key, math.nan)
    return v if isinstance(v, (int, float)) else math.nan


def _profile(op: dict, what: str) -> list | None:
    v = op["stats"].get(f"prof_{what}_d{op['d']}")
    return v if isinstance(v, (list, tuple)) else None


def _weighted(err: list | None, energy: list | None) -> float | None:
    """An operand's error weighed with the other operand's energy where it lands: L sum_k
    err[k] p[k] over the contraction index, or (L / 32) sum_b err[b] P[b] over blocks of 32 when
    ``err`` is per block (P the energy per block); None without both profiles."""
    if not err or not energy:
        return None
    n = len(energy)
    if len(err) == n:
        return n * sum(e * p for e, p in zip(err, energy))
    blocks = -(-n // 32)
    if len(err) != blocks:
        return None
    per_block = [sum(energy[i:i + 32]) for i in range(0, n, 32)]
    return n / 32 * sum(e * p for e, p in zip(err, per_block))


def _term(err_side: dict, what: str, energy_side: dict, k: int | None = None) -> float:
    """One operand's share of a GEMM's NSR: its error (``what``: mxfp4, iht or oe at ``k``)
    weighed with the other operand's energy profile, else (no profiles) its total NSR."""
    key = f"prof_{what}_d{err_side['d']}" if k is None else f"prof_oe_d{err_side['d']}@{k}"
    v = _weighted(err_side["stats"].get(key), _profile(energy_side, "energy"))
    if v is not None and math.isfinite(v):
        return v
    return _nsr(err_side, what, k)


def _share(op: dict, k: int) -> float:
    v = op["stats"].get(f"{op['share']}@{k}", math.nan)
    return v if isinstance(v, (int, float)) else math.nan


def summary_oe_ks(summary: Mapping) -> tuple[int, ...]:
    """The OE k values whose statistics every tensor of ``summary`` has."""
    found = None
    for role in ("x", "w", "g"):
        ks = {int(key.rsplit("@", 1)[1]) for key in summary[role] if key.startswith("nsr_oe_d1@")}
        found = ks if found is None else found & ks
    return tuple(sorted(found or ()))


def predicted_gemm_nsr(summary: Mapping, gemm: str, mode: str, k: int | None = None) -> tuple[float, float]:
    """(relative NSR, high-precision share) the measured policy predicts for ``gemm`` run in
    ``mode`` (OE with ``k`` slices). C = A B with quantization errors dA, dB, spread evenly over
    the contraction dim and uncorrelated with the other operand, has

        ||C_hat - C||^2 ~ (||dA||^2 ||B||^2 + ||A||^2 ||dB||^2) / Kc,

    so its NSR is nsr(A) + nsr(B) times a factor of the GEMM alone (||A||^2 ||B||^2 / (Kc ||C||^2)),
    the same for every mode: the NSR returned is without it, enough to rank the modes of one GEMM.
    The errors are not spread evenly: naive MXFP4 keeps an outlier's error in its block's
    elements, IHT within its block of 32. Where the calibration recorded profiles over the
    contraction index (``patterns.quant_error``), each operand's error is weighed with the other's
    energy there: sum_k err_A[k] ||B[k, :]||^2 per element (naive) or per block (IHT, OE), and
    A's rows kept in OE-left are taken out of B's term as a share of A's energy (OE-right the
    same for B's columns); without profiles (wgrad's contraction over tokens), the totals.
    OE-left computes A's k rows exactly, which removes them from A's error (nsr_oe of A) and from
    A dB (a factor 1 - share of A's energy in them); OE-right the same with B's columns. NaN when a
    statistic is missing (a tensor that held NaN or Inf at every step, or an older calibration)."""
    a, b = (_operand(summary, role, d) for role, d in GEMM_OPERANDS[gemm])
    if mode == "bf16":
        return 2 * NSR_BF16, 1.0
    if mode in ("mxfp4", "iht"):
        return _term(a, mode, b) + _term(b, mode, a), 0.0
    if mode == "iht+oe_left":
        return (_term(a, "oe", b, k) + _term(b, "iht", a) * (1 - _share(a, k)),
                min(k, a["outer"]) / a["outer"])
    if mode == "iht+oe_right":
        return (_term(a, "iht", b) * (1 - _share(b, k)) + _term(b, "oe", a, k),
                min(k, b["outer"]) / b["outer"])
    raise ValueError(f"mode must be one of {GEMM_MODES}, got {mode!r}")


def check_hp_budget(budget) -> float:
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0 <= budget <= 1:
        raise ValueError(f"hp_budget must be a number in [0, 1] (a share of the GEMM FLOPs), got {budget!r}")
    return float(budget)


@dataclass(frozen=True)
class MeasuredPolicy:
    """The measured policy: per layer, the modes (and OE k) whose predicted errors
    (``predicted_gemm_nsr``) have the largest sum of SQNRs in dB, with at most ``budget`` of the
    layer's GEMM FLOPs in high precision (its three GEMMs have the same FLOPs, so the budget is on
    the mean of their high-precision shares; the whole model then stays within it too).

    ``oe_k``: the k of each GEMM (fprop, dgrad, wgrad), as a layer runs it from its config; the
    result is then ``{fprop, dgrad, wgrad: mode}``. None: k is part of the choice, from the k
    values the calibration observed (``summary_oe_ks``), and the result carries
    ``"oe_k": {gemm: k}`` for its OE GEMMs (``policy_result`` reads both forms). A GEMM without
    finite statistics gets ``iht`` (the ``mxfp4_iht`` recipe's mode, no high precision)."""

    budget: float = DEFAULT_HP_BUDGET
    oe_k: tuple[int, int, int] | None = None

    def __post_init__(self):
        check_hp_budget(self.budget)
        if self.oe_k is not None:
            ks = tuple(self.oe_k)
            if len(ks) != 3 or any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in ks):
                raise ValueError(f"oe_k must be None or three ints >= 1 (fprop, dgrad, wgrad), got {self.oe_k!r}")
            object.__setattr__(self, "oe_k", ks)

    def candidates(self, summary: Mapping, gemm: str) -> list[tuple[str, int | None, float, float]]:
        """(mode, k, predicted SQNR in dB up to the GEMM's constant, high-precision share) of each
        mode ``gemm`` can run, those without a finite prediction left out."""
        ks = summary_oe_ks(summary) if self.oe_k is None else (self.oe_k[GEMMS.index(gemm)],)
        modes = [("bf16", None), ("mxfp4", None), ("iht", None)]
        sides = OE_MODES[1:] if gemm == "wgrad" else OE_MODES  # wgrad: no OE-left (see check_modes)
        modes += [(m, k) for m in sides for k in ks]
        out = []
        for mode, k in modes:
            nsr, hp = predicted_gemm_nsr(summary, gemm, mode, k)
            if math.isfinite(nsr) and math.isfinite(hp):
                out.append((mode, k, math.inf if nsr <= 0 else -10 * math.log10(nsr), hp))
        if all(c[0] == "bf16" for c in out):  # nothing is known of the operands: no candidate
            return []
        return out

    def decide(self, summary: Mapping) -> dict:
        """``{gemm: {"mode", "oe_k", "predicted_db", "hp_share"}}``: the choice and its reasons."""

        def objective(c) -> float:  # what the choice maximises: the prediction, naive MXFP4 first on a near tie
            if not math.isfinite(c[2]):
                return 0.0 if math.isnan(c[2]) else c[2]
            return c[2] + (NAIVE_MARGIN_DB if c[0] == "mxfp4" else 0.0)

        per_gemm = {}
        for gemm in GEMMS:
            cands = self.candidates(summary, gemm) or [("iht", None, math.nan, 0.0)]
            # drop dominated candidates: another is at least as good for no more high precision
            cands.sort(key=lambda c: (c[3], -objective(c)))
            kept, best = [], -math.inf
            for c in cands:
                if objective(c) > best or not kept:
                    kept.append(c)
                    best = max(best, objective(c))
            per_gemm[gemm] = kept
        limit = 3 * self.budget + 1e-12
        choice, top = None, -math.inf
        for f in per_gemm["fprop"]:
            for d in per_gemm["dgrad"]:
                if f[3] + d[3] > limit:
                    break  # sorted by high-precision share
                for w in per_gemm["wgrad"]:
                    if f[3] + d[3] + w[3] > limit:
                        break
                    total = objective(f) + objective(d) + objective(w)
                    if total > top:
                        choice, top = (f, d, w), total
        if choice is None:  # the budget affords nothing: the cheapest of each (no high precision)
            choice = tuple(per_gemm[g][0] for g in GEMMS)
        return {g: {"mode": c[0], "oe_k": c[1] if c[0] in OE_MODES else None, "predicted_db": c[2],
                    "hp_share": c[3]} for g, c in zip(GEMMS, choice)}

    def __call__(self, summary: Mapping) -> dict:
        picks = self.decide(summary)
        modes = {g: p["mode"] for g, p in picks.items()}
        if self.oe_k is None:
            modes["oe_k"] = {g: p["oe_k"] for g, p in picks.items() if p["oe_k"] is not None}
        return modes


def policy_result(result: Mapping) -> tuple[dict[str, str], dict[str, int]]:
    """A policy's result, checked: ``{fprop, dgrad, wgrad: mode}``, optionally with ``"oe_k":
    {gemm: k}`` (a k per OE GEMM, from a policy that chooses it). Returns (modes, ks)."""
    if not isinstance(result, Mapping):
        raise ValueError(f"a policy returns a mapping of {GEMMS} to modes, got {result!r}")
    ks = result.get("oe_k", {})
    modes = check_modes({g: v for g, v in result.items() if g != "oe_k"})
    if not isinstance(ks, Mapping) or not set(ks) <= set(GEMMS) or any(
            isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in ks.values()):
        raise ValueError(f"a policy's oe_k must map GEMMs of {GEMMS} to ints >= 1, got {ks!r}")
    return modes, dict(ks)
