"""The command line end to end on a small offline corpus: train, resume, eval, compare, errors."""

import json
import math
from pathlib import Path

import pytest

from adahop import cli
from adahop.data import corpus as D
from adahop.data import sources as S
from adahop.train.compare import steady_tokens_per_s


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    out = tmp_path_factory.mktemp("corpus")
    src = S.cpython_stdlib_source(modules=("json", "textwrap", "string", "argparse"), name="stdlib-mini")
    D.build_corpus(out, sources=[src], tokenizer="byte", progress=False)
    return out


def train_args(corpus, out, recipe="adahop_lv2", steps=6):
    return ["train", "--preset", "debug", "--recipe", recipe, "--corpus", str(corpus), "--out", str(out),
            "--steps", str(steps), "--seq-len", "32", "--no-progress"]


def losses(run):
    records = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "loss" in r]


def test_train_resume_eval_compare(corpus, tmp_path, capsys, monkeypatch):
    """A run killed after 4 of 6 steps and resumed gives the losses of the uninterrupted run, bit
    for bit, step by step; then eval and compare read the runs."""
    import adahop.train.trainer as trainer_mod

    lv2, whole, bf16 = tmp_path / "lv2", tmp_path / "whole", tmp_path / "bf16"
    assert cli.main(train_args(corpus, whole, steps=6)) == 0
    train = trainer_mod.train
    monkeypatch.setattr(trainer_mod, "train", lambda *a, **kw: train(*a, **kw, stop_after=4))
    assert cli.main(train_args(corpus, lv2, steps=6)) == 0  # killed after step 4 (its checkpoint)
    monkeypatch.setattr(trainer_mod, "train", train)
    assert len(losses(lv2)) == 4
    resumed = []  # what the resuming process trained (a restart from scratch logs the same six losses)
    monkeypatch.setattr(trainer_mod, "train", lambda *a, **kw: resumed.append(train(*a, **kw)) or resumed[-1])
    assert cli.main(train_args(corpus, lv2, steps=6)) == 0  # resumes at step 4
    monkeypatch.setattr(trainer_mod, "train", train)
    assert resumed[0]["losses"] == losses(whole)[4:]  # it ran steps 5 and 6 only, from the checkpoint
    assert losses(lv2) == losses(whole) and len(losses(whole)) == 6
    assert cli.main(train_args(corpus, bf16, recipe="bf16")) == 0

    assert cli.main(["eval", "--run", str(lv2), "--tasks", "--heldout-batches", "4"]) == 0
    ev = json.loads((lv2 / "eval.json").read_text())
    assert ev["heldout"]["sources"]["stdlib-mini"]["bpb"] > 0

    png = tmp_path / "curves.png"
    assert cli.main(["compare", str(bf16), str(lv2), "--plot", str(png)]) == 0
    table = capsys.readouterr().out
    assert "| adahop_lv2 | 6 |" in table and "| bf16 | 6 |" in table
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_errors_before_work(corpus, tmp_path, capsys):
    assert cli.main(train_args(tmp_path / "no-corpus", tmp_path / "r")) == 2
    assert "manifest.json" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["train", "--preset", "huge"])
    with pytest.raises(SystemExit):
        cli.main(["train", "--recipe", "fp3"])
    run = tmp_path / "r2"
    assert cli.main(train_args(corpus, run, steps=2)) == 0
    assert cli.main(train_args(corpus, run, recipe="mxfp4", steps=3)) == 2  # checkpoint of another recipe
    assert "adahop_lv2" in capsys.readouterr().err
    assert cli.main(["eval", "--run", str(tmp_path / "nothing")]) == 2


def test_steady_tokens_per_s_skips_calibration_warmup_and_eval_steps():
    records = [{"step": i + 1, "tok_per_s": 10.0} for i in range(5)]  # calibration (slow, compiling)
    records += [{"step": i + 6, "tok_per_s": 100.0 + i} for i in range(15)]
    records[12]["eval"] = {"loss": 1.0}
    records[12]["tok_per_s"] = 1.0  # a step that also evaluated
    assert steady_tokens_per_s(records, calibration_steps=5) == 108.0
    assert steady_tokens_per_s([], 0) is None


