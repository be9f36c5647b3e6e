"""The size rule of adahop.convert (which nn.Linear layers stay in BF16 for being too small), its
composition with the LM-head rule, ``bf16_linears``, and the refusal of bad thresholds."""

from __future__ import annotations

import pytest
from torch import nn

import adahop
from adahop import convert as C

CFG = adahop.AdaHOPConfig.from_recipe_name("mxfp4", backend="reference")


class Sizes(nn.Module):
    """Linears of several sizes, min(in, out) in brackets, and a tied LM head."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.small = nn.Linear(32, 16)  # [16]
        self.wide = nn.Linear(32, 256)  # [32]
        self.mid = nn.Linear(64, 64)  # [64]
        self.tall = nn.Linear(512, 128)  # [128]
        self.big = nn.Linear(128, 128)  # [128]
        self.proj = nn.Linear(32, 64)  # [32]
        self.head = nn.Linear(256, 64)  # [64]: an LM head by its name
        self.tied = nn.Linear(32, 64, bias=False)  # [32]
        self.tied.weight = self.embed.weight  # an LM head by its tied weight


def converted(model):
    return set(adahop.adahop_layers(model))


def test_size_filter_alone():
    m = Sizes()
    keep = C.size_filter(64)
    assert {n for n, mod in m.named_modules() if type(mod) is nn.Linear and keep(mod, n)} == {
        "mid", "tall", "big", "head"}
    assert all(C.size_filter(0)(mod, n) for n, mod in m.named_modules() if type(mod) is nn.Linear)
    assert not any(C.size_filter(10_000)(mod, n) for n, mod in m.named_modules() if type(mod) is nn.Linear)


@pytest.mark.parametrize("min_features, expected", [
    (0, {"small", "wide", "mid", "tall", "big", "proj"}),  # every layer but the two LM heads
    (17, {"wide", "mid", "tall", "big", "proj"}),
    (64, {"mid", "tall", "big"}),  # the rule is on min(in, out): wide (32 -> 256) goes, head stays out
    (65, {"tall", "big"}),
    (129, set()),
])
def test_default_filter_composes_size_and_lm_head(min_features, expected):
    m = Sizes()
    out = adahop.convert_to_adahop_training(m, config=CFG,
                                            module_filter_fn=C.default_module_filter(m, min_features=min_features))
    assert out is m and converted(m) == expected
    assert type(m.head) is nn.Linear and type(m.tied) is nn.Linear  # LM heads at every threshold


def test_default_threshold_converts_every_size():
    # MIN_FEATURES is the library default; at 0 the default conversion is the LM-head rule alone
    m = Sizes()
    adahop.convert_to_adahop_training(m, config=CFG)
    expected = {n for n, mod in Sizes().named_modules()
                if type(mod) is nn.Linear and n not in ("head", "tied")
                and min(mod.in_features, mod.out_features) >= C.MIN_FEATURES}
    assert converted(m) == expected


def test_bf16_linears_says_why():
    m = Sizes()
    adahop.convert_to_adahop_training(m, config=CFG, module_filter_fn=C.default_module_filter(m, min_features=64))
    reasons = C.bf16_linears(m, min_features=64)
    assert set(reasons) == {"small", "wide", "proj", "head", "tied"}
    assert reasons["head"] == "LM head (name ends in 'head')"
    assert reasons["tied"] == "LM head (weight tied to an nn.Embedding)"
    assert reasons["small"] == "size: min(in_features, out_features) = 16 < min_features = 64"
    assert reasons["wide"] == "size: min(in_features, out_features) = 32 < min_features = 64"
    # a layer both rules accept but a custom filter refused
    m = Sizes()
    default = C.default_module_filter(m)
    adahop.convert_to_adahop_training(m, config=CFG, module_filter_fn=lambda mod, fqn: default(mod, fqn)
                                      and fqn != "big")
    assert C.bf16_linears(m) == {"big": "refused by the module_filter_fn given",
                                 "head": "LM head (name ends in 'head')",
                                 "tied": "LM head (weight tied to an nn.Embedding)"}


def test_a_model_that_is_one_linear():
    lin = nn.Linear(32, 16)
    assert adahop.convert_to_adahop_training(lin, config=CFG, module_filter_fn=C.default_module_filter(
        lin, min_features=32)) is lin
    assert type(adahop.convert_to_adahop_training(lin, config=CFG)) is adahop.AdaHOPLinear


@pytest.mark.parametrize("bad", [-1, 1.5, 64.0, "64", None, True])
def test_bad_thresholds_are_one_line_value_errors(bad):
    m = Sizes()
    for make in (lambda: C.size_filter(bad), lambda: C.default_module_filter(m, min_features=bad),
                 lambda: C.bf16_linears(m, min_features=bad)):
        with pytest.raises(ValueError, match=r"^min_features must be an int >= 0") as e:
            make()
        assert "\n" not in str(e.value)
