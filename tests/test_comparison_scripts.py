"""The comparison scripts of benchmarks/ run end to end on the CPU at a tiny size: the recipe
comparison (serially and as one process per "GPU"), the ablation with seed-paired gaps, and the
same recipe trained on two backends."""

import importlib.util
import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
if str(BENCH) not in sys.path:  # the scripts import their shared helpers (benchmarks/common.py)
    sys.path.insert(0, str(BENCH))


def load(name):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def ablation_args(tmp_path, preset="cpu", model_size=None):
    """ablation.py's parsed arguments for ``run_config``: the preset's steps, rate and size."""
    import argparse

    return argparse.Namespace(out=str(tmp_path), corpus=str(tmp_path / "corpus"), preset=preset, steps=None, lr=None,
                              model_size=model_size, compile="auto", cudagraphs=False, drift_measure=False)


def test_train_compare_serial_and_parallel(corpus, tmp_path, capsys):
    tc = load("train_compare")
    common = ["--corpus", str(corpus), "--preset", "debug", "--steps", "3", "--tasks"]
    assert tc.main([*common, "--out", str(tmp_path / "a"), "--recipes", "bf16", "mxfp4"]) == 0
    table = (tmp_path / "a" / "comparison.md").read_text()
    assert "| bf16 | 3 |" in table and "| mxfp4 | 3 |" in table
    assert f"Runs made on: {'no GPU' if not torch.cuda.is_available() else ''}" in table and "adahop 0." in table
    assert (tmp_path / "a" / "loss_curves.png").read_bytes()[:4] == b"\x89PNG"

    # two worker processes (one per GPU on a GPU machine), then one report over both. A machine
    # with one GPU cannot give each its own (the second would train on the CPU): refused there,
    # and the runs to compare with are made serially instead.
    layout = ["--gpus", "2"]
    if torch.cuda.device_count() == 1:
        with pytest.raises(SystemExit):
            tc.main([*common, "--out", str(tmp_path / "x"), "--recipes", "bf16", "adahop_lv2", *layout])
        layout = ["--gpus", "1"]
    assert tc.main([*common, "--out", str(tmp_path / "b"), "--recipes", "bf16", "adahop_lv2", *layout]) == 0
    if layout[1] == "2":
        assert (tmp_path / "b" / "worker0.log").exists() and (tmp_path / "b" / "worker1.log").exists()
    table = (tmp_path / "b" / "comparison.md").read_text()
    assert "| bf16 | 3 |" in table and "| adahop_lv2 | 3 |" in table

    # two processes sharing one GPU: the same runs, one report
    assert tc.main([*common, "--out", str(tmp_path / "c"), "--recipes", "bf16", "adahop_lv2", "--per-gpu", "2"]) == 0
    assert (tmp_path / "c" / "worker1.log").exists()

    def losses(report):  # recipe, steps, held-out loss, gap: not the (timing) columns after them
        return [row.split("|")[1:5] for row in report.splitlines() if row.startswith("| ")]

    assert losses((tmp_path / "c" / "comparison.md").read_text()) == losses(table)
    with pytest.raises(SystemExit):
        tc.main([*common, "--out", str(tmp_path / "d"), "--per-gpu", "0"])

    # a run of another length is not comparable: the report refuses it
    assert tc.main(["--corpus", str(corpus), "--preset", "debug", "--steps", "4", "--tasks",
                    "--out", str(tmp_path / "b"), "--recipes", "mxfp4"]) == 0
    capsys.readouterr()
    assert tc.main(["--corpus", str(corpus), "--out", str(tmp_path / "b"), "--recipes", "bf16", "mxfp4",
                    "--report-only"]) == 2
    assert "not comparable" in capsys.readouterr().err


