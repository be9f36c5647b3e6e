"""The measured policy (adahop.policy.MeasuredPolicy, the adahop_measured recipe): tensors with
planted outliers where it must pick the best strategy as measured, its budget, its scale
invariance, bad input, and a layer that calibrates with it."""

from __future__ import annotations

import math

import pytest
import torch

import adahop
from adahop.analyze.strategies import gemm_errors, layer_gemms, runnable_fp4_strategies, strategy_of_mode
from adahop.config import AdaHOPConfig
from adahop.patterns.calibration import STAT_NAMES, LayerCalibration, observe_tensor
from adahop.patterns.quant_error import oe_k_ladder
from adahop.policy import GEMMS, MeasuredPolicy, policy_result, predicted_gemm_nsr

T, K, N = 256, 128, 96
OE_K = 4  # the layer's k; the policy's ladder is 1, 2, 4, 8
PROFILE_DIMS = {"x": (1,), "w": (1, 0), "g": (1,)}


def tensors(case: str, seed: int = 0):
    """x [T, K], w [N, K], g [T, N] with one planted structure each case."""
    gen = torch.Generator().manual_seed(seed)
    x, w, g = torch.randn(T, K, generator=gen), torch.randn(N, K, generator=gen), torch.randn(T, N, generator=gen)
    if case == "w_rows":  # outer columns of B = W^T in fprop: OE-right
        w[[3, 30]] *= 40
    elif case == "g_rows":  # token outliers of G, outer rows of A in dgrad: OE-left
        g[[7, 100, 200]] *= 40
    elif case == "x_cols":  # inner-dim outliers of X in fprop: IHT spreads them
        x[:, [5, 77]] *= 30
    elif case == "x_cols_w_blind":  # a huge channel of X that W ignores: naive MXFP4 beats IHT
        x[:, 5] *= 200
        w[:, 5] *= 1e-3
    return x, w, g


def summary_of(x, w, g, steps: int = 1) -> dict:
    cal = LayerCalibration()
    for _ in range(steps):
        for role, t in (("x", x), ("w", w), ("g", g)):
            cal.add(role, observe_tensor(t, tau=2.0, k=OE_K, profile_dims=PROFILE_DIMS[role]))
    return cal.summary()


def measured_sqnr(x, w, g) -> dict:
    ks = oe_k_ladder(OE_K)
    return {gemm: gemm_errors(op, oe_ks=ks).sqnr_db for gemm, op in layer_gemms(x, w, g).items()}


def pick_strategy(pick: dict) -> str:
    return strategy_of_mode(pick["mode"], pick["oe_k"])


@pytest.mark.parametrize("case, gemm, want", [
    ("w_rows", "fprop", "iht+oe_right"),
    ("g_rows", "dgrad", "iht+oe_left"),
    ("x_cols", "fprop", "iht+oe"),  # any OE: IHT has fixed the inner outliers, OE adds a little
    ("x_cols_w_blind", "fprop", "mxfp4"),
])
def test_the_pick_is_the_planted_best(case, gemm, want):
    """With room in the budget (no BF16 GEMM fits), every GEMM's pick is the best runnable 4-bit
    strategy as measured against float64, to 0.1 dB; the planted GEMM's pick is the planted mode."""
    x, w, g = tensors(case)
    picks = MeasuredPolicy(0.25).decide(summary_of(x, w, g))
    sqnr = measured_sqnr(x, w, g)
    assert picks[gemm]["mode"].startswith(want), picks[gemm]
    for gm in GEMMS:
        cands = [s for k in oe_k_ladder(OE_K) for s in runnable_fp4_strategies(gm, k)]
        best = max(sqnr[gm][s] for s in cands)
        assert sqnr[gm][pick_strategy(picks[gm])] >= best - 0.1, (gm, picks[gm], best)