def test_steady_tokens_per_s_counts_steps_not_records():
    # log_every = 5: records at steps 5, 10, ..., 100; calibration 30 steps -> steps 35.. count
    records = [{"step": s, "tok_per_s": 1.0 if s <= 30 else float(s)} for s in range(5, 101, 5)]
    assert steady_tokens_per_s(records, calibration_steps=30) == 70.0


def test_oe_k_and_calibration_overrides(corpus, tmp_path):
    """--oe-k and --calibration-steps reach the run's config and its layers (the modes are frozen
    after that many steps)."""
    run = tmp_path / "k"
    args = train_args(corpus, run, steps=3) + ["--oe-k", "3", "--calibration-steps", "2"]
    assert cli.main(args) == 0
    cfg = json.loads((run / "config.json").read_text())
    q = cfg["adahop"]
    assert [q[g]["oe_k"] for g in ("fprop", "dgrad", "wgrad")] == [3, 3, 3] and q["calibration_steps"] == 2
    records = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    assert [r["calibrated"] for r in records if "loss" in r] == [False, True, True]
    assert cli.main(train_args(corpus, tmp_path / "bad", steps=1) + ["--oe-k", "0"]) == 2


def test_compile_flag_reaches_the_run(corpus, tmp_path):
    """--compile model trains with the model compiled (recorded in the run's config); the
    default is 'auto' (nothing on the CPU); --cudagraphs on the CPU is one line, exit 2."""
    run = tmp_path / "c"
    assert cli.main(train_args(corpus, run, recipe="bf16", steps=2) + ["--compile", "model"]) == 0
    assert json.loads((run / "config.json").read_text())["compile"] == "model"
    assert len(losses(run)) == 2
    plain = tmp_path / "e"
    assert cli.main(train_args(corpus, plain, recipe="bf16", steps=2)) == 0
    assert json.loads((plain / "config.json").read_text())["compile"] == "auto"
    assert cli.main(train_args(corpus, tmp_path / "g", recipe="bf16", steps=2) + ["--cudagraphs"]) == 2
    assert cli.main(train_args(corpus, tmp_path / "h", recipe="bf16", steps=2)
                    + ["--compile", "blocks", "--cudagraphs"]) == 2


# ---- a user's mistakes: one line, exit 2, nothing written ----------------------------------------
def one_line_error(capsys, *fragments):
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    for f in fragments:
        assert f in err, (f, err)
    return err


def test_unwritable_out_is_refused_before_the_corpus_is_read(tmp_path, capsys):
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    missing_corpus = tmp_path / "no-corpus"  # would fail later, but --out is checked first
    for out, why in ((a_file, "is not a folder"), (a_file / "sub", "not a writable folder"),
                     ("/proc/adahop-x", "not a writable folder")):
        assert cli.main(train_args(missing_corpus, out)) == 2
        one_line_error(capsys, str(out), why)
    assert cli.main(["data", "--out", str(a_file), "--sources", "shakespeare"]) == 2
    one_line_error(capsys, str(a_file), "is not a folder")


def test_bad_device_and_numbers_are_refused(corpus, tmp_path, capsys):
    import torch

    if not torch.cuda.is_available():
        assert cli.main(train_args(corpus, tmp_path / "r") + ["--device", "cuda"]) == 2
        one_line_error(capsys, "'cuda'", "no usable CUDA GPU", "--device cpu")
    assert cli.main(train_args(corpus, tmp_path / "r") + ["--device", "tpu7"]) == 2
    one_line_error(capsys, "unknown device 'tpu7'", "cpu, cuda")
    for lr in ("inf", "nan", "-1", "0"):
        assert cli.main(train_args(corpus, tmp_path / "r") + ["--lr", lr]) == 2
        one_line_error(capsys, "lr must be a finite number > 0")
    with pytest.raises(SystemExit) as e:
        cli.main(train_args(corpus, tmp_path / "r", steps=0))
    assert e.value.code == 2
    assert not (tmp_path / "r" / "log.jsonl").exists()


