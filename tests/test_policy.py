"""AdaHOP strategy table (adahop.policy) and recipes/configuration (adahop.config)."""

from __future__ import annotations

import pytest

from adahop.config import AdaHOPConfig, GemmConfig
from adahop.patterns.detect import PATTERNS
from adahop.policy import (
    check_modes,
    flip,
    gemm_pattern_pairs,
    modes_from_patterns,
    table_mode,
    table_policy,
)

PATTERN_NAMES = ("row", "none", "col")
LEVELS = ("lv1", "lv2")

# The paper's strategy table (docs/method.md, 'Strategy per GEMM'), as the paper prints it. For
# C = A B, rows are pat(A) and columns pat(B); for A, "row" means outer-dim (M) outliers, for B,
# "row" means inner-dim ones.
PAPER_TABLE = r"""
    A\B    row   none          col
    row    IHT   IHT+OE-left   IHT+OE-right
    none   IHT   IHT           IHT+OE-right
    col    IHT   IHT           Lv2:BF16;Lv1:IHT+OE-right
"""
PAPER_MODE_NAMES = {"IHT": "iht", "IHT+OE-left": "iht+oe_left", "IHT+OE-right": "iht+oe_right", "BF16": "bf16"}


def parse_paper_table(text: str) -> dict[tuple[str, str], dict[str, str]]:
    """{(pat(A), pat(B)): {level: mode}} from the table above."""
    header, *rows = (line.split() for line in text.strip().splitlines())
    table = {}
    for a, *cells in rows:
        for b, cell in zip(header[1:], cells):
            per_level = dict(part.split(":") for part in cell.split(";")) if ":" in cell else {}
            table[(a, b)] = {lv: PAPER_MODE_NAMES[per_level.get(lv.capitalize(), cell)] for lv in LEVELS}
    return table


PAPER = parse_paper_table(PAPER_TABLE)
TRANSPOSED = {"row": "col", "col": "row", "none": "none"}  # the pattern of a transposed tensor


def paper_modes(x: str, w: str, g: str, level: str) -> dict[str, str]:
    """The paper's mode of each GEMM, derived here: y = x w^T, dx = g w, dw = g^T x read as C = A
    B give the pairs fprop (pat(x), flip(pat(w))), dgrad (pat(g), pat(w)), wgrad (flip(pat(g)),
    pat(x)); OE-left in wgrad would need x in high precision, which is not kept: IHT there."""
    pairs = {"fprop": (x, TRANSPOSED[w]), "dgrad": (g, w), "wgrad": (TRANSPOSED[g], x)}
    modes = {gemm: PAPER[pair][level] for gemm, pair in pairs.items()}
    if modes["wgrad"] == "iht+oe_left":
        modes["wgrad"] = "iht"
    return modes


ALL_TRIPLES = [(x, w, g) for x in PATTERN_NAMES for w in PATTERN_NAMES for g in PATTERN_NAMES]
RECIPE_NAMES = ("bf16", "mxfp4", "mxfp4_iht", "tseng", "adahop_lv2", "adahop_lv1", "adahop_measured")


# ----------------------------------------------------------------------------- table


def test_paper_table_parses_to_nine_pairs():
    assert set(PATTERNS) == set(PATTERN_NAMES)
    assert set(PAPER) == {(a, b) for a in PATTERN_NAMES for b in PATTERN_NAMES}
    assert PAPER[("row", "none")] == {"lv1": "iht+oe_left", "lv2": "iht+oe_left"}
    assert PAPER[("col", "col")] == {"lv1": "iht+oe_right", "lv2": "bf16"}
    assert PAPER[("none", "col")] == {"lv1": "iht+oe_right", "lv2": "iht+oe_right"}


@pytest.mark.parametrize("pair", sorted(PAPER))
@pytest.mark.parametrize("level", LEVELS)
def test_table_entry(pair, level):
    assert table_mode(pair, level) == PAPER[pair][level]


