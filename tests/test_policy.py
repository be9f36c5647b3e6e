"""AdaHOP strategy table (adahop.policy) and recipes/configuration (adahop.config)."""

from __future__ import annotations

import pytest

from adahop.config import AdaHOPConfig, GemmConfig
from adahop.policy import (
    check_modes,
    flip,
    gemm_pattern_pairs,
    modes_from_patterns,
    table_mode,
    table_policy,
)

# SPEC.md section 4, written out by hand: (A pattern, B pattern) -> (Lv1 mode, Lv2 mode)
EXPECTED_TABLE = {
    ("row", "row"): ("iht", "iht"),
    ("row", "none"): ("iht+oe_left", "iht+oe_left"),
    ("row", "col"): ("iht+oe_right", "iht+oe_right"),
    ("none", "row"): ("iht", "iht"),
    ("none", "none"): ("iht", "iht"),
    ("none", "col"): ("iht+oe_right", "iht+oe_right"),
    ("col", "row"): ("iht", "iht"),
    ("col", "none"): ("iht", "iht"),
    ("col", "col"): ("iht+oe_right", "bf16"),
}
RECIPE_NAMES = ("bf16", "mxfp4", "mxfp4_iht", "tseng", "adahop_lv2", "adahop_lv1")


# ----------------------------------------------------------------------------- table


@pytest.mark.parametrize("pair", sorted(EXPECTED_TABLE))
@pytest.mark.parametrize("level", ["lv1", "lv2"])
def test_table_entry(pair, level):
    lv1, lv2 = EXPECTED_TABLE[pair]
    assert table_mode(pair, level) == (lv1 if level == "lv1" else lv2)


def test_table_covers_all_nine_pairs():
    assert len(EXPECTED_TABLE) == 9
    for a in ("row", "none", "col"):
        for b in ("row", "none", "col"):
            assert (a, b) in EXPECTED_TABLE


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
        # SPEC section 5: SR for G (left operand of dgrad and wgrad), RNE for X in fprop
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