def test_divergence_is_one_line_naming_the_step_and_the_checkpoint(corpus, tmp_path, capsys, monkeypatch):
    import torch

    import adahop.train.run as run_mod

    open_run = run_mod.open_run

    def poisoned(cfg, corpus, **kw):  # the logits turn NaN from the 4th forward on
        model, batches = open_run(cfg, corpus, **kw)
        calls = [0]

        def hook(module, args, out):
            calls[0] += 1
            return out * torch.nan if calls[0] >= 4 else out

        model.register_forward_hook(hook)
        return model, batches

    monkeypatch.setattr(run_mod, "open_run", poisoned)
    run = tmp_path / "nan"
    assert cli.main(train_args(corpus, run, recipe="adahop_lv2_tail", steps=6)) == 2
    one_line_error(capsys, "training diverged", "at step 4", "(adahop_lv2_tail, lr 0.003)", "no checkpoint was written")


def test_a_foreign_checkpoint_in_the_run_folder(corpus, tmp_path, capsys):
    import torch

    run = tmp_path / "r"
    (run / "checkpoints").mkdir(parents=True)
    torch.save({"weight": torch.ones(3)}, run / "checkpoints" / "step_000000005.pt")  # a bare state_dict
    assert cli.main(train_args(corpus, run, steps=6)) == 2
    one_line_error(capsys, "step_000000005.pt", "is not a training checkpoint", "'config'")


def test_a_finished_run_is_left_as_it_is(corpus, tmp_path, capsys):
    run = tmp_path / "done"
    assert cli.main(train_args(corpus, run, steps=3)) == 0
    capsys.readouterr()
    files = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    assert cli.main(train_args(corpus, run, steps=3)) == 0
    assert "has finished already (3 steps of adahop_lv2); left as it is" in capsys.readouterr().out
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == files
    assert cli.main(train_args(corpus, run, steps=2)) == 2  # fewer steps than the checkpoint's
    one_line_error(capsys, "steps: 3 -> 2")
    assert cli.main(train_args(corpus, run, steps=3) + ["--lr", "1e-2"]) == 2  # another run's settings
    one_line_error(capsys, "lr: 0.003 -> 0.01", "new --out")
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == files


def test_quickstart_checks_every_run_before_it_builds_the_corpus(tmp_path, capsys, monkeypatch):
    import adahop.data.corpus as data_mod

    built = []
    monkeypatch.setattr(data_mod, "build_corpus", lambda out, **kw: built.append(out))
    args = ["quickstart", "--root", str(tmp_path / "qs"), "--steps", "2"]  # the default recipes: bf16, adahop_lv2_tail
    assert cli.main(args) == 2
    one_line_error(capsys, "recipe adahop_lv2_tail", "give at least 37 steps", "or recipe adahop_lv2")
    assert built == []


def test_quickstart_trains_bf16_and_the_default_recipe_on_the_cpu_preset(tmp_path, monkeypatch):
    """The README's main job as it stands: bf16 and adahop train's default recipe, the cpu preset's
    300 steps (long enough for adahop_lv2_tail's phase), then the comparison."""
    import adahop.data.corpus as data_mod
    import adahop.train.compare as compare_mod
    from adahop.train.recipes import DEFAULT_RECIPE

    trained, order = [], []
    monkeypatch.setattr(data_mod, "build_corpus", lambda out, **kw: order.append("corpus"))
    monkeypatch.setattr(cli, "run_train", lambda a: (order.append("train"), trained.append(cli.train_config(a))))
    monkeypatch.setattr(compare_mod, "compare_runs", lambda dirs, plot: order.append("compare") or "table")
    assert cli.main(["quickstart", "--root", str(tmp_path / "qs")]) == 0
    assert DEFAULT_RECIPE == "adahop_lv2_tail" and order == ["corpus", "train", "train", "compare"]
    assert [(Path(c.out_dir).name, c.recipe, c.steps, c.bf16_phase_start, c.bf16_phase_gemms) for c in trained] == [
        ("cpu-bf16", "bf16", 300, None, ("fprop", "dgrad", "wgrad")),
        ("cpu-adahop_lv2_tail", "adahop_lv2_tail", 300, 0.82, ("fprop",))]


