"""Precision schedules (adahop.schedule): BF16 blocks and a BF16 phase, in the trainer and in a
loop of one's own; the recipes that carry them (adahop.recipes)."""

import dataclasses
import re

import pytest
import torch

import adahop
from adahop.llama.model import Llama, LlamaConfig
from adahop.train.run_log import read_log
from adahop.train.trainer import TrainConfig, train

from test_trainer import SEQ, VOCAB, CountingBatches, config


def llama(n_layers=4):
    torch.manual_seed(0)
    return Llama(LlamaConfig.from_size("tiny", vocab_size=VOCAB, max_seq_len=SEQ, n_layers=n_layers))


def test_bf16_blocks_keep_the_first_and_last_blocks_unconverted(tmp_path):
    model = llama()
    cfg = dataclasses.replace(config(tmp_path, steps=4), bf16_blocks=(1, 2))
    summary = train(cfg, model=model, train_batches=CountingBatches())
    converted = {fqn.split(".")[1] for fqn in adahop.adahop_layers(model)}
    assert converted == {"1"}  # of blocks 0-3: 0 first, 2 and 3 last
    assert type(model.layers[0].attention.wq) is torch.nn.Linear
    assert type(model.layers[3].feed_forward.w2) is torch.nn.Linear
    assert len(adahop.adahop_layers(model)) == 7 and summary["steps"] == 4
    with pytest.raises(ValueError, match="more blocks in BF16 than the model has"):
        train(dataclasses.replace(cfg, bf16_blocks=(3, 2), out_dir=str(tmp_path / "b")), model=llama(),
              train_batches=CountingBatches())
    for bad in ((1,), (-1, 0), (1.5, 0), "1,2"):
        with pytest.raises(ValueError, match="bf16_blocks must be"):
            dataclasses.replace(cfg, bf16_blocks=bad).validate()


def phase_cfg(tmp_path, name, **kw):
    return dataclasses.replace(config(tmp_path / name, steps=10, calibration_steps=2), bf16_phase_start=0.6,
                               bf16_phase_gemms=("fprop",), **kw)


def test_bf16_phase_switches_the_forward_at_its_step_and_nothing_before(tmp_path):
    """The steps before the switch are those of a run without the phase, bit for bit; after it
    every layer's fprop is bf16 and its other modes are kept; the switch is in the log."""
    plain = train(config(tmp_path / "plain", steps=10, calibration_steps=2), model=llama(),
                  train_batches=CountingBatches())
    model = llama()
    phased = train(phase_cfg(tmp_path, "phase"), model=model, train_batches=CountingBatches())
    assert phased["losses"][:6] == plain["losses"][:6] and phased["losses"][6:] != plain["losses"][6:]
    layers = adahop.adahop_layers(model).values()
    assert all(layer.modes["fprop"] == "bf16" for layer in layers)
    assert any(layer.modes["wgrad"] != "bf16" for layer in layers)
    switch = [r for r in read_log(tmp_path / "phase" / "run") if "bf16_phase" in r]
    assert switch == [{"step": 6, "bf16_phase": {"gemms": ["fprop"], "layers": 28}}]  # 4 blocks x 7 linears


@pytest.mark.parametrize("killed_after", [4, 8])  # before and after the switch (after step 6)
def test_a_killed_run_resumes_and_switches_at_the_same_step(tmp_path, killed_after):
    whole = train(phase_cfg(tmp_path, "whole"), model=llama(), train_batches=CountingBatches())
    cfg = phase_cfg(tmp_path, "killed")
    train(cfg, model=llama(), train_batches=CountingBatches(), stop_after=killed_after)
    resumed_model = llama()
    train(cfg, model=resumed_model, train_batches=CountingBatches())
    losses = [r["loss"] for r in read_log(tmp_path / "killed" / "run") if "loss" in r]
    assert losses == whole["losses"]
    assert [r["step"] for r in read_log(tmp_path / "killed" / "run") if "bf16_phase" in r] == [6]
    assert all(layer.modes["fprop"] == "bf16" for layer in adahop.adahop_layers(resumed_model).values())


