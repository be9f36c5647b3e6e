"""Calibration micro-batches (``TrainConfig.calibration_micro_batches``, S): a step that begins
with a layer calibrating runs each micro-batch as S parts of batch / S sequences, and the layers
merge the parts into one observation (``adahop.calibration_parts``).

- The first step's gradient is the unsplit one up to summation order; the observations are the
  unsplit ones to float rounding, so calibration decides the same modes at the same step, and
  the SR draws after it are the unsplit run's.
- The data iterator yields the same batches in the same order; recipes without calibration train
  bit for bit as with S = 1.
- A calibration that ends within a step (grad_accum > 1) leaves the compiled model to compile
  once, at the full micro-batch: the step's remaining parts run eagerly.
- Bad values are one-line errors; a split run resumes exactly and refuses another S.
- ``adahop train --calibration-micro-batches S`` reaches the run.
"""

import json

import pytest
import torch

import adahop
from adahop import cli
from adahop.train import distributed as dist_mod
from adahop.train.compile import compile_model
from adahop.train.run_log import read_log
from adahop.train.trainer import TrainConfig, resume_conflicts, train

from test_trainer import SEQ, CountingBatches, config, tiny_model


class RecordedBatches(CountingBatches):
    """CountingBatches that keep every batch they yield."""

    def __init__(self, batch=4, seed=0):
        super().__init__(batch, seed)
        self.seen = []

    def __next__(self):
        batch = super().__next__()
        self.seen.append(batch)
        return batch


def first_step(tmp_path, splits, **kw):
    """(the first step's clipped gradient, flattened; each layer's calibration state after it; the
    losses; the log's 'calibrated' per step; the frozen modes, patterns and SR call counters)."""
    grads, states = [], []

    def hook(step, model):
        if step == 1:  # after opt.step; the gradients stay until the next step's zero_grad
            grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
            states.append({f: m.calibration.to_dict() for f, m in adahop.adahop_layers(model).items()})

    cfg = config(tmp_path, calibration_micro_batches=splits, **kw)
    model = tiny_model()
    summary = train(cfg, model=model, train_batches=CountingBatches(), on_step=hook)
    frozen = {f: (m.modes, m.patterns, m.calls) for f, m in adahop.adahop_layers(model).items()}
    return grads[0], states[0], summary["losses"], [r["calibrated"] for r in read_log(cfg.out_dir)], frozen


def test_split_steps_give_the_unsplit_gradient_and_observations(tmp_path):
    whole, seen_1, losses_1, calibrated_1, frozen_1 = first_step(tmp_path / "s1", 1, calibration_steps=3, steps=5)
    split, seen_2, losses_2, calibrated_2, frozen_2 = first_step(tmp_path / "s2", 2, calibration_steps=3, steps=5)
    torch.testing.assert_close(split, whole, rtol=1e-5, atol=1e-6 * whole.abs().max().item())
    # the logged loss is the mean over the step's tokens either way; step 2 starts from weights
    # that differ by the gradients' summation order only
    assert losses_2[0] == pytest.approx(losses_1[0], rel=1e-6)
    assert losses_2[1] == pytest.approx(losses_1[1], rel=1e-4)
    # one observation of each micro-batch whole: the same votes, the scores to float rounding
    assert seen_2.keys() == seen_1.keys()
    for fqn, state in seen_1.items():
        for role, t in state.items():
            assert seen_2[fqn][role]["votes"] == t["votes"], (fqn, role)
            for stat, v in t["sums"].items():
                assert seen_2[fqn][role]["sums"][stat] == pytest.approx(v, rel=1e-5, abs=1e-9), (fqn, role, stat)
    assert calibrated_2 == calibrated_1 == [False, False, True, True, True]
    # the same modes, and the same SR draws after calibration (BF16 calibration parts count as one
    # call): the MXFP4 steps differ by the weights' float rounding only
    assert frozen_2 == frozen_1
    assert losses_2[4] == pytest.approx(losses_1[4], rel=1e-3)


def test_parts_observed_one_by_one_would_change_the_labels():
    """Why the parts are merged: the detector's scores depend on how many rows a tensor has. A
    gradient with a few outlier tokens among many is 'none' as a whole; its quarters, each with
    fewer rows, are called 'row' on their own. ``calibration_parts`` keeps the whole's label."""
    t = torch.randn(1024, 128, generator=torch.Generator().manual_seed(0))
    t[::97] *= 20  # 11 outlier tokens
    t[:, 5] *= 4  # and an outlier channel
    whole = adahop.patterns.calibration.observe_tensor(t, tau=2.0, k=8)
    alone = [adahop.patterns.calibration.observe_tensor(c, tau=2.0, k=8).pattern for c in t.chunk(4)]
    assert whole.pattern == "none" and alone == ["row"] * 4
    layer = adahop.AdaHOPLinear.from_float(torch.nn.Linear(128, 64),
                                           config=adahop.AdaHOPConfig.from_recipe_name("adahop_lv2"))
    merged = adahop.patterns.calibration.LayerCalibration()
    layer.calibration = merged
    with adahop.calibration_parts(layer, 4):
        for c in t.chunk(4):
            layer._observe("g", c)
        assert layer._parts["g"] == []  # the fourth part completed the observation
    assert merged.tensors["g"].votes == {"row": 0, "col": 0, "none": 1}
    assert merged.tensors["g"].sums["cv_row"] == pytest.approx(whole.cv_row, rel=1e-6)
    assert merged.tensors["g"].sums["cv_col"] == pytest.approx(whole.cv_col, rel=1e-6)