def test_ablation_pairs_gaps_by_seed(corpus, tmp_path, capsys):
    ab = load("ablation")
    out = tmp_path / "abl"
    common = ["--corpus", str(corpus), "--out", str(out), "--preset", "debug", "--steps", "3"]
    assert ab.main([*common, "--variants", "bf16", "lv2_fprop_bf16", "--seeds", "0", "1", "--jobs", "2"]) == 0
    assert (out / "logs" / "bf16-s1.log").is_file()  # each run in its own process
    # --runs: the listed (variant, seed) pairs only; the finished ones are not run again
    assert ab.main([*common, "--runs", "mxfp4:0", "bf16:0,1"]) == 0
    runs = {(r["variant"], r["seed"]): r for r in (json.loads(p.read_text()) for p in out.glob("*/ablation.json"))}
    assert len(runs) == 5
    modes = json.loads((out / "lv2_fprop_bf16-s0" / "modes.json").read_text())
    assert all(m["fprop"] == "bf16" for m in modes.values())  # the variant's override took effect
    loss = {k: r["heldout_loss"] for k, r in runs.items()}
    table = (out / "ablation.md").read_text()
    gap0 = loss["lv2_fprop_bf16", 0] - loss["bf16", 0]
    gap1 = loss["lv2_fprop_bf16", 1] - loss["bf16", 1]
    spread = abs(gap0 - gap1) / 2 ** 0.5  # the sample standard deviation of two values
    assert f"{(gap0 + gap1) / 2:+.4f} ± {spread:.4f}" in table and f"s0: {gap0:+.4f}" in table
    assert f"{loss['lv2_fprop_bf16', 0] - loss['mxfp4', 0]:+.4f} (1)" in table  # paired with mxfp4's one seed
    assert "Runs made on: " in table and f"torch {torch.__version__}" in table
    # debug preset: 3 steps, 3 calibration steps in BF16, so nothing ran in MXFP4 but mxfp4 itself;
    # the LM head (bf16) is part of the linear FLOPs
    assert runs["bf16", 0]["mxfp4_flop_share"] == 0 and runs["lv2_fprop_bf16", 0]["mxfp4_flop_share"] == 0
    assert 0.5 < runs["mxfp4", 0]["mxfp4_flop_share"] < 1
    # a run of another length is trained, but the report does not compare it with them
    with pytest.raises(SystemExit, match="not comparable: they differ in steps"):
        ab.main([*common[:-1], "2", "--variants", "mxfp4", "--seeds", "1"])
    assert (out / "mxfp4-s1" / "ablation.json").is_file()
    capsys.readouterr()


def test_backend_agreement_windows_and_differences():
    ba = load("backend_agreement")
    assert ba.windows(4, 13, 5) == [(4, 5), (6, 7), (8, 9), (10, 11), (12, 13)]
    assert ba.windows(2, 3, 5) == [(2, 2), (3, 3)]
    assert ba.windows(5, 4, 5) == []
    rows = ba.compare({"a": {1: 9.0, 2: 2.0, 3: 3.0}, "b": {1: 9.0, 2: 2.5, 3: 2.0}}, calibration_steps=1)
    assert [r["steps"] for r in rows] == [(1, 1), (2, 2), (3, 3)]
    assert rows[0]["calibration"] and rows[0]["b"]["max_abs"] == 0
    assert rows[1]["b"]["mean"] == pytest.approx(0.5) and rows[2]["b"]["mean"] == pytest.approx(-1.0)
    with pytest.raises(ValueError, match="no logged step"):
        ba.compare({"a": {1: 1.0}, "b": {2: 1.0}}, calibration_steps=0)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the triton backend on the CPU needs the interpreter")
def test_backend_agreement_reference_and_triton_train_to_the_same_bits(corpus, tmp_path):
    """The issue's "a converted model gives the same loss curve on both backends", on the CPU:
    the Triton quantize kernels equal the reference bit for bit and the triton backend's GEMM
    is the reference's, so every loss and the held-out loss are equal exactly. (One calibration
    step, then two MXFP4 steps: the second one's weights come from MXFP4 gradients.) One
    sequence of 32 tokens a step: bit-equality does not depend on the size, and 32 tokens are
    still one whole MXFP4 block along the weight gradient's K; the interpreted kernels' time
    grows with the tokens."""
    ba = load("backend_agreement")
    out = tmp_path / "agree"
    common = ["--corpus", str(corpus), "--out", str(out), "--backends", "reference", "triton"]
    assert ba.main([*common, "--preset", "debug", "--steps", "3", "--calibration-steps", "1", "--batch-size", "1",
                    "--seq-len", "32", "--device", "cpu"]) == 0
    res = json.loads((out / "agreement.json").read_text())
    assert res["same_modes"]
    assert len(res["losses"]["reference"]) == 3 and all(math.isfinite(v) for v in res["losses"]["reference"])
    assert res["losses"]["triton"] == res["losses"]["reference"]
    assert res["heldout"]["triton"] == res["heldout"]["reference"]
    assert all(row["triton"]["max_abs"] == 0 for row in res["windows"])
    assert (out / "loss_curves.png").read_bytes()[:4] == b"\x89PNG"
    assert "| triton | " in (out / "agreement.md").read_text()
    assert res["env"]["torch"] == torch.__version__ and "Report made on: " in (out / "agreement.md").read_text()

    # comparing runs that differ in what they trained is refused
    cfg = json.loads((out / "triton" / "config.json").read_text())
    (out / "triton" / "config.json").write_text(json.dumps(dict(cfg, seed=cfg["seed"] + 1)))
    assert ba.main([*common, "--report-only"]) == 2