def test_bf16_phase_settings_are_checked():
    base = TrainConfig(steps=10)
    for start in (0.0, 1.0, -0.1, float("nan"), True):
        with pytest.raises(ValueError, match="bf16_phase_start must be"):
            dataclasses.replace(base, bf16_phase_start=start).validate()
    for gemms in ((), ("fprop", "fprop"), ("forward",), "fprop"):
        with pytest.raises(ValueError, match="bf16_phase_gemms must be"):
            dataclasses.replace(base, bf16_phase_start=0.5, bf16_phase_gemms=gemms).validate()
    with pytest.raises(ValueError, match="before the calibration ends"):
        dataclasses.replace(base, steps=100, bf16_phase_start=0.1).validate()  # step 10 < 30 calibration steps
    dataclasses.replace(base, steps=100, bf16_phase_start=0.3).validate()
    back = TrainConfig.from_dict(dataclasses.replace(base, bf16_blocks=(1, 2), bf16_phase_start=0.9,
                                                     bf16_phase_gemms=("fprop", "wgrad")).to_dict())
    assert back.bf16_blocks == (1, 2) and back.bf16_phase_gemms == ("fprop", "wgrad")


def test_the_switch_step_is_the_floor_of_the_decimal_fraction_of_the_steps():
    """floor(0.82 * 300) is 246, though 0.82 * 300 is 245.99999999999997 in floats."""
    from adahop.schedule import phase_switch_step

    assert 0.82 * 300 < 246
    assert [phase_switch_step(n, 0.82) for n in (10, 300, 350, 370, 1000)] == [8, 246, 287, 303, 820]
    assert phase_switch_step(7, 0.5) == 3 and phase_switch_step(3, 1 / 3) == 0 and phase_switch_step(10, None) is None
    assert phase_switch_step(100, 0.07) == 7  # 0.07 * 100 = 7.000000000000001: no help needed, none harms


@pytest.mark.parametrize("start", [0.82, 0.5, 0.07, 1 / 3, 0.31])
def test_fewest_steps_for_a_phase_is_the_least_that_begins_after_the_calibration(start):
    from adahop.schedule import calibrated_after, fewest_steps_for_phase, phase_switch_step

    for calibration, accum in ((1, 1), (3, 1), (30, 1), (7, 2), (20, 3)):
        n, after = fewest_steps_for_phase(start, calibration, accum), calibrated_after(calibration, accum)
        assert phase_switch_step(n, start) >= after and phase_switch_step(n - 1, start) < after
    assert fewest_steps_for_phase(0.82, 30, 1) == 37 and fewest_steps_for_phase(0.82, 3, 1) == 4


def test_mxfp4_flop_share_counts_every_linear_and_the_oe_slices():
    from adahop.train.precision import mxfp4_flop_share

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 64))  # 2048 MACs per token each
    cfg = adahop.AdaHOPConfig.from_recipe_name("adahop_lv2", calibration_gemms="iht").with_gemm_settings(oe_k=8)
    adahop.convert_to_adahop_training(model, config=cfg)
    first, second = adahop.adahop_layers(model).values()
    assert mxfp4_flop_share(model, tokens=16) == 1.0  # both calibrating, in IHT + MXFP4
    first.set_modes({"fprop": "iht+oe_left", "dgrad": "bf16", "wgrad": "iht+oe_right"})
    second.set_modes({"fprop": "iht", "dgrad": "iht", "wgrad": "mxfp4"})
    # first: fprop keeps 8 of 16 tokens in BF16, dgrad is BF16, wgrad 8 of K = 64 columns
    expected = ((1 - 8 / 16) + 0 + (1 - 8 / 64) + 3) / 6
    assert mxfp4_flop_share(model, tokens=16) == pytest.approx(expected)
    assert mxfp4_flop_share(model, tokens=16, calibrating={"0"}) == 1.0  # as if "0" still ran its calibration
    assert mxfp4_flop_share(model, tokens=16, gemms=("fprop",)) == pytest.approx((1 - 8 / 16 + 1) / 2)
    assert mxfp4_flop_share(model, tokens=16, gemms=("dgrad",)) == pytest.approx(1 / 2)
    plain = torch.nn.Sequential(torch.nn.Linear(64, 32), model)  # an unconverted linear counts as BF16
    assert mxfp4_flop_share(plain, tokens=16) == pytest.approx(expected * 2 / 3)


