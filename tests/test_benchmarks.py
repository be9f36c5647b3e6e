"""Smoke tests of every script in benchmarks/ on the CPU.

- Every script answers ``--help`` (exit 0) and every option it defines has a help string.
- The GPU-only scripts refuse a machine without CUDA with one line and exit status 2.
- Their sections run for real at tiny sizes where the CPU can: the Triton kernels under
  ``TRITON_INTERPRET=1``, hopper_fp8's GEMM through ``torch._scaled_mm`` (which runs on the CPU),
  with ``do_bench`` (GPU only) replaced by one call of the timed function. The rows they write
  are checked: the variants agree bit for bit where the benchmark says so, and every row carries
  the environment.
- bench_train_speed.py runs end to end on the debug preset (one process per run, bf16 first and
  last), and gpu_reference_check.py's training part on the CPU.

The comparison scripts' real runs are in test_comparison_scripts.py, the quantization-error
study's in test_quant_error_study.py, offline_compile.py's and sass_count.py's in
test_offline_compile.py.
"""

import argparse
import collections
import importlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from adahop.config import RECIPES

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPTS = sorted(p.stem for p in BENCH.glob("*.py") if p.stem != "common")
GPU_ONLY = ("bench_gemm", "bench_kernels", "bench_linear", "check_compile", "check_hopper", "gpu_reference_check",
            "quantize_ceiling")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
needs_interpreter = pytest.mark.skipif(not INTERPRETED, reason="the Triton kernels on the CPU need TRITON_INTERPRET=1")
# At K = 64 wgrad's OE-right (k = 64 of the layer's recipes) selects every column: said, and fine here
CLAMPED_OE = pytest.mark.filterwarnings("ignore:.*OE k=64 >= the dim it selects from")

if str(BENCH) not in sys.path:  # the scripts import their shared helpers as `common`
    sys.path.insert(0, str(BENCH))


def script(name):
    return importlib.import_module(name)


