"""Calibration micro-batches (``TrainConfig.calibration_micro_batches``, S): a step that begins
with a layer calibrating runs each micro-batch as S micro-batches of batch / S sequences.

- The first step's gradient is the unsplit one up to summation order, and calibration, counted
  in backward passes, ends after calibration_steps / S optimizer steps.
- The data iterator yields the same batches in the same order; recipes without calibration train
  bit for bit as with S = 1.
- A calibration that ends within a step leaves the compiled model to compile once, at the full
  batch: the step's remaining micro-batches run eagerly.
- Bad values are one-line errors; a split run resumes exactly and refuses another S.
- ``adahop train --calibration-micro-batches S`` reaches the run.
"""

import json

import pytest
import torch

import adahop
from adahop import cli
from adahop.train import data as D
from adahop.train import distributed as dist_mod
from adahop.train import sources as S
from adahop.train.compile import compile_model
from adahop.train.precision import validate_schedule
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


def first_gradient_and_losses(tmp_path, splits, **kw):
    """(the first step's clipped gradient, flattened; the losses; the log's 'calibrated' per step)."""
    grads = []

    def hook(step, model):
        if step == 1:  # after opt.step; the gradients stay until the next step's zero_grad
            grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))

    cfg = config(tmp_path, calibration_micro_batches=splits, **kw)
    summary = train(cfg, model=tiny_model(), train_batches=CountingBatches(), on_step=hook)
    return grads[0], summary["losses"], [r["calibrated"] for r in read_log(cfg.out_dir)]


def test_split_steps_give_the_unsplit_gradient_and_calibration_counts_micro_batches(tmp_path):
    whole, losses_1, calibrated_1 = first_gradient_and_losses(tmp_path / "s1", 1, calibration_steps=4, steps=6)
    split, losses_2, calibrated_2 = first_gradient_and_losses(tmp_path / "s2", 2, calibration_steps=4, steps=6)
    torch.testing.assert_close(split, whole, rtol=1e-5, atol=1e-6 * whole.abs().max().item())
    # the logged loss is the mean over the step's tokens either way; step 2 starts from weights
    # that differ by the gradients' summation order only
    assert losses_2[0] == pytest.approx(losses_1[0], rel=1e-6)
    assert losses_2[1] == pytest.approx(losses_1[1], rel=1e-4)
    # 4 backward passes: 2 steps of 2 micro-batches, or 4 unsplit steps
    assert calibrated_2 == [False, True, True, True, True, True]
    assert calibrated_1 == [False, False, False, True, True, True]


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
    """Calibration steps 3, S = 2: the freeze comes after the first micro-batch of step 2. Its
    second micro-batch (2 rows) runs eagerly; the model compiles once, for the steps after it, at
    the full batch of 4 rows (run on the compiled model, it would compile at 2 rows and then
    again, with a dynamic batch dim, at 4)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    token_shapes = []

    def counting_backend(gm, example_inputs):
        token_shapes.extend(tuple(t.shape) for t in example_inputs
                            if isinstance(t, torch.Tensor) and t.dtype == torch.long and t.dim() == 2)
        return gm.forward

    cfg = config(tmp_path, calibration_steps=3, calibration_micro_batches=2, steps=4)
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


def test_the_bf16_phase_must_begin_after_the_split_calibration():
    """ceil(calibration_steps / (grad_accum * S)) optimizer steps calibrate."""
    with pytest.raises(ValueError, match="before the calibration ends"):
        validate_schedule(100, 1, 0.1, 30, 2)  # the phase after step 10, calibration to step 15
    validate_schedule(100, 1, 0.1, 30, 3)  # to step 10
    validate_schedule(100, 2, 0.1, 40, 2)


def test_a_split_run_resumes_exactly_and_refuses_another_split(tmp_path):
    """Killed during calibration (2 of 4 observations, after step 1) and resumed: the losses of
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


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    out = tmp_path_factory.mktemp("corpus")
    src = S.cpython_stdlib_source(modules=("json", "textwrap", "string"), name="stdlib-mini")
    D.build_corpus(out, sources=[src], tokenizer="byte", progress=False)
    return out


def test_the_flag_reaches_the_run(corpus, tmp_path, capsys):
    def args(out, *extra):
        return ["train", "--preset", "debug", "--corpus", str(corpus), "--out", str(out), "--steps", "3",
                "--seq-len", "32", "--no-progress", "--calibration-steps", "4", *extra]

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