def test_ablation_settings_missing_a_later_field_compare_at_its_default():
    """A run recorded before a TrainConfig field existed compares with new runs whose value is
    the field's default, and not with runs that set it otherwise."""
    ab = load("ablation")
    from adahop.train.trainer import TrainConfig

    new = ab.comparable_settings(TrainConfig())
    old = {k: v for k, v in new.items() if k != "quantized_all_gather"}
    run = {"variant": "bf16", "seed": 0, "corpus_id": "c"}
    ab.check_comparable([{**run, "settings": old}, {**run, "variant": "lv2", "settings": new}])
    changed = {**new, "quantized_all_gather": True}
    with pytest.raises(SystemExit, match="differ in quantized_all_gather"):
        ab.check_comparable([{**run, "settings": old}, {**run, "variant": "lv2", "settings": changed}])


def test_ablation_calibration_micro_batches_variant_calibrates_as_lv2(tmp_path):
    """lv2_calib_mb4 runs each calibration step as 4 micro-batches (one observation of the step
    each, so the preset's calibration steps), and is comparable with lv2 (the split is the
    variant's own field)."""
    ab = load("ablation")
    args = ablation_args(tmp_path)
    lv2, mb4 = ab.run_config(args, "lv2", 0), ab.run_config(args, "lv2_calib_mb4", 0)
    assert (lv2.calibration_micro_batches, mb4.calibration_micro_batches) == (1, 4)
    assert mb4.adahop == lv2.adahop and lv2.adahop.calibration_steps == 30
    mb4.validate()
    ab.check_comparable([{"variant": "lv2", "seed": 0, "settings": ab.comparable_settings(lv2)},
                         {"variant": "lv2_calib_mb4", "seed": 0, "settings": ab.comparable_settings(mb4)}])


def test_ablation_variants_with_their_own_calibration_length(tmp_path):
    """measured_b2_c10 calibrates for its own 10 steps (not the preset's 30) with a 2% budget,
    measured_c10 for 10 steps with the default 8%, the preset's OE k and seed otherwise; both
    compare with the other variants (the numerics are the variant's own field)."""
    ab = load("ablation")
    args = ablation_args(tmp_path)
    measured, short = ab.run_config(args, "measured", 1), ab.run_config(args, "measured_b2_c10", 1)
    c10 = ab.run_config(args, "measured_c10", 1)
    assert [c.adahop.calibration_steps for c in (measured, short, c10)] == [30, 10, 10]
    assert [c.adahop.hp_budget for c in (measured, short, c10)] == [0.08, 0.02, 0.08]
    assert short.adahop.replace(calibration_steps=30, hp_budget=0.08) == measured.adahop
    assert c10.adahop.replace(calibration_steps=30) == measured.adahop
    ab.check_comparable([{"variant": v, "seed": 1, "settings": ab.comparable_settings(c)}
                         for v, c in (("measured", measured), ("measured_b2_c10", short), ("measured_c10", c10))])


def test_ablation_bf16_ends_variant_keeps_the_first_and_last_blocks_bf16(tmp_path):
    """lv2_bf16_ends is lv2 with bf16_blocks (1, 1), a variant's field: comparable with lv2."""
    ab = load("ablation")
    args = ablation_args(tmp_path)
    lv2, ends = ab.run_config(args, "lv2", 2), ab.run_config(args, "lv2_bf16_ends", 2)
    assert (lv2.bf16_blocks, ends.bf16_blocks) == ((0, 0), (1, 1)) and ends.adahop == lv2.adahop
    ends.validate()
    ab.check_comparable([{"variant": v, "seed": 2, "settings": ab.comparable_settings(c)}
                         for v, c in (("lv2", lv2), ("lv2_bf16_ends", ends))])


def test_ablation_fprop_tail_variant_of_naive_mxfp4(tmp_path):
    """mxfp4_fprop_tail7 is naive mxfp4 whose forward GEMM runs BF16 from step floor(0.93 * steps),
    a variant's field: comparable with mxfp4."""
    ab = load("ablation")
    args = ablation_args(tmp_path)
    plain, tail = ab.run_config(args, "mxfp4", 0), ab.run_config(args, "mxfp4_fprop_tail7", 0)
    assert plain.bf16_phase_start is None and tail.adahop == plain.adahop
    assert (tail.bf16_phase_start, tuple(tail.bf16_phase_gemms)) == (0.93, ("fprop",))
    tail.validate()
    ab.check_comparable([{"variant": v, "seed": 0, "settings": ab.comparable_settings(c)}
                         for v, c in (("mxfp4", plain), ("mxfp4_fprop_tail7", tail))])