@pytest.mark.parametrize("case, want", [("x_cols", "iht"), ("x_cols_w_blind", "mxfp4")])
def test_without_budget_it_chooses_between_naive_and_iht_by_measurement(case, want):
    """The table gives IHT to any fprop with column-wise X; where W ignores X's outlier channel,
    naive MXFP4 is 12 dB better, and the policy sees it (naive MXFP4's error profile)."""
    x, w, g = tensors(case)
    picks = MeasuredPolicy(0.0).decide(summary_of(x, w, g))
    sqnr = measured_sqnr(x, w, g)["fprop"]
    assert picks["fprop"]["mode"] == want and sqnr[want] == max(sqnr["mxfp4"], sqnr["iht"])
    assert all(p["mode"] in ("mxfp4", "iht") and p["hp_share"] == 0 for p in picks.values())
    assert adahop.policy.table_policy(summary_of(x, w, g), "lv1")["fprop"].startswith("iht")


@pytest.mark.parametrize("budget", [0.0, 0.005, 0.02, 0.08, 0.2])
def test_the_budget_is_respected(budget):
    totals = []
    for case in ("w_rows", "g_rows", "x_cols", "none"):
        s = summary_of(*tensors(case, seed=3))
        picks = MeasuredPolicy(budget).decide(s)
        assert sum(p["hp_share"] for p in picks.values()) / 3 <= budget + 1e-12, picks
        for gm, p in picks.items():  # the share the policy counts is the GEMM's own
            assert p["hp_share"] == pytest.approx(predicted_gemm_nsr(s, gm, p["mode"], p["oe_k"])[1])
        totals.append(sum(p["predicted_db"] for p in picks.values()))
    # a larger budget never predicts worse
    more = [sum(p["predicted_db"] for p in MeasuredPolicy(min(1.0, 2 * budget + 0.01)).decide(
        summary_of(*tensors(c, seed=3))).values()) for c in ("w_rows", "g_rows", "x_cols", "none")]
    assert all(b >= a - 1e-9 for a, b in zip(totals, more))


def test_fixed_k_is_the_layer_form_and_free_k_carries_its_k():
    s = summary_of(*tensors("w_rows"))
    fixed = MeasuredPolicy(0.25, (OE_K,) * 3)(s)
    assert set(fixed) == set(GEMMS) and adahop.policy.check_modes(fixed) == fixed
    free = MeasuredPolicy(0.25)(s)
    modes, ks = policy_result(free)
    assert set(ks) == {g for g in GEMMS if modes[g].startswith("iht+oe")} and set(ks.values()) <= set(oe_k_ladder(OE_K))


@pytest.mark.parametrize("factor", [2.0**-30, 2.0**20, 1e-6, 1e6])
def test_the_choice_does_not_depend_on_the_scale(factor):
    """A power of two scales MXFP4's errors exactly; other factors move values within their
    binade (MXFP4's error moves a little with them), and the planted choices hold."""
    for case in ("w_rows", "g_rows", "x_cols_w_blind"):
        x, w, g = tensors(case)
        base = MeasuredPolicy(0.08).decide(summary_of(x, w, g))
        scaled = MeasuredPolicy(0.08).decide(summary_of(x * factor, w * factor, g * factor))
        assert {gm: (p["mode"], p["oe_k"]) for gm, p in scaled.items()} == {
            gm: (p["mode"], p["oe_k"]) for gm, p in base.items()}, (case, factor)
        if math.log2(factor).is_integer():
            assert scaled == base


def test_bad_statistics_give_a_defined_choice():
    x, w, g = tensors("w_rows")
    # G held NaN at every step: dgrad and wgrad have no prediction and get IHT; fprop is decided
    picks = MeasuredPolicy(0.08).decide(summary_of(x, w, torch.full_like(g, math.nan)))
    assert picks["dgrad"]["mode"] == picks["wgrad"]["mode"] == "iht" and picks["fprop"]["mode"] == "iht+oe_right"
    assert math.isnan(picks["dgrad"]["predicted_db"])
    # an older calibration (the detector's statistics only): IHT everywhere, no high precision
    old = LayerCalibration.from_dict({r: {"votes": {"row": 2, "col": 0, "none": 0},
                                          "sums": dict.fromkeys(STAT_NAMES, 2.0),
                                          "finite_counts": dict.fromkeys(STAT_NAMES, 2)} for r in "xwg"})
    assert MeasuredPolicy()(old.summary()) == {"fprop": "iht", "dgrad": "iht", "wgrad": "iht", "oe_k": {}}
    # an all-zero weight (no NSR) is no error either
    picks = MeasuredPolicy(0.08).decide(summary_of(x, torch.zeros_like(w), g))
    assert picks["fprop"]["mode"] == "iht" and picks["dgrad"]["mode"] == "iht"