@pytest.mark.parametrize("level", LEVELS)
def test_table_covers_all_nine_pairs(level):
    """The library's strategy, through modes_from_patterns and table_policy, is the paper's for
    all 27 pattern triples (x, w, g): with the flips and the wgrad fallback, and every one of
    the nine pairs reaches every GEMM (each GEMM's pair is a one-to-one function of the triple)."""
    reached = {gemm: set() for gemm in ("fprop", "dgrad", "wgrad")}
    for x, w, g in ALL_TRIPLES:
        patterns = {"x": x, "w": w, "g": g}
        got = modes_from_patterns(patterns, level)
        assert got == paper_modes(x, w, g, level), patterns
        assert table_policy({r: {"pattern": p} for r, p in patterns.items()}, level) == got
        for gemm, pair in gemm_pattern_pairs(patterns).items():
            reached[gemm].add(pair)
    assert all(pairs == set(PAPER) for pairs in reached.values())


@pytest.mark.parametrize("level", ["lv3", "", None, "LV2"])
def test_table_mode_rejects_bad_level(level):
    with pytest.raises(ValueError, match="lv1"):
        table_mode(("row", "row"), level)
    with pytest.raises(ValueError):
        modes_from_patterns({"x": "none", "w": "none", "g": "none"}, level)


def test_flip():
    assert flip("row") == "col" and flip("col") == "row" and flip("none") == "none"


@pytest.mark.parametrize(
    "x, w, g, fprop, dgrad, wgrad",
    [
        # fprop = (x, flip(w)); dgrad = (g, w); wgrad = (flip(g), x)
        ("col", "none", "row", ("col", "none"), ("row", "none"), ("col", "col")),
        ("col", "row", "none", ("col", "col"), ("none", "row"), ("none", "col")),
        ("none", "none", "col", ("none", "none"), ("col", "none"), ("row", "none")),
        ("row", "col", "none", ("row", "row"), ("none", "col"), ("none", "row")),
        ("row", "row", "row", ("row", "col"), ("row", "row"), ("col", "row")),
        ("none", "none", "none", ("none", "none"), ("none", "none"), ("none", "none")),
    ],
)
def test_gemm_pattern_pairs(x, w, g, fprop, dgrad, wgrad):
    assert gemm_pattern_pairs({"x": x, "w": w, "g": g}) == {"fprop": fprop, "dgrad": dgrad, "wgrad": wgrad}


@pytest.mark.parametrize(
    "patterns",
    [{"x": "row", "w": "none"}, {"x": "row", "w": "none", "g": "column"}, {"x": None, "w": "row", "g": "row"}],
)
def test_gemm_pattern_pairs_rejects_bad_patterns(patterns):
    with pytest.raises(ValueError, match="pattern"):
        gemm_pattern_pairs(patterns)


@pytest.mark.parametrize(
    "patterns, lv1, lv2",
    [
        # the typical layer: X column-wise, G row-wise
        ({"x": "col", "w": "none", "g": "row"},
         {"fprop": "iht", "dgrad": "iht+oe_left", "wgrad": "iht+oe_right"},
         {"fprop": "iht", "dgrad": "iht+oe_left", "wgrad": "bf16"}),
        ({"x": "col", "w": "row", "g": "none"},
         {"fprop": "iht+oe_right", "dgrad": "iht", "wgrad": "iht+oe_right"},
         {"fprop": "bf16", "dgrad": "iht", "wgrad": "iht+oe_right"}),
        # wgrad pair (row, none) -> iht+oe_left, which falls back to iht in wgrad
        ({"x": "none", "w": "none", "g": "col"},
         {"fprop": "iht", "dgrad": "iht", "wgrad": "iht"},
         {"fprop": "iht", "dgrad": "iht", "wgrad": "iht"}),
        ({"x": "row", "w": "col", "g": "none"},
         {"fprop": "iht", "dgrad": "iht+oe_right", "wgrad": "iht"},
         {"fprop": "iht", "dgrad": "iht+oe_right", "wgrad": "iht"}),
        ({"x": "none", "w": "none", "g": "none"},
         {"fprop": "iht", "dgrad": "iht", "wgrad": "iht"},
         {"fprop": "iht", "dgrad": "iht", "wgrad": "iht"}),
        # fprop pair (row, none) keeps oe_left (only wgrad falls back)
        ({"x": "row", "w": "none", "g": "row"},
         {"fprop": "iht+oe_left", "dgrad": "iht+oe_left", "wgrad": "iht"},
         {"fprop": "iht+oe_left", "dgrad": "iht+oe_left", "wgrad": "iht"}),
    ],
)
def test_modes_from_patterns(patterns, lv1, lv2):
    assert modes_from_patterns(patterns, "lv1") == lv1
    assert modes_from_patterns(patterns, "lv2") == lv2
    assert modes_from_patterns(patterns) == lv2  # lv2 is the default level
    summary = {r: {"pattern": p, "cv_row": 1.0, "cv_col": 1.0} for r, p in patterns.items()}
    assert table_policy(summary, "lv1") == lv1
    assert table_policy(summary, "lv2") == lv2
    # the result always passes validation
    assert check_modes(lv1) == lv1 and check_modes(lv2) == lv2