def test_the_data_is_read_as_without_the_split(tmp_path):
    """The same batches in the same order, and the same iterator state after the run: only the
    forward is split."""
    read = {}
    for splits in (1, 2):
        batches = RecordedBatches()
        train(config(tmp_path / f"s{splits}", calibration_steps=4, calibration_micro_batches=splits, steps=5,
                     grad_accum=2), model=tiny_model(), train_batches=batches)
        read[splits] = batches
    assert len(read[1].seen) == len(read[2].seen) == 10  # 5 steps x 2 micro-batches
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(read[1].seen, read[2].seen))
    assert torch.equal(read[1].state_dict()["generator"], read[2].state_dict()["generator"])


@pytest.mark.parametrize("recipe", ["bf16", "mxfp4"])
def test_recipes_without_calibration_train_bit_for_bit_as_unsplit(tmp_path, recipe):
    models, losses = {}, {}
    for splits in (1, 2):
        models[splits] = tiny_model()
        losses[splits] = train(config(tmp_path / f"s{splits}", recipe=recipe, calibration_micro_batches=splits,
                                      steps=4), model=models[splits], train_batches=CountingBatches())["losses"]
    assert losses[1] == losses[2]
    one, two = models[1].state_dict(), models[2].state_dict()  # weights and the layers' state (SR counters)
    assert all(torch.equal(v, two[k]) if isinstance(v, torch.Tensor) else v == two[k] for k, v in one.items())