def test_quickstart_twice_leaves_the_first_runs_as_they_are(corpus, tmp_path, capsys, monkeypatch):
    import shutil

    import adahop.data.corpus as data_mod

    monkeypatch.setattr(data_mod, "build_corpus", lambda out, **kw: shutil.copytree(corpus, out, dirs_exist_ok=True))
    root = tmp_path / "qs"
    quick = ["quickstart", "--root", str(root), "--steps", "2", "--recipes", "bf16", "adahop_lv2"]
    assert cli.main(quick) == 0
    first = capsys.readouterr().out
    summaries = {r: (root / f"cpu-{r}" / "summary.json").read_bytes() for r in ("bf16", "adahop_lv2")}
    logs = {r: (root / f"cpu-{r}" / "log.jsonl").read_bytes() for r in ("bf16", "adahop_lv2")}
    assert cli.main(quick) == 0
    second = capsys.readouterr().out
    assert second.count("has finished already") == 2
    assert {r: (root / f"cpu-{r}" / "summary.json").read_bytes() for r in summaries} == summaries
    assert {r: (root / f"cpu-{r}" / "log.jsonl").read_bytes() for r in logs} == logs
    table = [line for line in first.splitlines() if line.startswith("| cpu-")]
    assert table == [line for line in second.splitlines() if line.startswith("| cpu-")] and len(table) == 2


def test_no_resume_moves_the_old_run_aside_and_keeps_the_new_runs_checkpoints(corpus, tmp_path, capsys):
    """30 steps (checkpoints 20 and 30 kept), then 10 steps with --no-resume into the same folder:
    pruning used to keep the old run's 20 and 30 and delete the new run's 10, so that `latest`
    dangled and eval failed. Now the old run is in previous-1/, whole, and both evaluate."""
    run = tmp_path / "r"
    assert cli.main(train_args(corpus, run, recipe="bf16", steps=30)) == 0
    old = {str(p.relative_to(run)): p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != ".lock"}
    capsys.readouterr()
    assert cli.main(train_args(corpus, run, recipe="bf16", steps=10) + ["--no-resume"]) == 0
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step_000000010.pt"]
    assert cli.main(["eval", "--run", str(run), "--tasks", "--heldout-batches", "1"]) == 0
    assert json.loads((run / "eval.json").read_text())["checkpoint"] == "step_000000010.pt"
    err = capsys.readouterr().err
    assert f"{run} held another run: its files are moved to {run / 'previous-1'}, and this run starts" in err
    previous = run / "previous-1"
    assert {str(p.relative_to(previous)): p.read_bytes() for p in previous.rglob("*") if p.is_file()} == old
    assert cli.main(["eval", "--run", str(previous), "--tasks", "--heldout-batches", "1"]) == 0
    assert json.loads((previous / "eval.json").read_text())["checkpoint"] == "step_000000030.pt"
    assert json.loads((run / "summary.json").read_text())["steps"] == 10