def test_wgrad_never_gets_oe_left():
    for x in ("row", "none", "col"):
        for w in ("row", "none", "col"):
            for g in ("row", "none", "col"):
                for level in ("lv1", "lv2"):
                    modes = modes_from_patterns({"x": x, "w": w, "g": g}, level)
                    assert modes["wgrad"] != "iht+oe_left"
                    assert set(modes) == {"fprop", "dgrad", "wgrad"}


def test_check_modes():
    ok = {"wgrad": "iht", "fprop": "bf16", "dgrad": "iht+oe_right"}
    assert check_modes(ok) == ok
    assert list(check_modes(ok)) == ["fprop", "dgrad", "wgrad"]
    for mode in ("bf16", "mxfp4", "iht", "iht+oe_left", "iht+oe_right"):
        check_modes({"fprop": mode, "dgrad": mode, "wgrad": "iht"})


@pytest.mark.parametrize(
    "modes, match",
    [
        ({"fprop": "iht", "dgrad": "iht"}, "fprop"),
        ({"fprop": "iht", "dgrad": "iht", "wgrad": "iht", "extra": "iht"}, "fprop"),
        (["fprop", "dgrad", "wgrad"], "fprop"),
        ({"fprop": "fp8", "dgrad": "iht", "wgrad": "iht"}, "mode of fprop"),
        ({"fprop": "iht", "dgrad": "IHT", "wgrad": "iht"}, "mode of dgrad"),
        ({"fprop": "iht", "dgrad": "iht", "wgrad": "iht+oe_left"}, "wgrad"),
    ],
)
def test_check_modes_errors(modes, match):
    with pytest.raises(ValueError, match=match):
        check_modes(modes)


# ----------------------------------------------------------------------------- recipes


def test_every_recipe_builds():
    for name in RECIPE_NAMES:
        cfg = AdaHOPConfig.from_recipe_name(name)
        assert isinstance(cfg, AdaHOPConfig) and cfg.recipe == name
        for g in ("fprop", "dgrad", "wgrad"):
            assert isinstance(cfg.gemm(g), GemmConfig)
        # docs/method.md, 'Stochastic rounding': SR for G (A of dgrad and wgrad), RNE for X and W
        assert cfg.dgrad.a_rounding == "sr" and cfg.wgrad.a_rounding == "sr"
        assert cfg.fprop.a_rounding == "rne"


@pytest.mark.parametrize("name, mode", [("bf16", "bf16"), ("mxfp4", "mxfp4"), ("mxfp4_iht", "iht")])
def test_uniform_recipes(name, mode):
    cfg = AdaHOPConfig.from_recipe_name(name)
    assert cfg.adaptive is False
    assert cfg.fixed_modes() == {"fprop": mode, "dgrad": mode, "wgrad": mode}
    # X and W stay RNE
    assert cfg.fprop.b_rounding == "rne" and cfg.dgrad.b_rounding == "rne" and cfg.wgrad.b_rounding == "rne"
    assert cfg.fprop.random_signs is False


def test_tseng_recipe():
    cfg = AdaHOPConfig.from_recipe_name("tseng")
    assert cfg.adaptive is False
    assert cfg.fprop.mode == "mxfp4"
    assert cfg.fprop.a_rounding == "rne" and cfg.fprop.b_rounding == "rne"
    for g in (cfg.dgrad, cfg.wgrad):
        assert g.mode == "iht"
        assert g.random_signs is True
        assert g.a_rounding == "sr" and g.b_rounding == "sr"
        assert g.scale_mode == "rceil"
    assert cfg.fixed_modes() == {"fprop": "mxfp4", "dgrad": "iht", "wgrad": "iht"}