def test_calibration_ending_within_a_step_compiles_once_at_the_full_batch(tmp_path):
    """Calibration steps 3, grad_accum 2, S = 2: the freeze comes after the first micro-batch of
    step 2. Its second micro-batch runs as 2 parts of 2 rows, eagerly; the model compiles once,
    for the steps after it, at the full micro-batch of 4 rows (run on the compiled model, it would
    compile at 2 rows and then again, with a dynamic batch dim, at 4)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    token_shapes = []

    def counting_backend(gm, example_inputs):
        token_shapes.extend(tuple(t.shape) for t in example_inputs
                            if isinstance(t, torch.Tensor) and t.dtype == torch.long and t.dim() == 2)
        return gm.forward

    cfg = config(tmp_path, calibration_steps=3, calibration_micro_batches=2, grad_accum=2, steps=4)
    model = tiny_model()
    adahop.convert_to_adahop_training(model, config=cfg.adahop)
    compile_model(model, backend=counting_backend)  # on the CPU the trainer compiles nothing itself
    summary = train(cfg, model=model, train_batches=CountingBatches())
    assert [r["calibrated"] for r in read_log(cfg.out_dir)] == [False, True, True, True]
    assert token_shapes == [(4, SEQ)]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert len(summary["losses"]) == 4


def test_bad_values_are_one_line_errors(tmp_path):
    for bad in (0, -2, 2.0, True, "2"):
        with pytest.raises(ValueError, match=r"^calibration_micro_batches must be an int >= 1, got"):
            config(tmp_path, calibration_micro_batches=bad).validate()
    with pytest.raises(ValueError, match=r"^calibration_micro_batches must divide batch_size: 4 sequences do not "
                                         r"split into 3 equal micro-batches$"):
        config(tmp_path, calibration_micro_batches=3).validate()
    config(tmp_path, calibration_micro_batches=4).validate()
    # under --parallel each rank's rows split: 4 over 2 ranks is 2 rows each, not 4 micro-batches
    dist_mod.check_split(4, 2, 2)
    with pytest.raises(ValueError, match="each rank's 2 sequences .* do not split into 4 calibration micro-batches: "
                                         "give a --batch-size that is a multiple of 8"):
        dist_mod.check_split(4, 2, 4)


def test_a_split_run_resumes_exactly_and_refuses_another_split(tmp_path):
    """Killed during calibration (1 of 4 observations, after step 1) and resumed: the losses of
    the uninterrupted run, bit for bit. S changes what the calibration steps compute: a resume
    with another S is refused. A config written before the field existed reads as S = 1."""
    whole = train(config(tmp_path / "whole", calibration_steps=4, calibration_micro_batches=2, steps=5),
                  model=tiny_model(), train_batches=CountingBatches())
    cfg = config(tmp_path / "killed", calibration_steps=4, calibration_micro_batches=2, steps=5)
    first = train(cfg, model=tiny_model(), train_batches=CountingBatches(), stop_after=1)
    with pytest.raises(ValueError, match="calibration_micro_batches: 2 -> 1"):
        train(config(tmp_path / "killed", calibration_steps=4, steps=5), model=tiny_model(),
              train_batches=CountingBatches())
    second = train(cfg, model=tiny_model(seed=123), train_batches=CountingBatches(seed=99))
    assert first["losses"] + second["losses"] == whole["losses"]
    assert [r["loss"] for r in read_log(cfg.out_dir)] == whole["losses"]

    old = config(tmp_path, steps=5).to_dict()
    del old["calibration_micro_batches"]
    assert TrainConfig.from_dict(old).calibration_micro_batches == 1
    assert resume_conflicts(old, config(tmp_path, steps=5)) == []
    # a run saved with x quantized per layer resumes with it shared (the same bits), not with other numerics
    shared = config(tmp_path, steps=5)
    old["adahop"]["share_input"] = not shared.adahop.share_input
    assert resume_conflicts(old, shared) == []
    old["adahop"]["tau"] = 2 * shared.adahop.tau
    assert [c.split(":")[0] for c in resume_conflicts(old, shared)] == ["adahop.tau"]


def test_the_flag_reaches_the_run(corpus, tmp_path, capsys):
    def args(out, *extra):
        return ["train", "--preset", "debug", "--corpus", str(corpus), "--out", str(out), "--steps", "3",
                "--seq-len", "32", "--no-progress", "--calibration-steps", "2", *extra]

    run = tmp_path / "run"
    assert cli.main(args(run, "--calibration-micro-batches", "2")) == 0
    assert json.loads((run / "config.json").read_text())["calibration_micro_batches"] == 2
    assert [r["calibrated"] for r in read_log(run) if "loss" in r] == [False, True, True]
    capsys.readouterr()
    assert cli.main(args(tmp_path / "bad", "--calibration-micro-batches", "3")) == 2  # the debug preset's batch: 4
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "calibration_micro_batches must divide batch_size" in err[0], err
    with pytest.raises(SystemExit):
        cli.main(args(tmp_path / "bad", "--calibration-micro-batches", "0"))


def test_merged_parts_give_the_whole_tensors_quantization_statistics():
    """What the measured policy reads, merged from parts: the tokens' total, the top-k shares from
    the merged slice energies, and the NSRs along the tokens (whose blocks of 32 lie within a
    part) as the whole tensor's; a part of zeros (no energy, NaN NSRs) weighs nothing."""
    from adahop.patterns.calibration import observe_parts, observe_tensor, tensor_part

    t = torch.randn(1024, 128, generator=torch.Generator().manual_seed(1))
    t[::97] *= 20
    t[:, 5] *= 4
    t[768:] = 0  # the last quarter: a part of zeros
    whole = observe_tensor(t, tau=2.0, k=8)
    merged = observe_parts([tensor_part(c, k=8) for c in t.chunk(4)], tau=2.0, k=8)
    assert merged.pattern == whole.pattern
    assert merged.quant["rows"] == whole.quant["rows"] == 1024.0
    for name in ("share_rows@8", "share_cols@8", "share_rows@16", "share_cols@16"):
        assert merged.quant[name] == pytest.approx(whole.quant[name], rel=1e-6), name
    for name in ("nsr_mxfp4_d0", "nsr_iht_d0"):
        assert merged.quant[name] == pytest.approx(whole.quant[name], rel=1e-5), name
    assert all(v == v for v in merged.quant.values() if isinstance(v, float))  # no NaN from the zero part
    # the scale is the tensor's (a gradient can be tiny), not the zero part's: the same scores
    tiny = observe_parts([tensor_part(c * 2.0**-100, k=8) for c in t.chunk(4)], tau=2.0, k=8)
    assert (tiny.cv_row, tiny.cv_col, tiny.row_energy_topk) == (merged.cv_row, merged.cv_col, merged.row_energy_topk)


def test_parts_of_unequal_size_merge_as_the_whole_tensor():
    """Parts of 128, 320 and 576 tokens (whole blocks of 32, as sequences are) whose column means
    differ (the first part's columns are shifted): the merged column variances weigh each part's
    means by its tokens, so the scores, the label and the statistics are the whole tensor's;
    equal weights would misplace the mean."""
    from adahop.patterns.calibration import observe_parts, observe_tensor, tensor_part

    g = torch.Generator().manual_seed(2)
    t = torch.randn(1024, 128, generator=g)
    t[:128] += 3 * torch.randn(128, generator=g)  # the first part's own column means
    t[::97] *= 20
    whole = observe_tensor(t, tau=2.0, k=8)
    parts = t.split([128, 320, 576])
    merged = observe_parts([tensor_part(c, k=8) for c in parts], tau=2.0, k=8)
    assert merged.pattern == whole.pattern
    for name in ("cv_row", "cv_col", "row_energy_topk", "col_energy_topk"):
        assert getattr(merged, name) == pytest.approx(getattr(whole, name), rel=1e-5), name
    assert merged.quant["rows"] == 1024.0
    for name in ("share_rows@8", "share_cols@8", "nsr_mxfp4_d0", "nsr_iht_d0"):
        assert merged.quant[name] == pytest.approx(whole.quant[name], rel=1e-5), name
