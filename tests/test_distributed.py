"""Data-parallel training (train/distributed.py) on the CPU: 2 processes, the gloo backend.

Two spawns of 2 processes run every scenario (starting processes is most of the cost):
the first is killed while writing a checkpoint; the second resumes it and runs the others
(uninterrupted runs, a planted NaN loss, a planted NaN gradient, a planted mode mismatch).
Their results are compared here with single-process runs of the same global batch.

- DDP equals one process on the same global batch within reduction-order error, step by step:
  bf16 against batch B; adahop_lv2 against batch B/2 with 2 micro-batches, whose GEMMs see the
  same tokens and draw the same SR numbers (docs/distributed.md, 'Stochastic rounding').
- Every rank freezes the same modes; kill + resume gives the losses of the uninterrupted run;
  the checkpoint loads into one process (model and optimizer).
- A NaN on one rank stops both at the same step with an error naming the rank; a mode mismatch
  stops both with an error naming the layer.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import adahop
from adahop import calibration as C
from adahop.train import distributed as D
from adahop.train.run_log import read_log
from adahop.train.trainer import TrainConfig, train

from rank_exit import exit_rank
from tiny_lm import TinyLM

VOCAB, SEQ, BATCH, STEPS, KILL_STEP = 64, 32, 4, 8, 6
TAIL = {"bf16_phase_start": 0.5, "bf16_phase_gemms": ("fprop",)}  # adahop_lv2_tail's phase, from step 5 of 8


class IndexedBatches:
    """Rows that count up by a random stride from a random start (mod VOCAB); row i of the
    stream depends only on (seed, i), so a batch of 4 is two batches of 2 back to back."""

    def __init__(self, batch=BATCH, seed=0):
        self.batch, self.seed, self.position = batch, seed, 0

    def __iter__(self):
        return self

    def __next__(self):
        rows = []
        for i in range(self.position, self.position + self.batch):
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
            start, stride = torch.randint(0, VOCAB, (1,), generator=g), torch.randint(1, 4, (1,), generator=g)
            rows.append((start + stride * torch.arange(SEQ + 1)) % VOCAB)
        self.position += self.batch
        seq = torch.stack(rows)
        return seq[:, :-1], seq[:, 1:]

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = int(state["position"])


def tiny_model():
    torch.manual_seed(0)
    return TinyLM(vocab=VOCAB, d=64, layers=2, heads=4, seq_len=SEQ)


def config(out, recipe="adahop_lv2", *, parallel="ddp", batch_size=BATCH, grad_accum=1, calibration_steps=2,
           policy_fn=None, **kw):
    q = adahop.AdaHOPConfig.from_recipe_name(recipe, calibration_steps=calibration_steps, backend="reference")
    if policy_fn is not None:
        q = q.replace(policy_fn=policy_fn)
    base = dict(out_dir=str(out), steps=STEPS, batch_size=batch_size, grad_accum=grad_accum, seq_len=SEQ, lr=3e-3,
                warmup_steps=2, progress=False, device="cpu", parallel=parallel, ckpt_every=4)
    base.update(kw)
    return TrainConfig(adahop=q.with_gemm_settings(oe_k=4), **base)


def losses_of(run) -> list[float]:
    return [r["loss"] for r in read_log(run) if "loss" in r]


# ---- the spawned side ------------------------------------------------------------------------------
def _entry(rank, world, port, scenario, root):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        result = globals()[scenario](rank, Path(root))
        Path(root, f"{scenario}.{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()
    exit_rank()


def _expect_error(fn) -> dict:
    try:
        fn()
    except Exception as e:
        return {"type": type(e).__name__, "message": str(e), "traceback": traceback.format_exc()}
    return {"type": None}


def killed_run(rank, root):
    """adahop_lv2 with checkpoints at 4 and 8, killed (both ranks, no cleanup) while writing the
    checkpoint of step 6: after the tensors, before the rename."""
    import torch.distributed.checkpoint as dcp

    real_save = dcp.save

    def save(state, *, storage_writer, **kw):
        real_save(state, storage_writer=storage_writer, **kw)
        if "step_000000006" in str(storage_writer.path):
            os._exit(17)

    dcp.save = save
    train(config(root / "killed", ckpt_every=2), model=tiny_model(), train_batches=IndexedBatches())
    return {}


def scenarios(rank, root):
    out = {}
    runs = [(recipe, recipe, {}) for recipe in ("bf16", "adahop_lv2")]
    runs += [(f"fsdp2_{recipe}", recipe, {"parallel": "fsdp2"}) for recipe in ("bf16", "adahop_lv2")]
    runs += [("fsdp2_bf16_params", "adahop_lv2", {"parallel": "fsdp2", "autocast": "bf16"})]
    runs += [("calibration_split", "adahop_lv2", {"calibration_micro_batches": 2, "calibration_steps": 4})]
    runs += [("tail", "adahop_lv2", TAIL), ("fsdp2_tail", "adahop_lv2", {"parallel": "fsdp2", **TAIL})]
    for name, recipe, kw in runs:
        model = tiny_model()
        summary = train(config(root / name, recipe, **kw), model=model, train_batches=IndexedBatches())
        layers = adahop.adahop_layers(model)
        out[name] = {"losses": summary["losses"], "modes": {f: m.modes for f, m in layers.items()},
                       "calls": {f: m.calls for f, m in layers.items()},
                       "calibration": {f: m.calibration.to_dict() for f, m in layers.items() if m.calibration}}
    if rank == 0:  # the FSDP2 run again from its checkpoint of step 4
        shutil.copytree(root / "fsdp2_adahop_lv2", root / "fsdp2_resumed")
        (root / "fsdp2_resumed" / "checkpoints" / "latest").write_text("step_000000004")
        (root / "fsdp2_resumed" / "summary.json").unlink()
    dist.barrier()
    out["fsdp2_resumed"] = train(config(root / "fsdp2_resumed", parallel="fsdp2"), model=tiny_model(),
                                 train_batches=IndexedBatches())["losses"]
    resumed = train(config(root / "killed", ckpt_every=2), model=tiny_model(), train_batches=IndexedBatches())
    leftover = sorted(p.name for p in (root / "killed" / "checkpoints").iterdir())
    out["resumed"] = {"losses": resumed["losses"], "leftover": leftover}

    def poison_loss(step, model):  # rank 1's logits turn NaN from step 3 on
        if step == 2 and rank == 1:
            model.lm_head.register_forward_hook(lambda m, a, y: y * float("nan"))

    def poison_grad(step, model):  # rank 1's gradient of one weight turns NaN at step 3; its loss stays finite
        if step == 2 and rank == 1:
            model.blocks[0].up.weight.register_hook(lambda g: g * float("nan"))

    for name, hook in (("nan_loss", poison_loss), ("nan_grad", poison_grad)):
        out[name] = _expect_error(lambda hook=hook, name=name: train(
            config(root / name, "bf16", sync_every=4, ckpt_every=2), model=tiny_model(),
            train_batches=IndexedBatches(), on_step=hook))
        out[name]["checkpoints"] = sorted(p.name for p in (root / name / "checkpoints").glob("step_*"))

    def rank_policy(summary):  # a policy that is not the same function on every rank
        return {"fprop": "bf16" if dist.get_rank() == 0 else "iht", "dgrad": "bf16", "wgrad": "bf16"}

    out["mismatch"] = _expect_error(lambda: train(config(root / "mismatch", policy_fn=rank_policy),
                                                  model=tiny_model(), train_batches=IndexedBatches()))
    model = tiny_model()
    adahop.convert_to_adahop_training(model, config=config(root, "adahop_lv2").adahop)
    if rank == 1:
        adahop.adahop_layers(model)["blocks.1.down"].set_modes({"fprop": "iht", "dgrad": "iht", "wgrad": "iht"})
    out["mismatch_at_start"] = _expect_error(lambda: train(config(root / "mismatch2"), model=model,
                                                           train_batches=IndexedBatches()))
    return out


# ---- the test side ---------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(scenario: str, root: Path, world=2, expect_exit=None) -> list[dict] | None:
    ctx = mp.start_processes(_entry, args=(world, _free_port(), scenario, str(root)), nprocs=world, join=False,
                             start_method="spawn")
    try:
        while not ctx.join(timeout=120):
            pass
    except mp.ProcessExitedException as e:
        if expect_exit is None or e.exit_code != expect_exit:
            raise
        for p in ctx.processes:
            p.join(timeout=30)
        return None
    return [json.loads(Path(root, f"{scenario}.{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ddp")
    spawn("killed_run", root, expect_exit=17)
    killed = sorted(p.name for p in (root / "killed" / "checkpoints").iterdir())
    shutil.copytree(root / "killed", root / "killed_at_6")
    ranks = spawn("scenarios", root)
    return {"root": root, "ranks": ranks, "killed": killed}


def single(tmp_path, recipe, **kw) -> list[float]:
    return train(config(tmp_path, recipe, parallel="none", **kw), model=tiny_model(),
                 train_batches=IndexedBatches(batch=kw.get("batch_size", BATCH)))["losses"]


def close(a: list[float], b: list[float], rtol: float) -> float:
    worst = max(abs(x - y) / abs(y) for x, y in zip(a, b))
    assert len(a) == len(b) and worst <= rtol, (worst, a, b)
    return worst


@pytest.mark.parametrize("kind", ["", "fsdp2_"])
def test_bf16_on_2_ranks_equals_one_process_on_the_global_batch(runs, tmp_path, kind):
    ddp = runs["ranks"][0][f"{kind}bf16"]["losses"]
    assert runs["ranks"][1][f"{kind}bf16"]["losses"] == ddp  # the logged loss is the global one, on every rank
    assert losses_of(runs["root"] / f"{kind}bf16") == ddp
    close(ddp, single(tmp_path / "plain", "bf16"), rtol=1e-5)


@pytest.mark.parametrize("kind", ["", "fsdp2_"])
def test_adahop_lv2_on_2_ranks_equals_one_process_with_the_same_micro_batches(runs, tmp_path, kind):
    ddp = runs["ranks"][0][f"{kind}adahop_lv2"]["losses"]
    # The same micro-batches of 2 rows, the same SR numbers: only the gradient sums' order
    # differs. DDP's all-reduce keeps the losses within float rounding; FSDP2's reduce-scatter of
    # shards sums in another order, and once the weights differ by an ulp one MXFP4 code can round
    # the other way, which moves the tiny model's loss by up to ~1e-3 (how far depends on the
    # CPU's float kernels: 4e-4 at step 8 on some machines, none on others).
    close(ddp, single(tmp_path / "accum", "adahop_lv2", batch_size=BATCH // 2, grad_accum=2),
          rtol=2e-3 if kind else 1e-5)
    # against one GEMM over the whole batch: OE and the Hadamard blocks see other rows; still close
    close(ddp, single(tmp_path / "plain", "adahop_lv2"), rtol=3e-2)


@pytest.mark.parametrize("kind", ["", "fsdp2_"])
def test_a_bf16_phase_on_2_ranks_switches_every_rank_at_its_step(runs, tmp_path, kind):
    """The default recipe's phase under DDP and FSDP2: every rank switches every forward to BF16
    after 4 of the 8 steps and keeps its other modes; until then the run is lv2's; it equals one
    process with the same micro-batches as lv2 does."""
    r0, r1 = (r[f"{kind}tail"] for r in runs["ranks"])
    lv2 = runs["ranks"][0][f"{kind}adahop_lv2"]
    assert r0["modes"] == r1["modes"] and r0["losses"] == r1["losses"]
    assert all(m["fprop"] == "bf16" for m in r0["modes"].values())
    assert {f: {**m, "fprop": None} for f, m in r0["modes"].items()} == \
        {f: {**m, "fprop": None} for f, m in lv2["modes"].items()}
    assert any(m["fprop"] != "bf16" for m in lv2["modes"].values())
    assert r0["losses"][:4] == lv2["losses"][:4] and r0["losses"][4:] != lv2["losses"][4:]
    assert [r["step"] for r in read_log(runs["root"] / f"{kind}tail") if "bf16_phase" in r] == [4]
    close(r0["losses"], single(tmp_path / "accum", "adahop_lv2", batch_size=BATCH // 2, grad_accum=2, **TAIL),
          rtol=2e-3 if kind else 1e-5)


def test_split_calibration_on_2_ranks_equals_one_process_with_the_same_micro_batches(runs, tmp_path):
    """calibration_micro_batches 2: each rank's 2 rows run as 2 parts of 1 row in a calibration
    step (the gradient all-reduced once, after the last), one observation of the 2 rows per rank,
    2 merged per step, and one SR call of the rank's stream. One process with 2 micro-batches of
    2 rows, each split in 2, observes the same rows and draws the same SR numbers."""
    r0, r1 = (r["calibration_split"] for r in runs["ranks"])
    assert r0["losses"] == r1["losses"] and r0["modes"] == r1["modes"]
    assert all(sum(c["g"]["votes"].values()) == 4 for c in r0["calibration"].values())
    # the parts of a calibrating micro-batch are one SR call: 8 calls, the last rank r's 7 * 2 + r
    assert set(r0["calls"].values()) == {15} and set(r1["calls"].values()) == {16}
    close(r0["losses"], single(tmp_path / "accum", "adahop_lv2", batch_size=BATCH // 2, grad_accum=2,
                               calibration_micro_batches=2, calibration_steps=4), rtol=1e-5)


def test_fsdp2_with_bf16_parameters_trains_close_to_float32(runs):
    bf16 = runs["ranks"][0]["fsdp2_bf16_params"]
    assert all(math.isfinite(v) for v in bf16["losses"]) and bf16["modes"] == runs["ranks"][1]["fsdp2_bf16_params"][
        "modes"]
    close(bf16["losses"], runs["ranks"][0]["fsdp2_adahop_lv2"]["losses"], rtol=3e-2)


@pytest.mark.parametrize("kind", ["", "fsdp2_"])
def test_every_rank_freezes_the_same_modes_and_draws_its_own_sr_numbers(runs, kind):
    r0, r1 = (r[f"{kind}adahop_lv2"] for r in runs["ranks"])
    assert r0["modes"] == r1["modes"] and all(m is not None for m in r0["modes"].values())
    # frozen after step 1 from both ranks' observation (one each), the same numbers on both
    assert r0["calibration"] == r1["calibration"]
    assert all(sum(c["g"]["votes"].values()) == 2 for c in r0["calibration"].values())
    assert any(mode != "bf16" for m in r0["modes"].values() for mode in m.values())
    modes = json.loads((runs["root"] / f"{kind}adahop_lv2" / "modes.json").read_text())
    assert {fqn: {g: m[g] for g in ("fprop", "dgrad", "wgrad")} for fqn, m in modes.items()} == r0["modes"]
    # 8 forwards each: rank r drew the call numbers r, r + 2, ..., r + 14
    assert set(r0["calls"].values()) == {15} and set(r1["calls"].values()) == {16}


def test_a_run_killed_while_writing_a_checkpoint_resumes_exactly(runs):
    assert ".step_000000006.tmp" in runs["killed"] and "step_000000006" not in runs["killed"]
    assert "latest" in runs["killed"] and "step_000000004" in runs["killed"]
    whole = runs["ranks"][0]["adahop_lv2"]["losses"]
    for r in runs["ranks"]:
        assert r["resumed"]["losses"] == whole[4:]  # steps 5-8, bit for bit
        assert r["resumed"]["leftover"] == ["latest", "step_000000006", "step_000000008"]
    assert losses_of(runs["root"] / "killed") == whole
    fsdp2 = runs["ranks"][0]["fsdp2_adahop_lv2"]["losses"]
    assert all(r["fsdp2_resumed"] == fsdp2[4:] for r in runs["ranks"])  # FSDP2 from step 4, bit for bit


@pytest.mark.parametrize("source", ["killed_at_6", "fsdp2_adahop_lv2"])
def test_a_sharded_checkpoint_resumes_on_another_world_size(runs, tmp_path, source):
    """World size 2 -> 1, from the checkpoint of step 4 of a DDP and of an FSDP2 run, resumed
    under DDP: model and optimizer reshard, the data continues from the global position, and the
    losses stay those of the same run, within what another reduction and SR layout change."""
    run = tmp_path / "run"
    shutil.copytree(runs["root"] / source, run)
    (run / "checkpoints" / "latest").write_text("step_000000004")
    (run / "summary.json").unlink(missing_ok=True)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        batches = IndexedBatches()
        resumed = train(config(run, ckpt_every=2), model=tiny_model(), train_batches=batches)
    finally:
        dist.destroy_process_group()
    whole = runs["ranks"][0][source if source != "killed_at_6" else "adahop_lv2"]["losses"]
    assert batches.position == STEPS * BATCH and [r["step"] for r in read_log(run) if "loss" in r] == list(
        range(1, STEPS + 1))
    close(resumed["losses"], whole[4:], rtol=3e-2)
    assert resumed["losses"][0] == pytest.approx(whole[4], rel=1e-4)  # step 5: the same weights, other rows per GEMM


@pytest.mark.parametrize("case, says", [("nan_loss", "rank 1: loss nan"),
                                        ("nan_grad", "rank 1: a non-finite gradient")])
def test_a_nan_on_one_rank_stops_every_rank_naming_it(runs, case, says):
    for r in runs["ranks"]:
        err = r[case]
        assert err["type"] == "NonFiniteError", err
        assert "at step 3" in err["message"] and says in err["message"] and "rank 0" not in err["message"]
        assert err["checkpoints"] == ["step_000000002"]  # none holds the poisoned step
    assert runs["ranks"][0][case]["message"] == runs["ranks"][1][case]["message"]


def test_a_mode_mismatch_stops_every_rank(runs):
    for r in runs["ranks"]:
        assert r["mismatch"]["type"] == "RankMismatchError", r["mismatch"]
        assert "at the freeze in step 1" in r["mismatch"]["message"] and "fprop" in r["mismatch"]["message"]
        err = r["mismatch_at_start"]
        assert err["type"] == "RankMismatchError" and "'blocks.1.down'" in err["message"], err


def test_bad_launches_are_one_line_errors(monkeypatch):
    for k in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(ValueError, match="torchrun --nproc-per-node N"):
        D.check_launch("ddp")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match="multiple of 4"):
        D.check_launch("ddp", batch_size=6)
    with pytest.raises(ValueError, match="each rank's 2 sequences .* do not split into 4 calibration micro-batches"):
        D.check_launch("ddp", batch_size=8, calibration_micro_batches=4)
    D.check_launch("ddp", batch_size=8, calibration_micro_batches=2)
    with pytest.raises(ValueError, match="--parallel is none"):
        D.check_launch("none")
    D.check_launch("ddp", batch_size=8)


def test_merged_calibration_is_what_one_layer_observing_both_would_hold():
    from adahop.patterns.calibration import LayerCalibration, TensorObservation

    a, b, both = LayerCalibration(), LayerCalibration(), LayerCalibration()
    obs_a = TensorObservation("row", 1.5, 0.25, 0.125, math.nan)
    obs_b = TensorObservation("col", 2.0, 3.0, 0.5, 0.75)
    a.add("x", obs_a)
    b.add("x", obs_b)
    both.add("x", obs_a)
    both.add("x", obs_b)
    merged = LayerCalibration()
    C.add_calibration(merged, a)
    C.add_calibration(merged, b)
    assert merged.to_dict() == both.to_dict()
    assert merged.tensors["x"].finite_counts["col_energy_topk"] == 1  # the NaN was not counted
    assert C._add_stat([1.0, 2.0], [0.5, 0.5]) == [1.5, 2.5] and C._add_stat(None, [1.0]) == [1.0]
    with pytest.raises(C.RankMismatchError):
        C._add_stat([1.0, 2.0], [1.0])


# ---- the command line under torchrun ---------------------------------------------------------------
@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from adahop.data import corpus as data_mod
    from adahop.data import sources

    out = tmp_path_factory.mktemp("corpus")
    src = sources.cpython_stdlib_source(modules=("json", "textwrap"), name="stdlib-mini")
    data_mod.build_corpus(out, sources=[src], tokenizer="byte", progress=False)
    return out


def cli_args(corpus, out, *extra):
    return ["train", "--preset", "debug", "--recipe", "adahop_lv2", "--corpus", str(corpus), "--out", str(out),
            "--steps", "4", "--seq-len", "32", "--calibration-steps", "2", "--no-progress", *extra]


def torchrun(args, nproc=2):
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
           str(_free_port()), "-m", "adahop.cli", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def test_adahop_train_under_torchrun_equals_accumulation_in_one_process(corpus, tmp_path, capsys):
    from adahop import cli

    run = torchrun(cli_args(corpus, tmp_path / "ddp", "--parallel", "ddp", "--batch-size", "4"))
    assert run.returncode == 0, run.stderr[-3000:]
    assert sum("adahop_lv2: 4 steps" in line for line in run.stdout.splitlines()) == 1  # rank 0's summary line
    ckpts = sorted(p.name for p in (tmp_path / "ddp" / "checkpoints").iterdir())
    assert ckpts == ["latest", "step_000000004"]
    assert sorted(p.name for p in (tmp_path / "ddp" / "checkpoints" / "step_000000004").glob("rank_*")) == [
        "rank_00000.pt", "rank_00001.pt"]
    assert cli.main(cli_args(corpus, tmp_path / "one", "--batch-size", "2", "--grad-accum", "2")) == 0
    close(losses_of(tmp_path / "ddp"), losses_of(tmp_path / "one"), rtol=1e-5)
    assert json.loads((tmp_path / "ddp" / "modes.json").read_text()) == json.loads(
        (tmp_path / "one" / "modes.json").read_text())
    # the sharded folder is refused by a run without --parallel, with one line
    capsys.readouterr()
    assert cli.main(cli_args(corpus, tmp_path / "ddp") + ["--steps", "6", "--batch-size", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "sharded checkpoint of a --parallel run" in err, err


@pytest.mark.parametrize("rank", [0, 1])
def test_an_error_of_every_rank_is_printed_by_rank_0_or_after_the_grace(corpus, tmp_path, capsys, monkeypatch, rank):
    """Rank 0 prints an error every rank raises alike at once; another rank first waits for
    torchrun to stop it (which it does once rank 0 has exited), and prints the line itself if
    that does not come: exiting first in silence could take rank 0 down before it printed."""
    from adahop import cli

    for k, v in (("RANK", str(rank)), ("WORLD_SIZE", "2"), ("LOCAL_RANK", str(rank))):
        monkeypatch.setenv(k, v)
    slept = []
    monkeypatch.setattr(cli.time, "sleep", slept.append)
    assert cli.main(cli_args(corpus, tmp_path / "r", "--parallel", "ddp", "--batch-size", "3")) == 2
    assert slept == ([] if rank == 0 else [cli.ALL_RANKS_GRACE_S])
    err = capsys.readouterr().err.strip()
    assert err == (f"adahop train (rank {rank}): error: the global batch of 3 sequences does not split over 2 "
                   "ranks: give a --batch-size that is a multiple of 2")


def test_bad_launches_of_adahop_train_are_one_line(corpus, tmp_path, capsys, monkeypatch):
    from adahop import cli

    for k in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    assert cli.main(cli_args(corpus, tmp_path / "r", "--parallel", "ddp")) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "torchrun --nproc-per-node N" in err, err
    run = torchrun(cli_args(corpus, tmp_path / "r", "--parallel", "ddp", "--batch-size", "3"))
    assert run.returncode != 0
    # every rank refuses the launch on its own; rank 0 prints the line, the others wait for
    # torchrun to stop them once it has exited (and print it themselves if that does not come)
    ours = [line for line in run.stderr.splitlines() if line.startswith("adahop train")]
    assert ours and all(
        line in (f"adahop train (rank {r}): error: the global batch of 3 sequences does not split over 2 ranks: "
                 "give a --batch-size that is a multiple of 2" for r in (0, 1)) for line in ours), run.stderr[-3000:]


# ---- ranks started with different settings -----------------------------------------------------------
def other_settings(rank, root):
    """Rank 1 started with another --lr and --seed (another command line): no step may run."""
    cfg = config(root / "other_settings", "bf16", lr=3e-3 if rank == 0 else 1e-3, seed=rank, progress=rank == 0)
    return _expect_error(lambda: train(cfg, model=tiny_model(), train_batches=IndexedBatches()))


def test_ranks_started_with_different_settings_stop_naming_them(tmp_path):
    ranks = spawn("other_settings", tmp_path)
    for r in ranks:
        assert r["type"] == "RankMismatchError", r
        assert "different settings" in r["message"] and "\n" not in r["message"]
        assert "lr: rank 0 0.003, rank 1 0.001" in r["message"] and "seed: rank 0 0, rank 1 1" in r["message"]
        assert "progress" not in r["message"]  # a rank's own display setting
    assert ranks[0]["message"] == ranks[1]["message"]
    assert not (tmp_path / "other_settings" / "log.jsonl").exists()  # stopped before the first step