def test_every_recipe_adahop_train_accepts_is_a_library_recipe():
    """adahop.recipe gives every name of adahop train --recipe, the default included, as numerics
    and a schedule; from_recipe_name refuses a scheduled one in one line naming adahop.recipe."""
    from adahop import cli
    from adahop.recipes import DEFAULT_RECIPE, RECIPE_NAMES

    parser = cli.build_parser()
    train_parser = next(a for a in parser._actions if a.dest == "command").choices["train"]
    names = next(a for a in train_parser._actions if a.dest == "recipe").choices
    assert list(names) == list(RECIPE_NAMES) and DEFAULT_RECIPE in names
    for name in names:
        r = adahop.recipe(name)
        assert r.name == name and isinstance(r.config, adahop.AdaHOPConfig)
    tail = adahop.recipe("adahop_lv2_tail", calibration_steps=5)
    assert tail.config == adahop.AdaHOPConfig.from_recipe_name("adahop_lv2", calibration_steps=5)
    assert (tail.schedule.bf16_phase_start, tail.schedule.bf16_phase_gemms) == (0.82, ("fprop",))
    assert adahop.recipe("adahop_lv2").schedule == adahop.PrecisionSchedule()  # no phase, no BF16 blocks
    with pytest.raises(ValueError, match=r"use adahop.recipe\('adahop_lv2_tail'\)"):
        adahop.AdaHOPConfig.from_recipe_name("adahop_lv2_tail")
    with pytest.raises(ValueError, match="unknown recipe 'lv3'"):
        adahop.recipe("lv3")
    with pytest.raises(ValueError, match="bf16_phase_start must be"):
        adahop.PrecisionSchedule(bf16_phase_start=1.0)
    with pytest.raises(ValueError, match="a recipe's schedule must be a PrecisionSchedule"):
        adahop.Recipe("mine", tail.config, {"bf16_phase_start": 0.5})
    # the fewest steps, in the recipe's terms: floor(0.82 * 7) = 5 steps done after 5 calibration steps
    tail.check_run(7)
    with pytest.raises(ValueError, match="give at least 7 steps, or recipe adahop_lv2"):
        tail.check_run(6)


def test_a_loop_of_ones_own_switches_with_one_call_at_the_trainers_step():
    """schedule.apply(model, step, total) before each step of a plain loop switches every layer
    once, at the trainer's step (phase_cfg's 0.6 of 10 steps: after 6, as the trainer logs it
    above), keeping the other GEMMs' modes, and changes nothing after it."""
    schedule = adahop.PrecisionSchedule(bf16_phase_start=0.6, bf16_phase_gemms=("fprop",))
    model = llama()
    adahop.convert_to_adahop_training(model, config=adahop.recipe("adahop_lv2").config)
    with pytest.raises(ValueError, match="still calibrating when the BF16 phase begins"):
        schedule.apply(model, 6, 10)
    for layer in adahop.adahop_layers(model).values():  # as if calibrated
        layer.set_modes({"fprop": "iht", "dgrad": "iht", "wgrad": "iht+oe_right"})
    switched = {step: schedule.apply(model, step, 10) for step in range(10)}
    assert [s for s, layers in switched.items() if layers] == [6] == [schedule.switch_step(10)]
    assert switched[6] == list(adahop.adahop_layers(model)) and len(switched[6]) == 28
    assert all(layer.modes == {"fprop": "bf16", "dgrad": "iht", "wgrad": "iht+oe_right"}
               for layer in adahop.adahop_layers(model).values())


