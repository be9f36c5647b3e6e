"""The command line end to end on a small offline corpus: train, resume, eval, compare, errors."""

import json

import pytest

from adahop import cli
from adahop.train.compare import steady_tokens_per_s
from adahop.train import data as D
from adahop.train import sources as S


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


def test_train_resume_eval_compare(corpus, tmp_path, capsys):
    lv2, bf16 = tmp_path / "lv2", tmp_path / "bf16"
    assert cli.main(train_args(corpus, lv2, steps=4)) == 0
    first = losses(lv2)
    assert len(first) == 4
    assert cli.main(train_args(corpus, lv2, steps=6)) == 0  # resumes at step 4
    assert losses(lv2)[:4] == first and len(losses(lv2)) == 6
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
    """--compile trains with compiled blocks (recorded in the run's config); without it, eager."""
    run = tmp_path / "c"
    assert cli.main(train_args(corpus, run, recipe="bf16", steps=2) + ["--compile"]) == 0
    assert json.loads((run / "config.json").read_text())["compile"] is True
    assert len(losses(run)) == 2
    plain = tmp_path / "e"
    assert cli.main(train_args(corpus, plain, recipe="bf16", steps=2)) == 0
    assert json.loads((plain / "config.json").read_text())["compile"] is False
