"""Calibration from a loop of one's own (adahop/calibration.py): ``adahop.Calibrator``.

- Under torch's own DDP and FSDP2 on 2 gloo processes (one spawn), a plain loop (AdamW, gradient
  clipping) with the calibrator, each calibration micro-batch run as 2 parts, freezes the same
  modes on both ranks from the same merged calibration, draws each rank's SR numbers, and ends
  with the weights of ``adahop train`` (``--parallel ddp`` / ``fsdp2``) on the same data; a
  calibrating pass outside ``split`` is an error there.
- In one process it calibrates as the trainer does with the same split.
- A step's parts, the split of dicts and tuples, and bad input (one-line errors).
"""

from __future__ import annotations

import contextlib
import json
import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_distributed import BATCH, IndexedBatches, _free_port, config, tiny_model

import adahop
from adahop.train.trainer import train

from rank_exit import exit_rank

STEPS = 4


def run_config(out, parallel, calibration_steps=4):
    """calibration_steps 4 over 2 parts a micro-batch: with 2 ranks, the freeze after step 2 (after
    one update); constant lr (no warm-up, no decay) and no weight decay, as the own loop's AdamW."""
    return config(out, parallel=parallel, steps=STEPS, calibration_steps=calibration_steps, calibration_micro_batches=2,
                  warmup_steps=0, min_lr_ratio=1.0, weight_decay=0.0)


def own_loop(cfg, rank: int, world: int, wrap, no_sync=None) -> torch.nn.Module:
    """A user's loop: convert, wrap (DDP, FSDP2), AdamW, clip; ``adahop.Calibrator`` around each
    step. ``no_sync(module)``: the context of a part that does not reduce the gradient yet."""
    model = tiny_model()
    adahop.convert_to_adahop_training(model, config=cfg.adahop)
    forward = wrap(model)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                            weight_decay=0.0)
    calibrator = adahop.Calibrator(model, micro_batches=cfg.calibration_micro_batches)
    batches = IndexedBatches()
    rows = BATCH // world
    for _ in range(STEPS):
        inputs, targets = next(batches)
        inputs, targets = inputs[rank * rows:(rank + 1) * rows], targets[rank * rows:(rank + 1) * rows]
        with calibrator.step() as step:
            for i, (x, y) in enumerate(step.split(inputs, targets)):
                last = i == step.parts - 1
                with contextlib.nullcontext() if last or no_sync is None else no_sync(forward):
                    loss = torch.nn.functional.cross_entropy(forward(x).float().flatten(0, 1), y.flatten())
                    (loss / step.parts).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model


def state(model) -> dict:
    layers = adahop.adahop_layers(model)
    return {"modes": {f: m.modes for f, m in layers.items()}, "calls": {f: m.calls for f, m in layers.items()},
            "calibration": {f: m.calibration.to_dict() for f, m in layers.items()}}


def weight_difference(a, b) -> float:
    def whole(p):  # (an FSDP2 shard: the whole parameter)
        return p.full_tensor() if hasattr(p, "full_tensor") else p

    return max(float((whole(p).detach() - whole(q).detach()).abs().max()) for p, q in zip(a.parameters(),
                                                                                             b.parameters()))


# ---- 2 processes ----------------------------------------------------------------------------------
def shard(model):
    """FSDP2: each block, then the model (float32 parameters, gradients reduced in float32)."""
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block)
    return fully_shard(model)


def outside_split() -> str | None:
    """A calibrating step whose forward and backward run outside ``step.split``: the error."""
    model = calibrating_model()
    calibrator = adahop.Calibrator(model)
    inputs, targets = next(IndexedBatches(batch=2))
    try:
        with calibrator.step():
            torch.nn.functional.cross_entropy(model(inputs).flatten(0, 1), targets.flatten()).backward()
    except ValueError as e:
        return str(e)
    return None