@pytest.mark.parametrize("name, level", [("adahop_lv2", "lv2"), ("adahop_lv1", "lv1")])
def test_adahop_recipes(name, level):
    cfg = AdaHOPConfig.from_recipe_name(name)
    assert cfg.adaptive is True
    assert cfg.policy == level
    assert cfg.calibration_steps == 30
    assert cfg.tau == 2.0
    assert cfg.fprop.oe_k == 64 and cfg.fprop.hadamard_size == 32 and cfg.fprop.block_size == 32
    assert cfg.fprop.scale_mode == "even"
    assert cfg.dgrad.b_rounding == "rne" and cfg.wgrad.b_rounding == "rne"


def test_default_config_is_adahop_lv2():
    cfg = AdaHOPConfig()
    assert cfg.recipe == "adahop_lv2" and cfg.adaptive and cfg.policy == "lv2"
    assert cfg.dgrad.a_rounding == "sr" and cfg.wgrad.a_rounding == "sr"
    assert cfg.fprop.a_rounding == "rne" and cfg.fprop.b_rounding == "rne"


def test_recipe_overrides():
    cfg = AdaHOPConfig.from_recipe_name("adahop_lv1", seed=17, calibration_steps=5, tau=3.0)
    assert (cfg.seed, cfg.calibration_steps, cfg.tau, cfg.policy) == (17, 5, 3.0, "lv1")
    cfg2 = cfg.replace(backend="reference")
    assert cfg2.backend == "reference" and cfg.backend == "auto"
    with pytest.raises(ValueError):
        AdaHOPConfig.from_recipe_name("adahop_lv2", tau=-1.0)
    with pytest.raises(ValueError):
        AdaHOPConfig.from_recipe_name("mxfp4", wgrad=GemmConfig(mode="iht+oe_left"))


@pytest.mark.parametrize("name", ["adahop", "BF16", "", "lv2", "mxfp8"])
def test_unknown_recipe(name):
    with pytest.raises(ValueError) as ei:
        AdaHOPConfig.from_recipe_name(name)
    msg = str(ei.value)
    for known in RECIPE_NAMES:
        assert known in msg


def test_gemm_accessor():
    cfg = AdaHOPConfig.from_recipe_name("tseng")
    assert cfg.gemm("dgrad") is cfg.dgrad
    with pytest.raises(ValueError, match="fprop"):
        cfg.gemm("forward")


# ----------------------------------------------------------------------------- validation


def test_gemm_config_defaults():
    g = GemmConfig()
    assert (g.mode, g.hadamard_size, g.random_signs, g.oe_k, g.a_rounding, g.b_rounding,
            g.scale_mode, g.block_size) == ("iht", 32, False, 64, "rne", "rne", "even", 32)
    for size in (16, 32, 64, 128, 256):
        assert GemmConfig(hadamard_size=size).hadamard_size == size


@pytest.mark.parametrize(
    "kwargs",
    [
        {"mode": "fp8"},
        {"mode": "IHT"},
        {"hadamard_size": 8},
        {"hadamard_size": 48},
        {"hadamard_size": 512},
        {"block_size": 48},
        {"block_size": 0},
        {"block_size": True},
        {"a_rounding": "stochastic"},
        {"b_rounding": "nearest"},
        {"scale_mode": "round"},
        {"random_signs": 1},
        {"random_signs": "yes"},
        {"oe_k": 0},
        {"oe_k": -3},
        {"oe_k": True},
        {"oe_k": 2.0},
    ],
)
def test_gemm_config_rejects(kwargs):
    with pytest.raises(ValueError):
        GemmConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"policy": "lv3"},
        {"backend": "cuda"},
        {"tau": 0.0},
        {"tau": -2.0},
        {"seed": -1},
        {"seed": 2**32},
        {"adaptive": 1},
        {"calibration_steps": 0},
        {"calibration_steps": True},
        {"calibration_steps": 2.5},
        {"fprop": "iht"},
        {"dgrad": None},
        # a fixed recipe cannot use oe_left in wgrad
        {"adaptive": False, "wgrad": GemmConfig(mode="iht+oe_left")},
    ],
)
def test_adahop_config_rejects(kwargs):
    with pytest.raises(ValueError):
        AdaHOPConfig(**kwargs)
