"""The training loop: schedule, every recipe trains, exact resume, atomic checkpoints, safe loading."""

import json
import math

import pytest
import torch

import adahop
from adahop.train import checkpoint as ckpt
from adahop.train.run_log import read_log
from adahop.train.trainer import TrainConfig, lr_at, train

from tiny_lm import TinyLM

VOCAB, SEQ = 64, 32


class CountingBatches:
    """Learnable synthetic data: each row counts up by a random stride from a random start
    (mod VOCAB). Seeded; its position is its generator state."""

    def __init__(self, batch=4, seed=0):
        self.batch = batch
        self.g = torch.Generator().manual_seed(seed)

    def __iter__(self):
        return self

    def __next__(self):
        start = torch.randint(0, VOCAB, (self.batch, 1), generator=self.g)
        stride = torch.randint(1, 4, (self.batch, 1), generator=self.g)
        seq = (start + stride * torch.arange(SEQ + 1)) % VOCAB
        return seq[:, :-1], seq[:, 1:]

    def state_dict(self):
        return {"generator": self.g.get_state()}

    def load_state_dict(self, state):
        self.g.set_state(state["generator"])


def tiny_model(seed=0):
    torch.manual_seed(seed)
    return TinyLM(vocab=VOCAB, d=64, layers=2, heads=4, seq_len=SEQ)


def config(tmp_path, recipe="adahop_lv2", calibration_steps=2, oe_k=4, backend="auto", **kw):
    base = dict(out_dir=str(tmp_path / "run"), steps=8, batch_size=4, seq_len=SEQ,
                lr=3e-3, warmup_steps=2, progress=False, device="cpu")
    base.update(kw)
    q = adahop.AdaHOPConfig.from_recipe_name(recipe, calibration_steps=calibration_steps, backend=backend)
    return TrainConfig(adahop=q.with_gemm_settings(oe_k=oe_k), **base)


def test_lr_schedule():
    cfg = TrainConfig(steps=100, warmup_steps=10, lr=1e-3, min_lr_ratio=0.1)
    assert lr_at(0, cfg) == pytest.approx(1e-4)
    assert lr_at(9, cfg) == pytest.approx(1e-3)
    assert lr_at(10, cfg) == pytest.approx(1e-3)
    assert lr_at(55, cfg) == pytest.approx(0.55e-3)  # cosine midpoint between 1e-3 and 1e-4
    assert lr_at(100, cfg) == pytest.approx(1e-4)
    assert all(lr_at(s, cfg) >= lr_at(s + 1, cfg) for s in range(10, 99))


@pytest.mark.parametrize("recipe", list(adahop.RECIPES))
def test_every_recipe_trains(recipe, tmp_path):
    cfg = config(tmp_path, recipe=recipe, steps=30)
    summary = train(cfg, model=tiny_model(), train_batches=CountingBatches())
    losses = summary["losses"]
    assert len(losses) == 30 and all(math.isfinite(v) for v in losses)
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5
    log = read_log(cfg.out_dir)
    assert [r["step"] for r in log] == list(range(1, 31))
    modes = json.loads((tmp_path / "run" / "modes.json").read_text())
    assert len(modes) == 8 and all(set(m) == {"fprop", "dgrad", "wgrad"} for m in modes.values())