def _loops(rank, world, root) -> dict:
    """The trainer and a loop of one's own, under DDP and under FSDP2, on the same data."""
    from torch.nn.parallel import DistributedDataParallel

    result = {}
    for kind in ("ddp", "fsdp2"):
        cfg = run_config(Path(root) / kind, kind)
        trainer_model = tiny_model()
        train(cfg, model=trainer_model, train_batches=IndexedBatches())
        if kind == "ddp":
            # (a layer's SR counter is a buffer, per rank: no broadcast of rank 0's before each forward)
            ours = own_loop(cfg, rank, world, lambda m: DistributedDataParallel(m, broadcast_buffers=False),
                            no_sync=lambda m: m.no_sync())
        else:
            ours = own_loop(cfg, rank, world, shard)
        result[kind] = {"own": state(ours), "trainer": state(trainer_model),
                        "weights": weight_difference(ours, trainer_model)}
    return result


def _loss_aware(rank, world, root) -> dict:
    """A policy over the whole model under DDP: the trainer and a loop of one's own."""
    from torch.nn.parallel import DistributedDataParallel

    # one calibration step: each rank's own observation alone would be complete, the merged one
    # is what the decision must read
    cfg = config(Path(root), "adahop_loss_aware", parallel="ddp", steps=STEPS, calibration_steps=1,
                 calibration_micro_batches=2, warmup_steps=0, min_lr_ratio=1.0, weight_decay=0.0)
    trainer_model = tiny_model()
    train(cfg, model=trainer_model, train_batches=IndexedBatches())
    ours = own_loop(cfg, rank, world, lambda m: DistributedDataParallel(m, broadcast_buffers=False),
                    no_sync=lambda m: m.no_sync())
    layers = list(adahop.adahop_layers(ours).values())
    decided = layers[0].config.model_policy({i: m.calibration.summary() for i, m in enumerate(layers)})
    merged = [adahop.policy.policy_result(decided[i])[0] for i in range(len(layers))]
    return {"own": state(ours), "trainer": state(trainer_model), "from_merged": merged}