def test_a_second_process_on_the_same_run_folder_is_refused(corpus, tmp_path, capsys):
    import subprocess
    import sys

    run = tmp_path / "locked"
    assert cli.main(train_args(corpus, run, recipe="bf16", steps=2)) == 0
    capsys.readouterr()
    files = sorted(p.relative_to(run) for p in run.rglob("*"))
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from adahop.train.run_folder import RunLock; RunLock(sys.argv[1]).acquire(); "
        "print('held', flush=True); time.sleep(60)"), str(run)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        for new_run in ([], ["--no-resume"]):  # the old run is moved aside only by the lock's holder
            assert cli.main(train_args(corpus, run, recipe="bf16", steps=3) + new_run) == 2
            one_line_error(capsys, "is in use by another adahop process", f"pid {holder.pid}")
            assert sorted(p.relative_to(run) for p in run.rglob("*")) == files
    finally:
        holder.kill()
        holder.wait()
    assert cli.main(train_args(corpus, run, recipe="bf16", steps=3) + ["--no-resume"]) == 0  # the lock died
    assert (run / "previous-1" / "summary.json").is_file()


def test_a_torn_last_log_line_is_dropped_and_other_damage_named(corpus, tmp_path, capsys, monkeypatch):
    import adahop.train.trainer as trainer_mod

    run = tmp_path / "torn"
    train = trainer_mod.train
    monkeypatch.setattr(trainer_mod, "train", lambda *a, **kw: train(*a, **kw, stop_after=3))
    assert cli.main(train_args(corpus, run, steps=6)) == 0  # killed after step 3 (its checkpoint) ...
    monkeypatch.setattr(trainer_mod, "train", train)
    log = run / "log.jsonl"
    with log.open("a") as f:
        f.write('{"step": 4, "lo')  # ... in the middle of writing step 4's record
    assert cli.main(train_args(corpus, run, steps=6)) == 0
    assert "dropped its torn last line" in capsys.readouterr().err
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4, 5, 6]
    lines = log.read_text().splitlines()
    lines[1] = lines[1][:10]
    log.write_text("\n".join(lines) + "\n")
    assert cli.main(["compare", str(run)]) == 2
    one_line_error(capsys, "log.jsonl, line 2", "damaged")


def test_a_full_disk_names_the_file(corpus, tmp_path, capsys, monkeypatch):
    import errno

    import adahop.train.checkpoint as ckpt_mod

    def no_space(obj, f):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt_mod.torch, "save", no_space)
    run = tmp_path / "full"
    assert cli.main(train_args(corpus, run, steps=2)) == 2
    one_line_error(capsys, "No space left on device", str(run / "checkpoints" / "step_000000002.pt"))
    assert not list((run / "checkpoints").glob("*.tmp"))


def test_an_unforeseen_error_keeps_its_traceback_in_the_run_folder(corpus, tmp_path, capsys, monkeypatch):
    import adahop.train.trainer as trainer_mod

    def broken(model, cfg):
        raise TypeError("a bug")

    monkeypatch.setattr(trainer_mod, "make_optimizer", broken)
    run = tmp_path / "bug"
    assert cli.main(train_args(corpus, run, steps=2)) == 1
    one_line_error(capsys, "internal error: TypeError: a bug", "please report it", str(run / "error.log"))
    assert "Traceback" in (run / "error.log").read_text()


def test_compare_errors_and_two_runs_of_one_recipe(corpus, tmp_path, capsys, monkeypatch):
    assert cli.main(["compare", str(tmp_path / "missing")]) == 2
    one_line_error(capsys, "missing", "is not a folder")
    (tmp_path / "empty").mkdir()
    assert cli.main(["compare", str(tmp_path / "empty")]) == 2
    one_line_error(capsys, "is not a run folder of adahop train", "config.json")
    a, b = tmp_path / "seed0", tmp_path / "seed1"
    assert cli.main(train_args(corpus, a, steps=2)) == 0
    assert cli.main(train_args(corpus, b, steps=2) + ["--seed", "1"]) == 0
    capsys.readouterr()
    assert cli.main(["compare", str(a), str(b), "--plot", "/proc/adahop-curves.png"]) == 2
    one_line_error(capsys, "--plot", "not a writable folder")
    import adahop.train.plot as plot_mod

    drawn = {}
    monkeypatch.setattr(plot_mod, "plot_loss_curves", lambda curves, path, **kw: drawn.update(curves))
    assert cli.main(["compare", str(a), str(b), "--plot", str(tmp_path / "c.png")]) == 0
    out = capsys.readouterr().out
    assert "| seed0 | adahop_lv2 | 2 |" in out and "| seed1 | adahop_lv2 | 2 |" in out
    assert set(drawn) == {"seed0", "seed1"}