def test_resume_gives_the_same_losses(tmp_path):
    full = train(config(tmp_path / "a", ckpt_every=4), model=tiny_model(), train_batches=CountingBatches())
    cfg = config(tmp_path / "b", ckpt_every=4)
    first = train(cfg, model=tiny_model(), train_batches=CountingBatches(), stop_after=4)
    assert first["steps"] == 4
    # a new process: fresh model (other init) and fresh data iterator, restored from the checkpoint
    second = train(cfg, model=tiny_model(seed=123), train_batches=CountingBatches(seed=99))
    assert first["losses"] + second["losses"] == full["losses"]  # bit for bit
    assert [r["loss"] for r in read_log(cfg.out_dir)] == full["losses"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the checkpoint is loaded onto a GPU")
def test_resume_on_a_gpu_gives_the_same_losses(tmp_path):
    """The trainer loads a checkpoint onto its device; the RNG states inside must still restore
    (torch's generators take CPU byte tensors: this failed on the H200 before the fix)."""
    kw = dict(ckpt_every=4, device="cuda")
    full = train(config(tmp_path / "a", **kw), model=tiny_model(), train_batches=CountingBatches())
    cfg = config(tmp_path / "b", **kw)
    first = train(cfg, model=tiny_model(), train_batches=CountingBatches(), stop_after=4)
    second = train(cfg, model=tiny_model(seed=123), train_batches=CountingBatches(seed=99))
    assert first["losses"] + second["losses"] == full["losses"]


def test_rng_state_restores_from_a_loaded_checkpoint(tmp_path):
    torch.manual_seed(5)
    state = ckpt.rng_state()
    want = torch.rand(3)
    ckpt.save_checkpoint(tmp_path, 1, {"rng": state})
    ckpt.set_rng_state(ckpt.load_checkpoint(tmp_path / "step_000000001.pt")["rng"])
    assert torch.equal(torch.rand(3), want)


def test_on_step_is_called_after_each_step_and_can_switch_modes(tmp_path):
    """The hook sees every step (from 1) with the model; switching the layers to BF16 there
    takes effect from the next step, and a resumed run calls it for the remaining steps."""
    seen = []

    def hook(step, model):
        seen.append(step)
        if step == 6:
            for layer in adahop.adahop_layers(model).values():
                layer.set_modes({"fprop": "bf16", "dgrad": "bf16", "wgrad": "bf16"})

    cfg = config(tmp_path, ckpt_every=4)
    model = tiny_model()
    first = train(cfg, model=model, train_batches=CountingBatches(), stop_after=4, on_step=hook)
    second = train(cfg, model=tiny_model(), train_batches=CountingBatches(), on_step=hook)
    assert seen == list(range(1, 9))
    assert first["steps"] == 4 and len(second["losses"]) == 4
    state = ckpt.load_checkpoint(ckpt.latest_checkpoint(tmp_path / "run" / "checkpoints"))
    layer_states = [v for k, v in state["model"].items() if k.endswith("_extra_state")]
    assert layer_states
    assert all(st["modes"] == {"fprop": "bf16", "dgrad": "bf16", "wgrad": "bf16"} for st in layer_states)


def test_a_non_finite_loss_stops_before_any_checkpoint(tmp_path):
    """Losses are read back every ``sync_every`` steps: a NaN from step 4 is caught at the next
    read, the error names its step, and no checkpoint holds the poisoned state."""

    def poison(step, model):
        if step == 3:
            with torch.no_grad():
                next(model.parameters()).fill_(float("nan"))

    cfg = config(tmp_path, recipe="bf16", steps=8, sync_every=10, ckpt_every=6)
    with pytest.raises(FloatingPointError, match="at step 4"):
        train(cfg, model=tiny_model(), train_batches=CountingBatches(), on_step=poison)
    assert ckpt.latest_checkpoint(tmp_path / "run" / "checkpoints") is None
    assert read_log(cfg.out_dir) == []


def test_every_step_is_logged_whatever_the_sync_interval(tmp_path):
    evals = []

    def eval_fn(model):
        evals.append(1)
        return {"loss": 1.0}

    per_step = train(config(tmp_path / "a", sync_every=1), model=tiny_model(), train_batches=CountingBatches())
    cfg = config(tmp_path / "b", sync_every=3, eval_every=4)
    batched = train(cfg, model=tiny_model(), train_batches=CountingBatches(), eval_fn=eval_fn)
    assert batched["losses"] == per_step["losses"]
    log = read_log(cfg.out_dir)
    steps = [r for r in log if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 9))
    assert all(isinstance(r["loss"], float) and r["tok_per_s"] > 0 and r["grad_norm"] >= 0 for r in steps)
    assert [r["step"] for r in log if "eval" in r] == [4] and len(evals) == 2  # step 4, and the end
    with pytest.raises(ValueError, match="sync_every"):
        config(tmp_path, sync_every=0).validate()