def _entry(rank, world, port, root, scenario):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        if scenario == "outside":
            result = {"outside": outside_split()}
        else:
            result = (_loss_aware if scenario == "loss_aware" else _loops)(rank, world, root)
        Path(root, f"result.{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()
    exit_rank()


def _spawn(root: Path, scenario: str) -> list[dict]:
    mp.start_processes(_entry, args=(2, _free_port(), str(root), scenario), nprocs=2, start_method="spawn")
    return [json.loads(Path(root, f"result.{r}.json").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return _spawn(tmp_path_factory.mktemp("calibrator"), "loops")


@pytest.fixture(scope="module")
def outside_ranks(tmp_path_factory):
    return _spawn(tmp_path_factory.mktemp("calibrator_outside"), "outside")


@pytest.mark.parametrize("kind", ["ddp", "fsdp2"])
def test_a_loop_of_ones_own_freezes_the_trainers_modes_on_every_rank(ranks, kind):
    r0, r1 = (r[kind] for r in ranks)
    assert r0["own"]["modes"] == r1["own"]["modes"] and all(m is not None for m in r0["own"]["modes"].values())
    assert any(mode != "bf16" for m in r0["own"]["modes"].values() for mode in m.values())
    assert r0["own"]["calibration"] == r1["own"]["calibration"]  # the merged numbers, the same on both
    # 2 rows a rank, 2 parts of 1 row: one observation a rank and step, merged: frozen after step 2
    assert all(sum(c["g"]["votes"].values()) == 4 for c in r0["own"]["calibration"].values())
    for r in (r0, r1):  # equal to adahop train's on the same data
        assert r["own"]["modes"] == r["trainer"]["modes"] and r["own"]["calibration"] == r["trainer"]["calibration"]
        assert r["own"]["calls"] == r["trainer"]["calls"]
        assert r["weights"] == 0.0
    # the parts of a calibrating micro-batch are one SR call: 4 calls, the last rank r's 3 * 2 + r
    assert set(r0["own"]["calls"].values()) == {7} and set(r1["own"]["calls"].values()) == {8}


def test_the_loss_aware_policy_freezes_every_rank_together(tmp_path):
    """Every layer's ranks merged before the whole-model decision: the modes are the policy's on
    the merged calibration (2 observations, one a rank), the same on both ranks, as the
    trainer's."""
    r0, r1 = _spawn(tmp_path, "loss_aware")
    assert r0["own"]["modes"] == r1["own"]["modes"] and all(m is not None for m in r0["own"]["modes"].values())
    assert r0["own"]["calibration"] == r1["own"]["calibration"]
    assert all(sum(c["g"]["votes"].values()) == 2 for c in r0["own"]["calibration"].values())
    assert list(r0["own"]["modes"].values()) == r0["from_merged"]
    for r in (r0, r1):
        assert r["own"]["modes"] == r["trainer"]["modes"] and r["own"]["calibration"] == r["trainer"]["calibration"]


def test_a_calibrating_pass_outside_split_is_an_error_under_several_ranks(outside_ranks):
    assert all("outside step.split(...)" in r["outside"] for r in outside_ranks)


# ---- one process ----------------------------------------------------------------------------------
def test_in_one_process_it_calibrates_as_the_trainer(tmp_path):
    cfg = run_config(tmp_path, "none", calibration_steps=2)
    trainer_model = tiny_model()
    train(cfg, model=trainer_model, train_batches=IndexedBatches())
    ours = own_loop(cfg, 0, 1, lambda m: m)
    assert state(ours) == state(trainer_model) and all(m is not None for m in state(ours)["modes"].values())
    assert weight_difference(ours, trainer_model) == 0.0


def test_in_one_process_the_loss_aware_policy_freezes_as_the_trainer(tmp_path):
    """A policy over the whole model (every layer waits for the others, then one decision): the
    trainer and a loop of one's own freeze the same modes at the same step, the parts of a
    micro-batch merged into one observation."""
    cfg = config(tmp_path, "adahop_loss_aware", parallel="none", steps=STEPS, calibration_steps=2,
                 calibration_micro_batches=2, warmup_steps=0, min_lr_ratio=1.0, weight_decay=0.0)
    trainer_model = tiny_model()
    train(cfg, model=trainer_model, train_batches=IndexedBatches())
    ours = own_loop(cfg, 0, 1, lambda m: m)
    assert state(ours) == state(trainer_model) and all(m is not None for m in state(ours)["modes"].values())
    assert all(sum(c["g"]["votes"].values()) == 2 for c in state(ours)["calibration"].values())
    assert weight_difference(ours, trainer_model) == 0.0


def calibrating_model(calibration_steps=2):
    model = tiny_model()
    adahop.convert_to_adahop_training(model, config=config("unused", calibration_steps=calibration_steps).adahop)
    return model


def test_a_step_runs_its_parts_while_calibrating_and_whole_after():
    model = calibrating_model()
    calibrator = adahop.Calibrator(model, micro_batches=2)
    batches = IndexedBatches()
    seen = []
    for _ in range(3):
        inputs, targets = next(batches)
        with calibrator.step() as step:
            for x, y in step.split(inputs, targets):
                seen.append(x.shape[0])
                torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    # steps 1 and 2 calibrate in 2 parts of 2 rows (one observation each), step 3 runs whole
    assert seen == [2, 2, 2, 2, 4] and adahop.is_calibrated(model)


def test_split_takes_dicts_lists_and_tuples():
    calibrator = adahop.Calibrator(calibrating_model(), micro_batches=2)
    x = torch.arange(8).reshape(4, 2)
    with calibrator.step() as step:
        parts = list(step.split({"input_ids": x, "labels": [x, (x,)]}))
    assert len(parts) == 2 and torch.equal(parts[1]["input_ids"], x[2:])
    assert torch.equal(parts[0]["labels"][1][0], x[:2]) and isinstance(parts[0]["labels"][1], tuple)


def test_bad_input_is_a_one_line_error():
    model = calibrating_model()
    for bad in (0, True, 1.5):
        with pytest.raises(ValueError, match="micro_batches must be an int >= 1"):
            adahop.Calibrator(model, micro_batches=bad)
    calibrator = adahop.Calibrator(model, micro_batches=2)
    with calibrator.step() as step:
        with pytest.raises(ValueError, match=r"\(3, 2\) does not split into 2 equal parts"):
            next(step.split(torch.zeros(3, 2)))
        with pytest.raises(ValueError, match="split takes tensors"):
            next(step.split("text"))
        with pytest.raises(ValueError, match="split needs a micro-batch"):
            next(step.split())