def test_corpus_path_is_absolute_so_eval_runs_from_anywhere(corpus, tmp_path, monkeypatch, capsys):
    import os

    monkeypatch.chdir(corpus.parent)
    run = tmp_path / "abs"
    assert cli.main(train_args(os.path.relpath(corpus), run, steps=2)) == 0
    assert json.loads((run / "config.json").read_text())["corpus_dir"] == str(corpus.resolve())
    monkeypatch.chdir(tmp_path)
    assert cli.main(["eval", "--run", str(run), "--tasks", "--heldout-batches", "2"]) == 0
    assert "held-out loss over 2 batches per source" in capsys.readouterr().err
    assert cli.main(["eval", "--run", str(run), "--tasks", "nope"]) == 2
    one_line_error(capsys, "nope")


def test_every_option_has_help_and_the_version_and_sources_show():
    import argparse

    parser = cli.build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, sub in [("adahop", parser), *subparsers.choices.items()]:
        for action in sub._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            assert action.help, f"{name} {action.option_strings or action.dest} has no help"
    data_help = subparsers.choices["data"].format_help()
    assert "shakespeare" in data_help and "gcide" in data_help and "sha256" in data_help
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0


def test_bf16_blocks_and_phase_reach_the_run(corpus, tmp_path, capsys):
    run = tmp_path / "sched"
    assert cli.main(train_args(corpus, run, steps=6) + ["--calibration-steps", "2", "--bf16-blocks", "0,1",
                                                        "--bf16-phase", "0.5:fprop,wgrad"]) == 0
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["bf16_blocks"] == [0, 1] and cfg["bf16_phase_start"] == 0.5
    assert cfg["bf16_phase_gemms"] == ["fprop", "wgrad"]
    modes = json.loads((run / "modes.json").read_text())
    assert modes and all(m["fprop"] == m["wgrad"] == "bf16" for m in modes.values())
    assert not any(fqn.startswith("layers.1.") for fqn in modes)  # the debug model's 2 blocks: the last one BF16
    assert cli.main(train_args(corpus, tmp_path / "x", steps=6) + ["--bf16-phase", "0.5:forward"]) == 2
    one_line_error(capsys, "bf16_phase_gemms must be")
    assert cli.main(train_args(corpus, tmp_path / "x", steps=6) + ["--bf16-phase", "1.5"]) == 2
    one_line_error(capsys, "bf16_phase_start must be")
    with pytest.raises(SystemExit):
        cli.main(train_args(corpus, tmp_path / "x") + ["--bf16-blocks", "1"])


