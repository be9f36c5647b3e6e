"""AdaHOP's strategy: from the outlier patterns of X, W, G to a mode for each of the three GEMMs.

Each GEMM is written C = A B with A: [M, Kc] and B: [Kc, Nc] and read as fed to the matmul; a
transposed tensor swaps row and column (docs/method.md, 'Strategy per GEMM'):

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

from collections.abc import Mapping

from adahop.patterns.detect import PATTERNS

GEMMS = ("fprop", "dgrad", "wgrad")
GEMM_MODES = ("bf16", "mxfp4", "iht", "iht+oe_left", "iht+oe_right")
POLICY_LEVELS = ("lv1", "lv2")

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
    x, w, g = patterns["x"], patterns["w"], patterns["g"]
    return {"fprop": (x, flip(w)), "dgrad": (g, w), "wgrad": (flip(g), x)}


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