def test_resume_refuses_another_recipe(tmp_path):
    cfg = config(tmp_path, steps=4)
    train(cfg, model=tiny_model(), train_batches=CountingBatches(), stop_after=2)
    with pytest.raises(ValueError, match="adahop_lv2"):
        train(config(tmp_path, steps=4, recipe="bf16"), model=tiny_model(), train_batches=CountingBatches())


def test_interrupted_checkpoint_write_keeps_the_previous(tmp_path, monkeypatch):
    folder = tmp_path / "ck"
    ckpt.save_checkpoint(folder, 1, {"step": 1, "w": torch.ones(3)})

    def broken_save(obj, f):
        f.write(b"PK\x03\x04 partial")
        raise KeyboardInterrupt("killed mid-write")

    monkeypatch.setattr(ckpt.torch, "save", broken_save)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save_checkpoint(folder, 2, {"step": 2, "w": torch.zeros(3)})
    assert ckpt.latest_checkpoint(folder).name == "step_000000001.pt"
    assert sorted(p.name for p in folder.iterdir()) == ["latest", "step_000000001.pt"]  # no temp left
    state = ckpt.load_checkpoint(ckpt.latest_checkpoint(folder))
    assert state["step"] == 1 and torch.equal(state["w"], torch.ones(3))


class _Evil:
    def __reduce__(self):
        return (exec, ("import pathlib; pathlib.Path('PWNED').write_text('x')",))