def rows_of(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def test_every_script_is_listed():
    # a new script gets a smoke test here: in GPU_ONLY (refusal) or in a CPU run below
    assert set(SCRIPTS) == {"ablation", "activation_memory", "backend_agreement", "bench_gemm", "bench_kernels",
                            "bench_linear", "bench_train_speed", "check_compile", "check_hopper", "gpu_reference_check",
                            "offline_compile", "pretrained_forward", "quant_error_study", "quantize_ceiling",
                            "sass_count", "train_compare", "value_error"}
    assert not (BENCH / "bench_hopper.py").exists()


@pytest.mark.parametrize("name", SCRIPTS)
def test_help_exits_0_and_every_option_has_help(name, monkeypatch, capsys):
    mod = script(name)
    undocumented = []
    real = argparse._ActionsContainer.add_argument

    def add_argument(self, *args, **kwargs):
        action = real(self, *args, **kwargs)
        if not action.help:
            undocumented.append(action.option_strings or action.dest)
        return action

    monkeypatch.setattr(argparse._ActionsContainer, "add_argument", add_argument)
    with pytest.raises(SystemExit) as e:
        mod.main(["--help"])
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith("usage:")
    assert not undocumented, f"{name}: options without help: {undocumented}"


def test_scripts_run_by_path():
    """``python benchmarks/X.py`` finds its helpers (benchmarks/ is the script's folder)."""
    out = subprocess.run([sys.executable, str(BENCH / "bench_linear.py"), "--help"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "--no-emulation" in out.stdout, out.stderr[-2000:]
    if not torch.cuda.is_available():
        out = subprocess.run([sys.executable, str(BENCH / "bench_linear.py")], capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 2 and out.stderr.strip().splitlines() == [
            "bench_linear.py: needs a CUDA GPU (torch.cuda.is_available() is False on this machine)"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("name", GPU_ONLY)
def test_gpu_scripts_refuse_without_cuda(name, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        script(name).main(["--out", str(tmp_path / "rows.jsonl")])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs a CUDA GPU" in err[0], err
    assert not (tmp_path / "rows.jsonl").exists()


def test_bad_arguments_are_refused_in_one_line(capsys):
    for name, argv, says in [("bench_linear", ["--shapes", "14336x4096"], "--shapes takes"),
                             ("bench_linear", ["--recipes", "adahop_lv3"], "--recipes takes"),
                             ("bench_linear", ["--recipes", "adahop_lv2@h48"], "--recipes takes"),
                             ("bench_linear", ["--recipes", "bf16@h16"], "--recipes takes"),
                             ("bench_kernels", ["--sections", "quant,gemm"], "--sections takes"),
                             ("bench_train_speed", ["--steps", "30", "20"], "1 <= P0 < P1"),
                             ("bench_train_speed", ["--calibration-steps", "30"], "after the calibration")]:
        with pytest.raises(SystemExit) as e:
            script(name).main(argv)
        assert e.value.code == 2
        assert says in capsys.readouterr().err, (name, argv)


# ---- the GPU scripts' sections on the CPU -------------------------------------------------------------------
@pytest.fixture
def on_cpu(monkeypatch):
    """The benchmark sections on the CPU at tiny sizes: operands on the CPU, hopper_fp8 for the
    layers' dispatch, one call of the timed function instead of do_bench (1.0 ms each), no CUDA
    check. Returns the list of the timed calls."""
    import adahop.layer_ops
    from adahop.ops import backends
    from adahop.ops.kernel_backends import HopperFP8Backend

    common = script("common")
    timed = []

    def fake_bench(fn, rep=100):
        fn()
        timed.append(rep)
        return 1.0

    hopper = HopperFP8Backend()
    real_get_backend = backends.get_backend
    monkeypatch.setattr(common, "DEVICE", "cpu")
    monkeypatch.setattr(common, "bench", fake_bench)
    monkeypatch.setattr(common, "require_cuda", lambda _: None)  # common.start's check

    def get_backend(name="auto", device=None):
        return hopper if name == "hopper_fp8" else real_get_backend(name, device)

    monkeypatch.setattr(adahop.layer_ops, "get_backend", get_backend)
    for name in ("bench_kernels", "bench_gemm", "bench_linear", "check_hopper"):
        mod = script(name)
        monkeypatch.setattr(mod, "bench", fake_bench, raising=False)
        monkeypatch.setattr(mod, "T", 64, raising=False)
        monkeypatch.setattr(mod, "require_cuda", lambda _: None, raising=False)
    return timed, hopper


@needs_interpreter
@CLAMPED_OE
def test_bench_linear_sections_on_cpu(on_cpu, tmp_path, monkeypatch):
    timed, _ = on_cpu
    bl = script("bench_linear")
    monkeypatch.setattr(bl, "SINGLE_SHAPE", (96, 64))
    monkeypatch.setattr(bl, "T", 128)  # more tokens than OE's k = 64: OE-left selects among them
    out = tmp_path / "linear.jsonl"
    assert bl.main(["--sections", "linear,memory", "--recipes", "adahop_lv2", "--shapes", "96,64",
                    "--pairs", "2", "--rep", "50", "--out", str(out)]) == 0
    rows = rows_of(out)
    assert [r["section"] for r in rows] == ["linear"] + ["memory"] * (1 + len(RECIPES))  # bf16_nn + every recipe
    assert all(r["benchmark"] == "bench_linear" and r["env"]["torch"] == torch.__version__ for r in rows)
    lin = rows[0]
    assert lin["shape"] == [96, 64] and lin["grads"] == "fresh"
    assert set(lin["speedup_vs_bf16"]) == {"adahop_lv2", "mxfp4_reference_emulation"}
    # paired: every ratio from 2 BF16 timings alternating with 2 of the recipe; the emulation
    # gets 3/5 of --rep
    assert all(len(t["bf16"]) == 2 and len(t[name]) == 2 for name, t in lin["times_ms"].items())
    assert sorted(timed) == [30] * 4 + [50] * 4
    saved = {r["recipe"]: r["saved_bytes"] for r in rows[1:]}
    assert set(saved) == {"bf16_nn", *RECIPES}
    # BF16 keeps x and the bf16 weight for the backward, naive mxfp4 their packed MXFP4 (17/32 byte per value)
    assert saved["bf16"] == saved["bf16_nn"] and saved["mxfp4"] < saved["bf16_nn"] / 3


def test_bench_linear_recipe_with_a_hadamard_size(on_cpu):
    """NAME@hN: the recipe with every GEMM's Hadamard N wide, timed beside the plain recipe."""
    bl = script("bench_linear")
    assert bl.parse_recipe("adahop_lv2") == ("adahop_lv2", None)
    assert bl.parse_recipe("mxfp4_iht@h16") == ("mxfp4_iht", 16)
    layer = bl.make_layer("mxfp4_iht@h16", 96, 64, "hopper_fp8")
    assert {layer.config.gemm(g).hadamard_size for g in ("fprop", "dgrad", "wgrad")} == {16}
    assert bl.make_layer("mxfp4_iht", 96, 64, "hopper_fp8").config.fprop.hadamard_size == 32


@needs_interpreter
@CLAMPED_OE
def test_bench_linear_times_the_modes_a_trained_run_holds(on_cpu, tmp_path, monkeypatch):
    """--modes-from: each distinct mode triple of a modes.json is timed beside the recipes, with
    how many layers run it; a file that is not a modes.json is refused before any work."""
    bl = script("bench_linear")
    monkeypatch.setattr(bl, "T", 128)
    modes = {f"layers.{i}.{w}": {"fprop": "iht", "dgrad": "iht", "wgrad": "bf16" if w == "wk" else "iht+oe_right"}
             for i in range(2) for w in ("wq", "wk", "wv")}
    (tmp_path / "modes.json").write_text(json.dumps(modes))
    assert [n for _, n in bl.trained_modes(tmp_path / "modes.json")] == [4, 2]
    out = tmp_path / "linear.jsonl"
    assert bl.main(["--sections", "linear", "--recipes", "mxfp4", "--shapes", "96,64", "--pairs", "1", "--rep", "50",
                    "--no-emulation", "--modes-from", str(tmp_path / "modes.json"), "--out", str(out)]) == 0
    lin = rows_of(out)[0]
    assert set(lin["speedup_vs_bf16"]) == {"mxfp4", "trained:iht/iht/iht+oe_right", "trained:iht/iht/bf16"}
    assert lin["trained_layers"] == {"trained:iht/iht/iht+oe_right": 4, "trained:iht/iht/bf16": 2}
    (tmp_path / "bad.json").write_text(json.dumps({"layers.0.wq": {"fprop": "iht"}}))
    with pytest.raises(SystemExit) as e:
        bl.main(["--modes-from", str(tmp_path / "bad.json")])
    assert e.value.code == 2


@needs_interpreter
@CLAMPED_OE
def test_bench_linear_sizes_on_cpu(on_cpu, tmp_path, capsys, monkeypatch):
    """sizes: every (out, in) pair of the grid timed for real (one call each here), eager and
    from a CUDA graph (here a stand-in whose replay calls the function: the CPU has no graphs),
    then one summary row per variant and timing, and the table; the grid and table logic:
    tests/test_layer_filter.py."""
    bl = script("bench_linear")
    captured = []

    def fake_capture(run):
        run()  # a capture runs the function once
        captured.append(run)
        return SimpleNamespace(replay=run)

    monkeypatch.setattr(bl, "capture_graph", fake_capture)
    out = tmp_path / "sizes.jsonl"
    assert bl.main(["--sections", "sizes", "--size-grid", "64,96", "--size-tokens", "64",
                    "--pairs", "1", "--rep", "50", "--out", str(out)]) == 0
    rows = rows_of(out)
    assert [r.get("shape") or r["summary"] for r in rows] == [[64, 64], [64, 96], [96, 64], [96, 96], "adahop_lv2",
                                                              "adahop_lv2/graph", "mxfp4", "mxfp4/graph"]
    assert len(captured) == 4 * 3  # per shape: BF16 once, each variant once
    assert set(rows[0]["speedup_vs_bf16"]) == {"adahop_lv2", "adahop_lv2/graph", "mxfp4", "mxfp4/graph"}
    with pytest.raises(SystemExit) as e:
        bl.main(["--sections", "sizes", "--size-timing", "eager,cold"])
    assert e.value.code == 2
    assert all(r["section"] == "sizes" and r["env"]["torch"] == torch.__version__ for r in rows)
    assert rows[0]["modes"]["adahop_lv2"] == {"fprop": "iht", "dgrad": "iht", "wgrad": "iht+oe_right"}
    assert "| 96 | 64 | 77 |" in capsys.readouterr().out  # layer_size(64, 96) = 76.8


@needs_interpreter
def test_bench_kernels_sections_on_cpu(on_cpu, tmp_path, monkeypatch):
    bk = script("bench_kernels")
    monkeypatch.setattr(bk, "COPY_BYTES", 4096)
    monkeypatch.setattr(bk, "QUANT_SHAPE", (64, 64))
    monkeypatch.setattr(bk, "QUANT_CONFIGS", [{}, dict(block_r=8, block_k=64, num_warps=4)])
    monkeypatch.setattr(bk, "SPLIT_CASES", [("g along T -> e4m3", (64, 64), 0, True)])
    monkeypatch.setattr(bk, "BOTH_N", (64,))
    monkeypatch.setattr(bk, "BOTH_TILES", ((32, 32, 4),))
    monkeypatch.setattr(bk, "BOTHX_K", (64,))
    out = tmp_path / "kernels.jsonl"
    # ("single" runs the library's default 16 x 256 launch: minutes under the interpreter)
    assert bk.main(["--sections", "quant,split,both,bothx,oe", "--shapes", "64,64", "--out", str(out)]) == 0
    rows = {}
    for r in rows_of(out):
        rows.setdefault(r["section"], []).append(r)
    assert [len(rows[s]) for s in ("quant", "split", "both", "bothx", "oe")] == [7, 1, 1, 1, 1]
    assert all(len(r["every_config"]) == 2 for r in rows["quant"][:6] if r["variant"] in (
        "x along K -> e4m3, IHT 32", "x along T -> packed, IHT 32 (saved)"))
    assert rows["split"][0]["bit_exact"] and rows["bothx"][0]["bit_exact"]
    assert rows["both"][0]["tile32x32_w4_bit_exact"] is True
    assert rows["oe"][0]["topk_g_rows_equal"] and rows["oe"][0]["topk_x_cols_equal"]


@needs_interpreter
def test_bench_gemm_sections_on_cpu(on_cpu, tmp_path, monkeypatch):
    _, hopper = on_cpu
    bg = script("bench_gemm")
    monkeypatch.setattr(bg, "hopper_backend", lambda: hopper)
    monkeypatch.setattr(bg, "SQUARE", 64)
    monkeypatch.setattr(bg, "MX_SHAPES", [(64, 96, 64)])
    out = tmp_path / "gemm.jsonl"
    assert bg.main(["--shapes", "32,64", "--out", str(out)]) == 0
    rows = rows_of(out)
    assert [(r["section"], r["shape"]) for r in rows] == [("gemm", [64, 64, 64]), ("gemm", [64, 32, 64]),
                                                          ("mx", [64, 96, 64])]
    assert rows[2]["rel_err_vs_reference"] < 1e-6  # tl.dot_scaled's GEMM is the reference's
    assert not hopper.use_fast_accum  # put back after its timing


@needs_interpreter
@CLAMPED_OE
def test_check_hopper_on_cpu(on_cpu, tmp_path, monkeypatch, capsys):
    _, hopper = on_cpu
    ch = script("check_hopper")
    from adahop.ops import get_backend

    monkeypatch.setattr(ch, "require_fp8_gpu", lambda: None)
    monkeypatch.setattr(ch, "backend", lambda name: hopper if name == "hopper_fp8" else get_backend(name, "cpu"))
    monkeypatch.setattr(ch, "QUANTIZE_CASES", [((64, 64), 1, None, "rne", "even"), ((64, 96), 0, 32, "sr", "rceil")])
    monkeypatch.setattr(ch, "GEMM_SHAPES", ((64, 64), (32, 64)))
    monkeypatch.setattr(ch, "LINEAR_SHAPE", (128, 64, 32))  # T > OE's k = 64
    monkeypatch.setattr(ch, "LINEAR_RECIPES", ("mxfp4", "adahop_lv2"))
    out = tmp_path / "check.jsonl"
    assert ch.main(["--out", str(out)]) == 0
    rows = rows_of(out)
    quantize = [r for r in rows if r["section"] == "quantize"]
    assert len(quantize) == 2 and all(r["codes_bit_exact"] and r["unpack_bit_exact"] for r in quantize)
    assert [r["recipe"] for r in rows if r["section"] == "linear"] == ["mxfp4", "adahop_lv2"]
    assert all(max(r["rel_y"], r["rel_dx"], r["rel_dw"]) < 1e-2 for r in rows if r["section"] == "linear")
    assert "quantize: 2/2 cases bit-exact" in capsys.readouterr().out


# ---- training scripts ---------------------------------------------------------------------------------------
SPEED = ["--preset", "debug", "--model-size", "tiny", "--no-compile", "--batch-size", "2", "--seq-len", "32",
         "--steps", "2", "4", "--calibration-steps", "1"]


def test_bench_train_speed_end_to_end(corpus, tmp_path, capsys):
    """bf16, mxfp4 (x quantized once per group, then per layer), bf16, each in its own process:
    one row per run with the environment, the table with both ratios."""
    ts = script("bench_train_speed")
    out = tmp_path / "speed.jsonl"
    assert ts.main([*SPEED, "--corpus", str(corpus), "--recipes", "mxfp4", "--out", str(out),
                    "--run-dir", str(tmp_path), "--share-input", "both"]) == 0
    rows = rows_of(out)
    assert [(r["run"], r["recipe"], r["share_input"]) for r in rows] == [
        (1, "bf16", False), (2, "mxfp4", True), (3, "mxfp4", False), (4, "bf16", False)]
    assert len({r["call"] for r in rows}) == 1
    for r in rows:
        assert r["window"] == [2, 4] and r["tokens_per_step"] == 64 and r["model_size"] == "tiny"
        assert r["steady_tokens_per_s"] > 0 and r["ms_per_step"] > 0 and r["first_step_s"] > 0
        assert r["peak_memory_bytes"] is r["steady_peak_memory_bytes"] is None  # CUDA's counters only
        assert r["calibration_micro_batches"] == 1 and r["min_features"] == 0  # the size rule: the default
        assert len(r["losses"]) == 4 and all(math.isfinite(v) for v in r["losses"])
        for gemm, counts in r["mode_counts"].items():  # the per-layer modes add up to the counts
            assert counts == dict(collections.Counter(m[gemm] for m in r["modes"].values()))
        assert r["env"]["adahop"] and r["env"]["command"].startswith("python benchmarks/bench_train_speed.py")
    # the same model, data and seed: the two bf16 runs train to the same losses, and mxfp4 to the
    # same losses whether its q, k, v (w1, w3) quantize x once or each its own
    assert rows[0]["losses"] == rows[3]["losses"] != rows[1]["losses"] == rows[2]["losses"]
    assert list(tmp_path.glob("speed_*")) == []  # each run's folder removed after it
    text = capsys.readouterr().out
    assert "| 2 | mxfp4 (x shared) |" in text and "| 3 | mxfp4 |" in text
    assert "vs bf16 (first)" in text and "bf16 drift over the call" in text
    assert "| peak memory | steady peak memory |" in text
    on_gpu = {**rows[1], "peak_memory_bytes": 3 * 2**30, "steady_peak_memory_bytes": 2 * 2**30}
    assert "| 3.00 GiB | 2.00 GiB |" in ts.table([on_gpu])


def test_activation_memory_reads_what_the_compiled_graph_saves(tmp_path, capsys):
    """The tiny model on the CPU: bf16 keeps x in bf16 for every linear and a bf16 copy of each
    weight; mxfp4 keeps x packed and no weight copy; sharing x's quantization keeps one packed x
    for q, k and v and one for w1 and w3."""
    am = script("activation_memory")
    out = tmp_path / "am.jsonl"
    assert am.main(["--model-size", "tiny", "--recipes", "bf16", "mxfp4", "--share-input", "both",
                    "--out", str(out)]) == 0
    rows = {(r["recipe"], r["share_input"]): r for r in rows_of(out)}
    assert set(rows) == {("bf16", False), ("mxfp4", False), ("mxfp4", True)}
    bf16, mx, shared = rows["bf16", False], rows["mxfp4", False], rows["mxfp4", True]
    for r in (bf16, mx, shared):
        assert r["activation_bytes_per_token"] == sum(i["bytes"] for i in r["items"] if i["per_token"]) / 160
    # the weights' bf16 copies: q, k, v, o (64 x 64, 32 x 64 twice, 64 x 64) and w1, w3, w2 (192 x 64 each), 2 bytes
    assert bf16["constant_bytes"] == 2 * (2 * 64 * 64 + 2 * 32 * 64 + 3 * 192 * 64)
    assert mx["constant_bytes"] == 7 * 2 * 16  # the layers' SR counter states (int64 [2], two each)
    # x per token: bf16 keeps one bf16 copy of each distinct input (q, k and v read one, w1 and w3
    # another, wo and w2 their own: 64, 64, 64 and 192 wide), mxfp4 one packed copy per layer
    # (0.5 + 1/32 bytes per element: 6 of the 64-wide inputs, 1 of w2's); shared, q, k and v keep
    # one packed copy and w1 and w3 one: 3 of the 6 go
    packed = lambda k: k / 2 + k / 32  # noqa: E731
    assert bf16["activation_bytes_per_token"] - mx["activation_bytes_per_token"] == (
        (3 * 64 + 192) * 2 - (6 * packed(64) + packed(192)))
    assert mx["activation_bytes_per_token"] - shared["activation_bytes_per_token"] == 3 * packed(64)
    assert "| mxfp4 | yes |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        am.main(["--model-size", "tiny", "--tokens", "64"])  # T = 64 is the model's width
    assert am.main(["--model-size", "tiny", "--recipes", "adahop_lv2", "--out", str(out)]) == 2


def test_bench_train_speed_worker_profiles(corpus, tmp_path):
    """One run in this process, adaptive (calibration as 2 micro-batches, then MXFP4), with the
    profile window."""
    ts = script("bench_train_speed")
    row_file = tmp_path / "row.json"
    assert ts.main([*SPEED, "--corpus", str(corpus), "--profile-steps", "1", "--worker", "adahop_lv2",
                    "--calibration-steps", "1", "--calibration-micro-batches", "2", "--min-features", "64",
                    "--row-file", str(row_file)]) == 0
    row = json.loads(row_file.read_text())
    assert row["min_features"] == 64
    assert row["recipe"] == "adahop_lv2" and row["calibration_steps"] == 1 and len(row["losses"]) == 5
    assert row["calibration_micro_batches"] == 2
    # the tiny model's 14 linears but wk and wv (layer size 2*64*32/96 < 64: BF16 by the size rule),
    # modes frozen after the calibration step
    assert all(sum(row["mode_counts"][gemm].values()) == 10 for gemm in ("fprop", "dgrad", "wgrad"))
    assert "calibrating" not in row["mode_counts"]["wgrad"]
    assert row["profiled"] == "cpu op self time" and row["device_ms_per_step"] > 0
    assert any("mm" in name for name, _, _ in row["top"])


def test_bench_train_speed_refuses_a_gpu_preset_without_cuda(corpus, tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("checks the refusal on a machine without CUDA")
    ts = script("bench_train_speed")
    assert ts.main(["--corpus", str(corpus), "--out", str(tmp_path / "rows.jsonl")]) == 2
    assert "no usable CUDA GPU" in capsys.readouterr().err
    assert ts.main(["--corpus", str(tmp_path / "none"), "--preset", "debug"]) == 2
    assert not (tmp_path / "rows.jsonl").exists()


def test_gpu_reference_check_trains_every_recipe(corpus, tmp_path):
    import adahop

    rows = script("gpu_reference_check").train_every_recipe(corpus, device="cpu", steps=2, out_dir=tmp_path,
                                                          batch_size=2, seq_len=32)
    assert [r["recipe"] for r in rows] == list(adahop.RECIPES)
    assert all(r["finite"] and r["steps"] == 2 for r in rows)


@needs_interpreter
def test_quantize_ceiling_candidates_on_cpu(on_cpu, tmp_path, monkeypatch):
    qc = script("quantize_ceiling")
    monkeypatch.setattr(qc, "bench", lambda fn, rep=100: (fn(), 1.0)[1])
    monkeypatch.setattr(qc, "COPY_BYTES", 4096)
    monkeypatch.setattr(qc, "MODELS", {"1b": dict(T=64, x=(64,), g=(32, 64), w=((64, 96),))})
    monkeypatch.setattr(qc, "ROWS_CONFIGS", ((16, 64, 4),))
    out = tmp_path / "ceiling.jsonl"
    assert qc.main(["--sections", "rows,weight", "--models", "1b", "--out", str(out)]) == 0
    rows = {r["variant"]: r for r in rows_of(out) if "variant" in r}
    owned = {v: r for v, r in rows.items() if "owned rows" in v}
    assert len(owned) == 3 * 6  # x along K, g along N, g along T; exact / bound / given, butterfly or dot
    for v, r in owned.items():
        if "tensor cores" not in v and ("exact" in v or "given" in v):
            assert r["bytes_differ"] == 0.0, v  # the library's bits (the section asserts it too)
        if "tensor cores" not in v and "bound" in v:
            # a larger row scale moves every e4m3 byte but, in range, not the value it stands for
            assert r["bytes_differ"] > 0 and r["max_rel_to_row_max"] == 0.0, v
    assert sum("W [64,96]" in v for v in rows) == 2


@needs_interpreter
def test_quantize_ceiling_torch_form_is_the_librarys_bits():
    """The PyTorch form the producer section compiles gives the quantize kernel's bits (eager)."""
    qc = script("quantize_ceiling")
    from adahop.kernels.quantize import quantize_operand_triton
    from adahop.ops import OperandSpec

    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 128, generator=g)
    x[:, 3] *= 40
    x[2, 64:96] *= 1e-6  # a block many binades below its row's largest
    y = x.to(torch.bfloat16)
    for hadamard, spec in ((False, OperandSpec()), (True, OperandSpec(hadamard_size=32))):
        e4, rs = qc.e4m3_form_torch(y, hadamard)
        ref = quantize_operand_triton(y, 1, spec, packed=False, e4m3=True)
        assert torch.equal(e4.view(torch.uint8), ref["e4m3"].view(torch.uint8))
        assert torch.equal(rs, ref["row_scale"])