def test_a_scheduled_recipe_is_its_numerics_and_its_bf16_phase(corpus, tmp_path, capsys, monkeypatch):
    """adahop_lv2_tail is adahop_lv2 with the forward in BF16 from 82% of the steps on: the run
    records both, switches at step floor(0.82 * 10) = 8, and an explicit --bf16-phase wins."""
    run = tmp_path / "tail"
    assert cli.main(train_args(corpus, run, recipe="adahop_lv2_tail", steps=10)) == 0
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["adahop"]["recipe"] == "adahop_lv2"
    assert cfg["bf16_phase_start"] == 0.82 and cfg["bf16_phase_gemms"] == ["fprop"]
    records = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "bf16_phase" in r] == [8]
    modes = json.loads((run / "modes.json").read_text())
    assert all(m["fprop"] == "bf16" for m in modes.values()) and any(m["wgrad"] != "bf16" for m in modes.values())
    own = tmp_path / "own"
    assert cli.main(train_args(corpus, own, recipe="adahop_lv2_tail", steps=10) + ["--bf16-phase", "0.5"]) == 0
    assert json.loads((own / "config.json").read_text())["bf16_phase_start"] == 0.5
    # compare names both by what was run, and marks where each phase began on the plot
    import adahop.train.plot as plot_mod

    marked = {}
    monkeypatch.setattr(plot_mod, "plot_loss_curves", lambda curves, path, **kw: marked.update(kw["bf16_phases"]))
    capsys.readouterr()
    assert cli.main(["compare", str(run), str(own), "--plot", str(tmp_path / "c.png")]) == 0
    out = capsys.readouterr().out
    assert "| tail | adahop_lv2_tail | 10 |" in out
    assert "| own | adahop_lv2, fprop/dgrad/wgrad BF16 from 50% | 10 |" in out
    assert marked == {"tail": (8, "fprop"), "own": (5, "fprop/dgrad/wgrad")}  # --bf16-phase 0.5: every GEMM
    # the debug preset calibrates for 3 steps: the phase must begin after them
    assert cli.main(train_args(corpus, tmp_path / "short", recipe="adahop_lv2_tail", steps=3)) == 2
    one_line_error(capsys, "recipe adahop_lv2_tail runs fprop in BF16 from 82% of the steps on",
                   "give at least 4 steps, or recipe adahop_lv2")


def test_the_default_recipe_is_the_tail_and_an_own_config_runs_no_phase():
    """adahop train and preset() default to adahop_lv2_tail; an experiment's own AdaHOP config
    (preset's ``adahop``) gets no phase unless it names one."""
    from adahop.config import AdaHOPConfig
    from adahop.train.recipes import preset

    default = preset("debug")
    assert (default.adahop.recipe, default.bf16_phase_start, default.bf16_phase_gemms) == \
        ("adahop_lv2", 0.82, ("fprop",))
    assert cli.parse_args(["train"]).recipe == "adahop_lv2_tail"
    own = AdaHOPConfig.from_recipe_name("mxfp4")
    assert preset("debug", adahop=own).bf16_phase_start is None
    assert preset("debug", adahop=own, steps=3).steps == 3  # no phase, so no refusal of a short run
    assert preset("debug", adahop=own, bf16_phase_start=0.5).bf16_phase_start == 0.5
    assert preset("debug", recipe="adahop_lv2").bf16_phase_start is None
    # a run's recipe in the tables and messages: the scheduled name, else the numerics and the phase
    assert default.recipe == "adahop_lv2_tail" and preset("debug", recipe="bf16").recipe == "bf16"
    assert preset("debug", recipe="adahop_lv2").recipe == "adahop_lv2"
    assert preset("debug", recipe="adahop_lv2", bf16_phase_start=0.5).recipe == \
        "adahop_lv2, fprop/dgrad/wgrad BF16 from 50%"
    assert preset("debug", recipe="mxfp4", bf16_phase_start=0.9, bf16_phase_gemms=("fprop",)).recipe == \
        "mxfp4, fprop BF16 from 90%"


def test_drift_is_measured_at_the_final_evaluation(corpus, tmp_path):
    """--drift measure re-observes the calibrated layers on held-out batches at the evaluation
    and logs what changed (here: the end of a short run); bad combinations are one line."""
    run = tmp_path / "d"
    args = train_args(corpus, run, steps=6) + ["--calibration-steps", "2", "--drift", "measure"]
    assert cli.main(args) == 0
    records = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    drift = next(r["final_eval"]["drift"] for r in records if "final_eval" in r)
    assert drift["steps"] >= 1 and drift["layers"] > 0
    assert drift["label_changes"] >= 0 and drift["mode_changes"] >= 0
    assert set(drift["changed"]) <= {f"layers.{i}." + n for i in range(8)
                                     for n in ("attention.wq", "attention.wk", "attention.wv", "attention.wo",
                                               "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")}
    assert cli.main(train_args(corpus, tmp_path / "e", recipe="mxfp4") + ["--drift", "measure"]) == 2


