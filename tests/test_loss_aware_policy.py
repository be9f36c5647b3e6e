"""The loss-aware policy (adahop.loss_aware_policy): one knapsack over every GEMM of the model,
each candidate scored by its predicted loss increase; its energy statistic; its recipe; and the
layers of a model freezing together at the end of calibration."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

import adahop
from adahop.config import AdaHOPConfig
from adahop.gemm_geometry import GEMMS
from adahop.loss_aware_policy import LossAwarePolicy, layer_flops, loss_exposure
from adahop.patterns.calibration import STAT_NAMES, LayerCalibration, observe_parts, observe_tensor, tensor_part
from adahop.patterns.observation import ENERGY
from adahop.policy import policy_result
from adahop.recipes import RECIPE_NAMES

sys.path.insert(0, str(Path(__file__).parent))

from tiny_lm import TinyLM, batches, encode_bytes, lm_loss, load_corpus  # noqa: E402

T, K, N = 256, 128, 96
OE_K = 4
PROFILE_DIMS = {"x": (1,), "w": (1, 0), "g": (1,)}


def planted(seed: int = 0):
    """x, w, g with outlier rows in W (fprop's OE-right pays) and outlier tokens in G."""
    gen = torch.Generator().manual_seed(seed)
    x, w, g = torch.randn(T, K, generator=gen), torch.randn(N, K, generator=gen), torch.randn(T, N, generator=gen)
    w[[3, 30]] *= 40
    g[[7, 100, 200]] *= 40
    return x, w, g


def summary_of(x, w, g) -> dict:
    cal = LayerCalibration()
    for role, t in (("x", x), ("w", w), ("g", g)):
        cal.add(role, observe_tensor(t, tau=2.0, k=OE_K, profile_dims=PROFILE_DIMS[role]))
    return cal.summary()


def hp_flops(summaries: dict, decision: dict) -> int:
    """The high-precision FLOPs of a decision, as the policy prices them."""
    return sum(round(p["hp_share"] * layer_flops(summaries[name])) for name, picks in decision.items()
               for p in picks.values() if p["hp_share"] > 0)


def total_loss(decision: dict) -> float:
    return sum(p["predicted_loss"] for picks in decision.values() for p in picks.values())


def test_the_energy_statistic_is_the_squared_norm_and_parts_add_up():
    x = torch.randn(64, 96) * 1000
    whole = observe_tensor(x, tau=2.0, k=OE_K).quant[ENERGY]
    assert whole == pytest.approx(x.double().square().sum().item(), rel=1e-6)
    halves = observe_parts([tensor_part(x[:32], k=OE_K), tensor_part(x[32:] * 1e-3, k=OE_K)], tau=2.0, k=OE_K)
    want = x[:32].double().square().sum().item() + (x[32:].double() * 1e-3).square().sum().item()
    assert halves.quant[ENERGY] == pytest.approx(want, rel=1e-6)
    assert observe_tensor(torch.zeros(0, 8), tau=2.0, k=OE_K).quant[ENERGY] == 0.0


def test_exposure_is_the_fisher_estimate():
    x, w, g = planted()
    s = summary_of(x, w, g)
    want = g.double().square().sum() * x.double().square().sum() * w.double().square().sum() / (2 * N * K)
    assert loss_exposure(s) == pytest.approx(want.item(), rel=1e-5)
    assert layer_flops(s) == T * K * N
    # a gradient twice as large: four times the exposure, the same NSRs
    assert loss_exposure(summary_of(x, w, 2 * g)) == pytest.approx(4 * loss_exposure(s), rel=1e-5)


@pytest.mark.parametrize("budget", [0.0, 0.001, 0.004, 0.02, 0.1, 0.5, 1.0])
def test_the_knapsack_respects_the_budget_exactly(budget):
    """Several layers of different sizes and sensitivities: the high-precision FLOPs never exceed
    floor(budget x the GEMM FLOPs of all layers), and more budget never predicts more loss."""
    summaries = {}
    for i, (t, k, n, scale) in enumerate([(T, K, N, 1.0), (T, 2 * K, N, 3.0), (T // 2, K, 2 * N, 0.3)]):
        gen = torch.Generator().manual_seed(i)
        x, w, g = torch.randn(t, k, generator=gen), torch.randn(n, k, generator=gen), torch.randn(t, n, generator=gen)
        w[:2] *= 30
        x[:, 5] *= 20
        g[:3] *= 30
        summaries[f"layer{i}"] = summary_of(x, w, g * scale)
    total = 3 * sum(layer_flops(s) for s in summaries.values())
    losses = []
    for b in (budget, min(1.0, budget * 2 + 0.01)):
        for weight in (0.0, 1.0):
            decision = LossAwarePolicy(b, backward_weight=weight).decide(summaries)
            assert hp_flops(summaries, decision) <= math.floor(b * total)
            if weight == 0.0:
                losses.append(total_loss(decision))
                # the backward has no weight: it takes no high precision
                assert all(p[g]["hp_share"] == 0 for p in decision.values() for g in ("dgrad", "wgrad"))
    assert losses[1] <= losses[0]
    if budget == 0.0:
        assert hp_flops(summaries, LossAwarePolicy(0.0, backward_weight=1.0).decide(summaries)) == 0


def test_it_prefers_the_gemm_whose_loss_is_more_sensitive():
    """Two layers with the same tensors but for a gradient twice as large in one: the same
    predicted NSRs, four times the exposure. A budget that affords the cheapest upgrade of one
    forward GEMM gives it to the sensitive layer."""
    x, w, g = planted()
    summaries = {"calm": summary_of(x, w, g), "sensitive": summary_of(x, w, 2 * g)}
    policy = LossAwarePolicy(1.0)
    opts = policy.options(summaries["sensitive"], "fprop", 1.0, layer_flops(summaries["sensitive"]))
    base = min(o.loss for o in opts if o.cost == 0)
    cheapest = min(o.cost for o in opts if o.cost > 0 and o.loss < base)  # the cheapest that helps
    total = 3 * 2 * T * K * N
    decision = LossAwarePolicy((cheapest + 0.5) / total).decide(summaries)
    assert decision["sensitive"]["fprop"]["hp_share"] > 0
    assert decision["calm"]["fprop"]["hp_share"] == 0
    # with the names swapped the choice follows the sensitivity, not the order
    swapped = LossAwarePolicy((cheapest + 0.5) / total).decide({"a": summaries["sensitive"], "b": summaries["calm"]})
    assert swapped["a"]["fprop"]["hp_share"] > 0 and swapped["b"]["fprop"]["hp_share"] == 0


def test_bad_statistics_give_a_defined_choice():
    x, w, g = planted()
    good = summary_of(x, w, g)
    nan_g = summary_of(x, w, torch.full_like(g, math.nan))  # G held NaN at every step
    zero_g = summary_of(x, w, torch.zeros_like(g))  # no gradient reached it: the loss does not see it
    inf_energy = summary_of(x, w, g)
    inf_energy["g"][ENERGY] = math.inf  # an overflowed statistic
    old = LayerCalibration.from_dict({r: {"votes": {"row": 2, "col": 0, "none": 0},  # no quantization statistics
                                          "sums": dict.fromkeys(STAT_NAMES, 2.0),
                                          "finite_counts": dict.fromkeys(STAT_NAMES, 2)} for r in "xwg"}).summary()
    summaries = {"good": good, "nan_g": nan_g, "zero_g": zero_g, "inf": inf_energy, "old": old}
    result = LossAwarePolicy(0.05)(summaries)
    for modes in result.values():
        policy_result(modes)  # a valid result for every layer
    assert set(result) == set(summaries)
    assert result["old"] == {"fprop": "iht", "dgrad": "iht", "wgrad": "iht", "oe_k": {}}  # nothing known: IHT
    decision = LossAwarePolicy(0.05).decide(summaries)
    assert decision["zero_g"]["fprop"]["predicted_loss"] == 0.0  # exposure 0: nothing to gain
    assert decision["zero_g"]["fprop"]["hp_share"] == 0
    # a missing or overflowed exposure takes the others' median, not 0 or inf
    assert math.isfinite(decision["inf"]["fprop"]["predicted_loss"])
    # nothing known of any exposure: each layer weighs 1, a defined choice
    assert policy_result(LossAwarePolicy(0.05)({"old": old, "nan": nan_g})["nan"])
    assert LossAwarePolicy(0.05)({}) == {}


def test_bad_arguments_are_one_line_errors():
    for bad, match in [(dict(budget=1.5), "hp_budget must be a number in"),
                       (dict(backward_weight=-1.0), "backward_weight must be a finite number >= 0"),
                       (dict(backward_weight=math.nan), "backward_weight must be a finite number >= 0"),
                       (dict(oe_k=(4, 0, 4)), "oe_k must be None or three ints")]:
        with pytest.raises(ValueError, match=match) as e:
            LossAwarePolicy(**bad)
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="policy 'loss_aware' decides over all the layers") as e:
        AdaHOPConfig.from_recipe_name("adahop_loss_aware", policy_fn=lambda s: {g: "iht" for g in GEMMS})
    assert "\n" not in str(e.value)


def test_the_recipe():
    assert "adahop_loss_aware" in RECIPE_NAMES
    r = adahop.recipe("adahop_loss_aware")
    cfg = r.config
    assert cfg.adaptive and cfg.policy == "loss_aware" and cfg.policy_fn is None and not r.schedule.has_phase
    assert cfg.model_policy == LossAwarePolicy(0.03)
    assert adahop.recipe("adahop_loss_aware", hp_budget=0.05).config.model_policy.budget == 0.05
    assert AdaHOPConfig.from_dict(cfg.to_dict()) == cfg
    assert AdaHOPConfig.from_recipe_name("adahop_measured").model_policy is None
    from adahop.cli import build_parser

    args = build_parser().parse_args(["train", "--recipe", "adahop_loss_aware"])
    assert args.recipe == "adahop_loss_aware"


def tiny(steps: int, budget: float = 0.05):
    torch.manual_seed(0)
    model = TinyLM(d=64, layers=2, seq_len=32)
    cfg = adahop.recipe("adahop_loss_aware", calibration_steps=steps, backend="reference",
                        hp_budget=budget).config.with_gemm_settings(oe_k=4)
    adahop.convert_to_adahop_training(model, config=cfg)
    data = batches(encode_bytes(load_corpus()[:20000]), batch=2, seq_len=32, steps=steps, seed=0)
    return model, data


def test_a_model_calibrates_and_freezes_together():
    """A tiny model: its layers wait for each other, then one decision over all of them, the
    one the policy makes from their summaries, within the budget of the whole model."""
    model, data = tiny(steps=2)
    layers = adahop.adahop_layers(model)
    assert len({id(m.calibration_group) for m in layers.values()}) == 1
    for step, (x, y) in enumerate(data):
        lm_loss(model, x, y).backward()
        assert adahop.is_calibrated(model) == (step == 1)  # nobody freezes before the last
    summaries = {i: m.calibration.summary() for i, m in enumerate(layers.values())}
    decision = next(iter(layers.values())).config.model_policy.decide(summaries)
    for i, (name, m) in enumerate(layers.items()):
        assert m.modes == {g: decision[i][g]["mode"] for g in GEMMS}, name
        assert m.oe_ks == ({g: p["oe_k"] for g, p in decision[i].items() if p["oe_k"]} or None)
        assert ENERGY in m.calibration.summary()["g"]  # recorded for every role
    assert hp_flops(summaries, decision) <= 0.05 * 3 * sum(layer_flops(s) for s in summaries.values())
    assert any(p["fprop"]["hp_share"] > 0 for p in decision.values())  # the budget went to the forward
    state = model.state_dict()  # the modes are in the checkpoint, and load into a fresh model
    fresh, _ = tiny(steps=2)
    fresh.load_state_dict(state)
    assert {n: m.modes for n, m in adahop.adahop_layers(fresh).items()} == {n: m.modes for n, m in layers.items()}
    # drift re-decides each layer alone (the budget over its own FLOPs): a defined result
    from adahop.drift import measure_drift

    _, more = tiny(steps=1)
    report = measure_drift(model, more)
    assert report["steps"] == 1 and set(report["changed"]) <= set(layers)


def test_the_calibrator_and_finish_calibration_freeze_the_group():
    model, data = tiny(steps=3)
    calibrator = adahop.Calibrator(model)
    x, y = next(data)
    with calibrator.step() as step:
        for xi, yi in step.split(x, y):
            lm_loss(model, xi, yi).backward()
    assert not adahop.is_calibrated(model)
    modes = adahop.finish_calibration(model)  # one step seen: the whole group decides now
    assert adahop.is_calibrated(model) and set(modes) == set(adahop.adahop_layers(model))
    fresh, _ = tiny(steps=3)
    with pytest.raises(ValueError, match="has observed no backward pass yet"):
        adahop.finish_calibration(fresh)


def test_layers_no_conversion_grouped_are_grouped_by_the_calibrator():
    """Layers built from a config (as torchtitan builds them), not by convert_to_adahop_training:
    the Calibrator groups them, and they freeze from one decision over both."""
    cfg = adahop.recipe("adahop_loss_aware", calibration_steps=2, backend="reference",
                        hp_budget=0.2).config.with_gemm_settings(oe_k=4)
    torch.manual_seed(0)
    model = torch.nn.Sequential(adahop.AdaHOPLinear(64, 64, config=cfg, name="a"), torch.nn.GELU(),
                                adahop.AdaHOPLinear(64, 32, config=cfg, name="b"))
    assert model[0].calibration_group is None
    calibrator = adahop.Calibrator(model)
    assert model[0].calibration_group is model[2].calibration_group is not None
    x = torch.randn(64, 64)
    x[:, 3] *= 30
    for _ in range(2):
        with calibrator.step() as step:
            for part in step.split(x):
                model(part).square().mean().backward()
    decided = cfg.model_policy({i: model[j].calibration.summary() for i, j in enumerate((0, 2))})
    assert [model[j].modes for j in (0, 2)] == [policy_result(decided[i])[0] for i in range(2)]