@pytest.mark.parametrize("bad, match", [
    (dict(hp_budget=1.5), r"hp_budget must be a number in \[0, 1\]"),
    (dict(hp_budget=-0.1), r"hp_budget must be a number in \[0, 1\]"),
    (dict(hp_budget="8%"), r"hp_budget must be a number in \[0, 1\]"),
    (dict(hp_budget=True), r"hp_budget must be a number in \[0, 1\]"),
    (dict(policy="measure"), r"policy must be one of \('lv1', 'lv2', 'measured', 'loss_aware'\)"),
])
def test_bad_config_is_a_one_line_error(bad, match):
    with pytest.raises(ValueError, match=match) as e:
        AdaHOPConfig.from_recipe_name("adahop_measured", **bad)
    assert "\n" not in str(e.value)


def test_bad_policy_arguments_and_results():
    with pytest.raises(ValueError, match="oe_k must be None or three ints"):
        MeasuredPolicy(0.08, (4, 0, 4))
    with pytest.raises(ValueError, match="oe_k must map GEMMs"):
        policy_result({"fprop": "iht", "dgrad": "iht", "wgrad": "iht", "oe_k": {"fprop": 0}})
    with pytest.raises(ValueError, match="mode of fprop must be one of"):
        policy_result({"fprop": "iht+oe", "dgrad": "iht", "wgrad": "iht"})


def test_the_recipe_config_follows_its_k_and_round_trips():
    cfg = AdaHOPConfig.from_recipe_name("adahop_measured")
    assert cfg.adaptive and cfg.policy == "measured" and isinstance(cfg.policy_fn, MeasuredPolicy)
    # k is part of the choice: from the ladder the layer observes around each GEMM's oe_k
    assert (cfg.policy_fn.budget, cfg.policy_fn.oe_k) == (0.08, None)
    small = cfg.with_gemm_settings(oe_k=OE_K).replace(hp_budget=0.05)
    assert small.policy_fn.budget == 0.05 and small.policy_fn is not cfg.policy_fn  # remade with the config
    d = small.to_dict()
    assert d["policy_fn"] is None and d["hp_budget"] == 0.05
    assert AdaHOPConfig.from_dict(d) == small
    from adahop.train.recipes import preset

    debug = preset("debug", recipe="adahop_measured").adahop
    assert debug.policy == "measured" and debug.fprop.oe_k == 4 and debug.policy_fn.oe_k is None
    mine = MeasuredPolicy(0.02)  # a policy_fn the user gives is kept
    assert AdaHOPConfig.from_recipe_name("adahop_measured", policy_fn=mine).policy_fn is mine


def test_a_layer_calibrates_with_the_measured_policy():
    """An AdaHOPLinear of the adahop_measured recipe: two calibration steps on planted tensors
    (W's outlier rows, G's outlier tokens), then the modes the policy picks on its summary."""
    x, w, _ = tensors("w_rows")
    cfg = AdaHOPConfig.from_recipe_name("adahop_measured", calibration_steps=2, backend="reference",
                                        hp_budget=0.25).with_gemm_settings(oe_k=8)
    lin = torch.nn.Linear(K, N, bias=False)
    with torch.no_grad():
        lin.weight.copy_(w)
    layer = adahop.AdaHOPLinear.from_float(lin, config=cfg, name="planted")
    weights = torch.ones(T, 1)
    weights[[7, 100, 200]] = 40  # G row-wise
    for _ in range(2):
        xi = x.clone().requires_grad_()
        (layer(xi) * weights).square().mean().backward()
    assert not layer.calibrating
    assert layer.modes["fprop"] == "iht+oe_right" and layer.modes["dgrad"] == "iht+oe_left"
    modes, oe_ks = policy_result(cfg.policy_fn(layer.calibration.summary()))
    assert layer.modes == modes and layer.oe_ks == (oe_ks or None)
    assert layer._plan(torch.device("cpu")).dgrad.oe_k == oe_ks.get("dgrad", 8)  # the k it chose runs