def test_a_measured_policy_keeps_its_oe_k_when_the_bf16_phase_begins(tmp_path):
    """The measured policy chooses an OE k per GEMM (8 here, the config's is 4); the BF16 phase
    switches fprop and keeps the k of the GEMMs that stay in MXFP4 (they ran with it before)."""
    def measured(name, steps=4):
        cfg = config(tmp_path / name, recipe="adahop_measured", steps=steps, calibration_steps=2)
        return dataclasses.replace(cfg, adahop=cfg.adahop.replace(hp_budget=0.25))

    before = llama(n_layers=2)
    train(measured("before", steps=2), model=before, train_batches=CountingBatches())
    chosen = {fqn: layer.oe_ks for fqn, layer in adahop.adahop_layers(before).items()}
    assert any(ks and ks.get(g) == 8 for ks in chosen.values() for g in ("dgrad", "wgrad"))
    model = llama(n_layers=2)
    cfg = dataclasses.replace(measured("phase"), bf16_phase_start=0.5, bf16_phase_gemms=("fprop",))
    train(cfg, model=model, train_batches=CountingBatches())
    for fqn, layer in adahop.adahop_layers(model).items():
        assert layer.modes["fprop"] == "bf16"
        kept = {g: k for g, k in (chosen[fqn] or {}).items() if g != "fprop"}
        assert layer.oe_ks == (kept or None), fqn
        assert layer._plan(torch.device("cpu")).dgrad.oe_k == kept.get("dgrad", 4)  # the k that runs


def test_a_resume_with_another_bf16_phase_is_refused(tmp_path):
    """bf16_phase_start and bf16_phase_gemms are what a run computes: a resume may not move or
    drop the phase (the refusal names the field)."""
    cfg = phase_cfg(tmp_path, "run")
    train(cfg, model=llama(), train_batches=CountingBatches(), stop_after=4)
    for change, line in ((dict(bf16_phase_start=0.7), "bf16_phase_start: 0.6 -> 0.7"),
                         (dict(bf16_phase_start=None), "bf16_phase_start: 0.6 -> None"),
                         (dict(bf16_phase_gemms=("fprop", "dgrad")),
                          "bf16_phase_gemms: ('fprop',) -> ('fprop', 'dgrad')")):
        with pytest.raises(ValueError, match=re.escape(line)):
            train(dataclasses.replace(cfg, **change), model=llama(), train_batches=CountingBatches())


def test_bf16_blocks_find_the_blocks_of_other_models():
    """The blocks of a Hugging Face Llama-like (``model.layers``), GPT-2 (``transformer.h``) and a
    torchtitan-like ModuleDict (``layers``) are found by position; a model with none, or with two
    candidate lists, is refused naming what it has."""
    from torch import nn

    from adahop.schedule import block_filter, transformer_blocks

    def block():
        return nn.ModuleDict({"attn": nn.Linear(256, 256), "mlp": nn.Linear(256, 256)})

    hf = nn.Module()
    hf.model = nn.Module()
    hf.model.layers = nn.ModuleList(block() for _ in range(4))
    hf.lm_head = nn.Linear(256, 300)
    gpt2 = nn.Module()
    gpt2.transformer = nn.Module()
    gpt2.transformer.h = nn.ModuleList(block() for _ in range(3))
    titan = nn.Module()
    titan.layers = nn.ModuleDict({str(i): block() for i in range(3)})
    assert transformer_blocks(hf) == [f"model.layers.{i}" for i in range(4)]
    assert transformer_blocks(gpt2) == ["transformer.h.0", "transformer.h.1", "transformer.h.2"]
    assert transformer_blocks(titan) == ["layers.0", "layers.1", "layers.2"]
    keep = block_filter(hf, (1, 1), min_features=0)
    linears = {fqn: m for fqn, m in hf.named_modules() if isinstance(m, nn.Linear)}
    kept_out = sorted(fqn for fqn, m in linears.items() if fqn.startswith("model.") and not keep(m, fqn))
    assert kept_out == ["model.layers.0.attn", "model.layers.0.mlp", "model.layers.3.attn", "model.layers.3.mlp"]
    keep = block_filter(titan, (0, 1), min_features=0)
    assert not keep(titan.layers["2"]["mlp"], "layers.2.mlp") and keep(titan.layers["1"]["mlp"], "layers.1.mlp")
    with pytest.raises(ValueError, match="has none"):
        transformer_blocks(nn.Sequential(nn.Linear(4, 4)))
    both = nn.Module()
    both.layers, both.blocks = nn.ModuleList([block()]), nn.ModuleList([block()])
    with pytest.raises(ValueError, match="has layers, blocks"):
        transformer_blocks(both)