def test_checkpoint_loading_runs_no_code(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "step_000000001.pt"
    torch.save({"step": 1, "payload": _Evil()}, path)
    with pytest.raises(ValueError, match="cannot load checkpoint"):
        ckpt.load_checkpoint(path)
    assert not (tmp_path / "PWNED").exists()


def test_truncated_checkpoint_is_a_clear_error(tmp_path):
    path = tmp_path / "step_000000001.pt"
    torch.save({"step": 1, "w": torch.ones(1000)}, path)
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(ValueError, match="step_000000001.pt"):
        ckpt.load_checkpoint(path)


def test_bad_config_is_refused_before_work(tmp_path):
    with pytest.raises(ValueError, match="known"):
        train(config(tmp_path, recipe="fp3"), model=tiny_model(), train_batches=CountingBatches())
    with pytest.raises(ValueError, match="steps"):
        train(config(tmp_path, steps=0), model=tiny_model(), train_batches=CountingBatches())
    # a backend that cannot run on the device: refused before the BF16 calibration steps,
    # not at the first MXFP4 step after them
    batches = CountingBatches()
    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        train(config(tmp_path, backend="hopper_fp8"), model=tiny_model(), train_batches=batches)
    with pytest.raises(ValueError, match="backend must be one of .*got 'fp8'"):
        train(config(tmp_path, backend="fp8"), model=tiny_model(), train_batches=batches)
    assert not (tmp_path / "run" / "log.jsonl").exists()
    # bf16 runs no MXFP4 GEMM: a known backend is not asked to run there, an unknown one refused
    config(tmp_path, recipe="bf16", backend="hopper_fp8").validate()
    with pytest.raises(ValueError, match="backend must be one of"):
        config(tmp_path, recipe="bf16", backend="fp8").validate()


def test_config_round_trips_through_json_and_reads_the_flat_layout(tmp_path):
    """config.json holds the AdaHOP settings as one nested object; from_dict gives back an equal
    config, and a run folder of the earlier flat layout (recipe, oe_k, ... beside the training
    fields) reads into the same AdaHOPConfig."""
    from adahop.train.recipes import preset

    cfg = preset("debug", recipe="tseng", oe_k=7, calibration_steps=5, seed=3, out_dir=str(tmp_path))
    assert (cfg.recipe, cfg.seed, cfg.adahop.seed, cfg.adahop.calibration_steps) == ("tseng", 3, 3, 5)
    assert {cfg.adahop.gemm(g).oe_k for g in ("fprop", "dgrad", "wgrad")} == {7}
    back = TrainConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert back == cfg
    flat = {k: v for k, v in cfg.to_dict().items() if k != "adahop"}
    flat.update(recipe="tseng", oe_k=7, calibration_steps=5, backend="auto")
    assert TrainConfig.from_dict(flat) == cfg
    with pytest.raises(ValueError, match="unknown TrainConfig fields"):
        TrainConfig.from_dict({**cfg.to_dict(), "lr_typo": 1})
    with pytest.raises(ValueError, match="unknown preset overrides"):
        preset("debug", lr_typo=1)
    with pytest.raises(ValueError, match="not both"):
        preset("debug", recipe="bf16", adahop=adahop.AdaHOPConfig.from_recipe_name("mxfp4"))


def test_stop_training_from_the_hook_ends_the_run_without_a_checkpoint(tmp_path):
    from adahop.train.trainer import StopTraining

    def hook(step, model):
        if step == 3:
            raise StopTraining

    cfg = config(tmp_path, recipe="bf16", steps=8, ckpt_every=2)
    summary = train(cfg, model=tiny_model(), train_batches=CountingBatches(), on_step=hook, eval_fn=lambda m: {})
    assert summary["stopped"] and summary["steps"] == 3 and len(summary["losses"]) == 3
    assert [p.name for p in ckpt.list_checkpoints(tmp_path / "run" / "checkpoints")] == ["step_000000002.pt"]
    assert summary["final_eval"] is None and not (tmp_path / "run" / "summary.json").exists()
    assert [r["step"] for r in read_log(tmp_path / "run")] == [1, 2, 3]


def test_a_run_with_a_policy_function_resumes(tmp_path):
    """A custom policy_fn is saved by name: the same function resumes, another one is refused."""
    from adahop.train.trainer import resume_conflicts

    def all_iht(summary):
        return {"fprop": "iht", "dgrad": "iht", "wgrad": "iht"}

    def all_mxfp4(summary):
        return {"fprop": "mxfp4", "dgrad": "mxfp4", "wgrad": "mxfp4"}

    import dataclasses

    base = config(tmp_path, steps=6)
    cfg = dataclasses.replace(base, adahop=base.adahop.replace(policy_fn=all_iht))
    train(cfg, model=tiny_model(), train_batches=CountingBatches(), stop_after=3)
    saved = ckpt.load_checkpoint(ckpt.latest_checkpoint(tmp_path / "run" / "checkpoints"))["config"]
    assert resume_conflicts(saved, cfg) == []
    other = dataclasses.replace(base, adahop=base.adahop.replace(policy_fn=all_mxfp4))
    assert [c.split(":")[0] for c in resume_conflicts(saved, other)] == ["adahop.policy_fn"]
    summary = train(cfg, model=tiny_model(), train_batches=CountingBatches())
    assert summary["steps"] == 6 and len(read_log(tmp_path / "run")) >= 6


# ---- a new run in a folder that holds another: the old run moved aside, nothing lost ----------------
def _files(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _old_run(tmp_path, steps=4):
    """A finished bf16 run (a checkpoint every step, the last 2 kept) and its files."""
    cfg = config(tmp_path, recipe="bf16", steps=steps, ckpt_every=1)
    train(cfg, model=tiny_model(), train_batches=CountingBatches(), eval_fn=lambda m: {"loss": 1.0})
    return {k: v for k, v in _files(tmp_path / "run").items() if k != ".lock"}


def test_a_new_run_in_a_folder_of_another_keeps_its_checkpoints_and_moves_the_old_run_aside(tmp_path, capsys):
    """Old run: steps 1-4, checkpoints 3 and 4 kept. A new run of 3 steps into the same folder
    (resume=False) used to have its checkpoints pruned as older than the old run's, leaving
    ``latest`` dangling: now the old run is moved whole into previous-1/, the new one resumes."""
    old = _old_run(tmp_path)
    assert sorted(k for k in old if k.startswith("checkpoints/step")) == [
        "checkpoints/step_000000003.pt", "checkpoints/step_000000004.pt"]
    run = tmp_path / "run"
    cfg = config(tmp_path, recipe="bf16", steps=3, ckpt_every=1, seed=7)
    first = train(cfg, model=tiny_model(), train_batches=CountingBatches(), resume=False, stop_after=2)
    assert [p.name for p in ckpt.list_checkpoints(run / "checkpoints")] == ["step_000000001.pt", "step_000000002.pt"]
    assert ckpt.latest_checkpoint(run / "checkpoints").name == "step_000000002.pt"
    err = capsys.readouterr().err
    assert f"{run} held another run: its files are moved to {run / 'previous-1'}" in err
    assert _files(run / "previous-1") == old  # every file of the old run, unchanged
    assert not (run / "summary.json").exists()  # the old run's summary is not beside the new log
    second = train(cfg, model=tiny_model(seed=3), train_batches=CountingBatches(seed=9))  # resumes the new run
    assert "held another run" not in capsys.readouterr().err
    assert second["steps"] == 3 and len(second["losses"]) == 1
    assert [r["step"] for r in read_log(run) if "loss" in r] == [1, 2, 3] and len(first["losses"]) == 2
    assert ckpt.load_checkpoint(ckpt.latest_checkpoint(run / "checkpoints"))["step"] == 3
    # a third run: previous-2, previous-1 stays as it was
    train(cfg, model=tiny_model(), train_batches=CountingBatches(), resume=False, stop_after=1)
    assert _files(run / "previous-1") == old and (run / "previous-2" / "summary.json").is_file()
    assert sorted(p.name for p in run.iterdir()) == [".lock", "checkpoints", "config.json", "log.jsonl",
                                                     "previous-1", "previous-2"]


def test_a_new_run_killed_before_its_first_checkpoint_leaves_no_old_summary_beside_its_log(tmp_path):
    old = _old_run(tmp_path, steps=2)

    def killed(step, model):
        raise KeyboardInterrupt  # before the first checkpoint

    cfg = config(tmp_path, recipe="bf16", steps=3, ckpt_every=2)
    with pytest.raises(KeyboardInterrupt):
        train(cfg, model=tiny_model(), train_batches=CountingBatches(), resume=False, on_step=killed)
    run = tmp_path / "run"
    assert _files(run / "previous-1") == old
    assert sorted(p.name for p in run.iterdir()) == [".lock", "config.json", "log.jsonl", "previous-1"]


def test_a_move_killed_midway_is_finished_by_the_next_run(tmp_path, monkeypatch):
    """The move is one rename per entry into .previous-1.partial/, then one rename to
    previous-1: killed in between, the next run (even a resume) finishes it first."""
    import os

    from adahop.train import run_folder

    old = _old_run(tmp_path)
    rename, calls = os.rename, []

    def killed_after_two(src, dst):
        calls.append(src)
        if len(calls) == 3:
            raise KeyboardInterrupt
        rename(src, dst)

    monkeypatch.setattr(run_folder.os, "rename", killed_after_two)
    cfg = config(tmp_path, recipe="bf16", steps=4, ckpt_every=1)
    with pytest.raises(KeyboardInterrupt):
        train(cfg, model=tiny_model(), train_batches=CountingBatches(), resume=False)
    monkeypatch.setattr(run_folder.os, "rename", rename)
    run = tmp_path / "run"
    assert (run / ".previous-1.partial").is_dir() and not (run / "previous-1").exists()
    summary = train(cfg, model=tiny_model(), train_batches=CountingBatches())  # a resume: finds nothing to resume
    assert _files(run / "previous-1") == old and not (run / ".previous-1.partial").exists()
    assert len(summary["losses"]) == 4 and "already_finished" not in summary