def test_calibration_in_iht_reaches_the_run(corpus, tmp_path):
    run = tmp_path / "i"
    assert cli.main(train_args(corpus, run, steps=6) + ["--calibration-steps", "2", "--calibration-gemms", "iht"]) == 0
    assert json.loads((run / "config.json").read_text())["adahop"]["calibration_gemms"] == "iht"
    assert len(losses(run)) == 6 and all(math.isfinite(v) for v in losses(run))


def test_eval_and_analyze_refuse_a_run_whose_corpus_was_rebuilt(tmp_path, capsys):
    """The corpus folder rebuilt from other text with a tokenizer of the same vocabulary: the
    run's held-out split is gone, so eval and analyze would score it on text it never held out."""
    from adahop.analyze.inputs import load_subject

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    D.build_corpus(corpus, sources=[S.cpython_stdlib_source(modules=("json", "textwrap"), name="mini")],
                   tokenizer="byte", progress=False)
    run = tmp_path / "run"
    assert cli.main(train_args(corpus, run, recipe="bf16", steps=2)) == 0
    assert cli.main(["eval", "--run", str(run), "--tasks", "--heldout-batches", "1"]) == 0
    D.build_corpus(corpus, sources=[S.cpython_stdlib_source(modules=("json", "string"), name="mini")],
                   tokenizer="byte", progress=False)  # the same vocabulary (257), other text
    capsys.readouterr()
    assert cli.main(["eval", "--run", str(run), "--tasks", "--heldout-batches", "1"]) == 2
    one_line_error(capsys, f"{run} was trained on corpus", "rebuilt since", "held-out text is not the run's")
    with pytest.raises(ValueError, match="was trained on corpus .*rebuilt since"):
        load_subject(f"run:{run}")
    assert cli.main(train_args(corpus, run, recipe="bf16", steps=3)) == 2  # train: as before
    one_line_error(capsys, "was trained on another corpus")


@pytest.mark.parametrize("resumed", [False, True])
def test_drift_apply_keeps_the_bf16_phase_and_the_final_modes(corpus, tmp_path, monkeypatch, resumed):
    """--drift with a BF16 phase (adahop_lv2_tail: the forward BF16 from 82% of the steps): the
    scheduled BF16 forward is not drift (the policy does not choose it), ``apply`` does not undo
    it, and the run's modes.json is the modes of its final checkpoint (the final evaluation's
    changes would train no step: reported, not kept). ``resumed``: the run killed at its final
    evaluation, after its last checkpoint, then resumed (no step left to apply the schedule)."""
    import adahop.train.run as run_mod
    from adahop.train.checkpoint import latest_checkpoint, load_training_checkpoint

    run = tmp_path / "tail"
    args = train_args(corpus, run, recipe="adahop_lv2_tail", steps=10) + [
        "--calibration-steps", "2", "--drift", "apply"]
    if resumed:
        def killed(*a, **kw):
            raise KeyboardInterrupt

        with monkeypatch.context() as m:
            m.setattr(run_mod, "drift_of", killed)
            assert cli.main(args) != 0
        assert latest_checkpoint(run / "checkpoints").name.endswith("10.pt") and not (run / "modes.json").exists()
    assert cli.main(args) == 0
    records = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "bf16_phase" in r] == [8]
    drift = next(r["final_eval"]["drift"] for r in records if "final_eval" in r)
    assert drift["layers"] > 0
    assert not [name for name, entry in drift["changed"].items() if "fprop" in entry.get("modes", {})]
    layers = load_training_checkpoint(latest_checkpoint(run / "checkpoints"))["model"]
    saved = {k[:-len("._extra_state")]: v["modes"] for k, v in layers.items() if k.endswith("._extra_state")}
    modes = json.loads((run / "modes.json").read_text())
    assert saved and {n: {g: e[g] for g in ("fprop", "dgrad", "wgrad")} for n, e in modes.items()} == saved
    assert {e["fprop"] for e in modes.values()} == {"bf16"}