def test_the_named_tail_recipe_is_the_measured_variant(tmp_path):
    """adahop train's adahop_lv2_tail is the run the ablation measured as lv2_bf16_fprop_tail."""
    from adahop.train.recipes import preset

    ab = load("ablation")
    args = ablation_args(tmp_path, "h200_125m")
    measured = ab.run_config(args, "lv2_bf16_fprop_tail", 0)
    named = preset("h200_125m", recipe="adahop_lv2_tail", seed=0)
    fields = ("adahop", "bf16_phase_start", "bf16_phase_gemms", "steps", "model_size")
    assert {f: getattr(named, f) for f in fields} == {f: getattr(measured, f) for f in fields}
    assert (named.recipe, named.adahop.recipe) == ("adahop_lv2_tail", "adahop_lv2")


def test_ablation_model_size_confirms_at_another_size_and_keeps_sizes_apart(tmp_path):
    """--model-size runs the preset's schedule at another size; runs of two sizes never pair."""
    ab = load("ablation")
    small, large = ab.run_config(ablation_args(tmp_path), "lv2", 0), ab.run_config(ablation_args(
        tmp_path, model_size="350m"), "lv2", 0)
    assert (small.model_size, large.model_size) == ("tiny", "350m") and small.steps == large.steps
    with pytest.raises(SystemExit, match="not comparable: they differ in model_size"):
        ab.check_comparable([{"variant": "lv2", "seed": 0, "settings": ab.comparable_settings(small)},
                             {"variant": "bf16", "seed": 0, "settings": ab.comparable_settings(large)}])


def test_ablation_grad_rne_variants_round_only_the_gradient_to_nearest():
    """lv2_grad_rne and measured_grad_rne: the gradient operand of dgrad and wgrad rounded to
    nearest instead of stochastically; every other setting as their recipe's."""
    import dataclasses

    ab = load("ablation")
    for base, variant in (("lv2", "lv2_grad_rne"), ("measured", "measured_grad_rne")):
        plain, rne = ab.VARIANTS[base].numerics(), ab.VARIANTS[variant].numerics()
        assert (plain.dgrad.a_rounding, plain.wgrad.a_rounding) == ("sr", "sr")
        assert (rne.dgrad.a_rounding, rne.wgrad.a_rounding) == ("rne", "rne")
        assert rne.fprop == plain.fprop
        for gemm in ("dgrad", "wgrad"):
            assert dataclasses.replace(getattr(rne, gemm), a_rounding="sr") == getattr(plain, gemm)
        assert type(rne.policy_fn) is type(plain.policy_fn)


@pytest.mark.parametrize("item, message", [
    ("nope:0", "unknown variant 'nope'"),
    ("lv2", "write VARIANT:SEEDS"),
    ("lv2:a", "write VARIANT:SEEDS"),
    ("lv2:-1", "write VARIANT:SEEDS"),
    ("lv2:", "write VARIANT:SEEDS"),
    ("lv2:0 --seeds 1", "give one or the other"),
])
def test_ablation_runs_option_refuses_bad_items(item, message, capsys):
    ab = load("ablation")
    with pytest.raises(SystemExit):
        ab.main(["--runs", *item.split(), "--report"])
    assert message in capsys.readouterr().err


def test_ablation_runs_option_keeps_order_and_drops_repeats():
    import argparse

    ab = load("ablation")
    p = argparse.ArgumentParser()
    assert ab.parse_runs(p, ["lv2:1,2", "measured_c10:0", "lv2:2"]) == [("lv2", 1), ("lv2", 2), ("measured_c10", 0)]
    # the runs made in parallel get their own --variants and --seeds: --runs is dropped from theirs
    argv = ["--out", "o", "--runs", "lv2:1,2", "measured_c10:0", "--jobs", "2", "--cudagraphs"]
    assert ab._strip(argv, ("--variants", "--seeds", "--runs", "--jobs")) == ["--out", "o", "--cudagraphs"]


def test_ablation_hadamard_size_variants_change_only_the_size():
    """lv2_h16 / mxfp4_iht_h16: every GEMM's Hadamard 16 wide, all else as the recipe's."""
    import dataclasses

    ab = load("ablation")
    for base, variant in (("lv2", "lv2_h16"), ("mxfp4_iht", "mxfp4_iht_h16")):
        plain, h16 = ab.VARIANTS[base].numerics(), ab.VARIANTS[variant].numerics()
        for gemm in ("fprop", "dgrad", "wgrad"):
            assert getattr(plain, gemm).hadamard_size == 32 and getattr(h16, gemm).hadamard_size == 16
            assert dataclasses.replace(getattr(h16, gemm), hadamard_size=32) == getattr(plain, gemm)
