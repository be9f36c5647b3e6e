"""Training-side precision options (train/precision.py): BF16 blocks and a BF16 phase."""

import dataclasses

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
    from adahop.train.precision import phase_switch_step

    assert 0.82 * 300 < 246
    assert [phase_switch_step(n, 0.82) for n in (10, 300, 350, 370, 1000)] == [8, 246, 287, 303, 820]
    assert phase_switch_step(7, 0.5) == 3 and phase_switch_step(3, 1 / 3) == 0 and phase_switch_step(10, None) is None
    assert phase_switch_step(100, 0.07) == 7  # 0.07 * 100 = 7.000000000000001: no help needed, none harms


@pytest.mark.parametrize("start", [0.82, 0.5, 0.07, 1 / 3, 0.31])
def test_fewest_steps_for_a_phase_is_the_least_that_begins_after_the_calibration(start):
    from adahop.train.precision import calibrated_after, fewest_steps_for_phase, phase_switch_step

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
