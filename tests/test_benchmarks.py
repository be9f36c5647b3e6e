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
                            "bench_linear", "bench_train_speed", "check_compile", "check_hopper", "fprop_bias",
                            "gpu_reference_check", "memory_profile", "offline_compile", "pretrained_forward",
                            "quant_error_study", "quantize_ceiling", "sass_count", "train_compare", "value_error"}
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
    import adahop.layer.plan
    from adahop.ops import backends
    from adahop.ops.backends.hopper_fp8 import HopperFP8Backend

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

    monkeypatch.setattr(adahop.layer.plan, "get_backend", get_backend)
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
    from adahop.ops.backends.hopper_fp8 import HopperFP8Backend

    _, hopper = on_cpu
    bg = script("bench_gemm")
    made = []

    def hopper_backend(**options):  # get_backend's: the shared instance, or one of its own per set of options
        made.append(HopperFP8Backend(**options) if options else hopper)
        return made[-1]

    monkeypatch.setattr(bg, "hopper_backend", hopper_backend)
    monkeypatch.setattr(bg, "SQUARE", 64)
    monkeypatch.setattr(bg, "MX_SHAPES", [(64, 96, 64)])
    out = tmp_path / "gemm.jsonl"
    assert bg.main(["--shapes", "32,64", "--out", str(out)]) == 0
    rows = rows_of(out)
    assert [(r["section"], r["shape"]) for r in rows] == [("gemm", [64, 64, 64]), ("gemm", [64, 32, 64]),
                                                          ("mx", [64, 96, 64])]
    assert rows[2]["rel_err_vs_reference"] < 1e-6  # tl.dot_scaled's GEMM is the reference's
    # fast accumulation timed on an instance of its own (gemm section); the shared one stays accurate
    assert [backend.use_fast_accum for backend in made] == [False, True, False] and not hopper.use_fast_accum


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
    """bf16, mxfp4 (x quantized once per group, then per layer; wgrad's x packed, then
    recomputed), bf16, each in its own process: one row per run with the environment, the table
    with both ratios."""
    ts = script("bench_train_speed")
    out = tmp_path / "speed.jsonl"
    assert ts.main([*SPEED, "--corpus", str(corpus), "--recipes", "mxfp4", "--out", str(out),
                    "--run-dir", str(tmp_path), "--share-input", "both", "--wgrad-input", "both"]) == 0
    rows = rows_of(out)
    assert [(r["run"], r["recipe"], r["share_input"], r["wgrad_input"]) for r in rows] == [
        (1, "bf16", False, "packed"), (2, "mxfp4", True, "packed"), (3, "mxfp4", True, "recompute"),
        (4, "mxfp4", False, "packed"), (5, "mxfp4", False, "recompute"), (6, "bf16", False, "packed")]
    # the same quantized values whichever way x is shared and wgrad's x made: the same losses
    assert rows[1]["losses"] == rows[2]["losses"] == rows[3]["losses"] == rows[4]["losses"]
    rows = [rows[0], rows[1], rows[3], rows[5]]
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
    assert "| 2 | mxfp4 (x shared) |" in text and "| 4 | mxfp4 |" in text
    assert "| 3 | mxfp4 (x shared) (wgrad's x recomputed) |" in text
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


def test_activation_memory_with_wgrad_input_recompute(tmp_path, capsys):
    """With x quantized by the backward, the compiled step keeps nothing packed: the norms'
    outputs and w2's input are recomputed from what the norms and SwiGLU keep, so the block keeps
    less than with x packed."""
    am = script("activation_memory")
    out = tmp_path / "am.jsonl"
    assert am.main(["--model-size", "tiny", "--recipes", "mxfp4", "--wgrad-input", "both", "--out", str(out)]) == 0
    packed, recompute = rows_of(out)
    assert (packed["wgrad_input"], recompute["wgrad_input"]) == ("packed", "recompute")
    assert any(i["dtype"] == "uint8" for i in packed["items"])
    assert not any(i["dtype"] == "uint8" and i["per_token"] for i in recompute["items"])
    assert recompute["activation_bytes_per_token"] < packed["activation_bytes_per_token"]
    assert "| mxfp4 | yes | recompute |" in capsys.readouterr().out


def test_activation_memory_traces_torchao_float8_as_a_peer(tmp_path, capsys):
    """torchao's tensorwise float8 on the tiny model, emulated on the CPU: the step keeps float8
    (e4m3) copies of x where bf16 keeps bf16 ones, and so fewer bytes per token per block; the
    table says x sharing does not apply to it (nor to bf16)."""
    torchao = pytest.importorskip("torchao")
    am = script("activation_memory")
    out = tmp_path / "am.jsonl"
    assert am.main(["--model-size", "tiny", "--recipes", "bf16", "torchao_float8_tensorwise",
                    "--out", str(out)]) == 0
    bf16, peer = rows_of(out)
    assert peer["recipe"] == "torchao_float8_tensorwise" and peer["torchao"] == torchao.__version__
    assert peer["float8_recipe"] == "tensorwise" and peer["float8_emulated"] is True
    float8 = [i for i in peer["items"] if i["dtype"] == "float8_e4m3fn"]
    assert float8 and all(i["per_token"] for i in float8), peer["items"]
    assert not any(i["dtype"].startswith("float8") for i in bf16["items"])
    assert peer["activation_bytes_per_token"] < bf16["activation_bytes_per_token"]
    text = capsys.readouterr().out
    assert "| bf16 | - |" in text and f"| torchao_float8_tensorwise (torchao {torchao.__version__}) | - |" in text


def test_activation_memory_peer_without_torchao_is_one_line(tmp_path, monkeypatch, capsys):
    am = script("activation_memory")
    monkeypatch.setitem(sys.modules, "torchao", None)  # import torchao raises ImportError
    assert am.main(["--model-size", "tiny", "--recipes", "torchao_float8_rowwise",
                    "--out", str(tmp_path / "am.jsonl")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install torchao" in err[0], err


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


# ---- the torchao float8 peers, adahop_lv2_tail, the memory profile ------------------------------------------------
class FakeFloat8Linear(torch.nn.Linear):
    """What the fake torchao's conversion swaps in: a forward of its own, as torchao's Float8Linear
    has (it casts to float8 there), so adahop's conversion takes no such layer."""

    def forward(self, x):
        return super().forward(x)


def fake_torchao(monkeypatch, calls):
    """A torchao whose ``convert_to_float8_training`` swaps each accepted Linear for a
    FakeFloat8Linear (torchao's float8 needs a GPU of capability >= 8.9; the CPU tests the wiring)."""
    import types

    class Float8LinearConfig:
        @classmethod
        def from_recipe_name(cls, name):
            return SimpleNamespace(recipe=name)

    def convert_to_float8_training(model, *, config, module_filter_fn):
        calls.append(config.recipe)
        for fqn, mod in list(model.named_modules()):
            for name, child in list(mod.named_children()):
                child_fqn = f"{fqn}.{name}" if fqn else name
                if type(child) is torch.nn.Linear and module_filter_fn(child, child_fqn):
                    new = FakeFloat8Linear(child.in_features, child.out_features, bias=child.bias is not None)
                    new.weight, new.bias = child.weight, child.bias
                    setattr(mod, name, new)
        return model

    torchao = types.ModuleType("torchao")
    torchao.__version__ = "0.17.0-fake"
    float8 = types.ModuleType("torchao.float8")
    float8.Float8LinearConfig = Float8LinearConfig
    float8.convert_to_float8_training = convert_to_float8_training
    torchao.float8 = float8
    monkeypatch.setitem(sys.modules, "torchao", torchao)
    monkeypatch.setitem(sys.modules, "torchao.float8", float8)


def test_bench_train_speed_peers_are_refused_without_torchao_or_a_float8_gpu(corpus, tmp_path, monkeypatch, capsys):
    ts = script("bench_train_speed")
    out = tmp_path / "rows.jsonl"
    argv = [*SPEED, "--corpus", str(corpus), "--recipes", "torchao_float8_tensorwise", "--out", str(out)]
    monkeypatch.setitem(sys.modules, "torchao", None)  # import torchao raises ImportError
    assert ts.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install torchao" in err[0], err
    if not torch.cuda.is_available():
        fake_torchao(monkeypatch, [])
        assert ts.main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "compute capability >= 8.9" in err[0], err
    assert not out.exists()


def test_bench_train_speed_float8_filter_keeps_the_lm_head_and_odd_dims_bf16():
    ts = script("bench_train_speed")
    from adahop.llama.model import Llama, LlamaConfig
    from adahop.schedule import block_filter

    model = Llama(LlamaConfig.from_size("tiny", vocab_size=96, max_seq_len=32))
    model.layers[0].feed_forward.w2 = torch.nn.Linear(200, 64, bias=False)  # 200: not a multiple of 16
    accept = ts.float8_filter(block_filter(model, (0, 0)))
    linears = {fqn: m for fqn, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    kept = {fqn for fqn, m in linears.items() if not accept(m, fqn)}
    head = [fqn for fqn, m in linears.items() if m.weight is model.tok_embeddings.weight]
    assert head and kept == {*head, "layers.0.feed_forward.w2"}
    assert not accept(model.norm, "norm")  # only linears
    # --bf16-blocks and the size rule, as adahop's conversion has them
    assert not ts.float8_filter(block_filter(model, (1, 0)))(linears["layers.0.attention.wq"],
                                                                   "layers.0.attention.wq")


def test_bench_train_speed_worker_runs_a_peer_through_the_trainer(corpus, tmp_path, monkeypatch):
    """A peer: the bf16 run's model converted by torchao before ``train``, adahop's conversion
    left with nothing to do (recipe bf16, no AdaHOP layer), the row naming torchao's version."""
    ts = script("bench_train_speed")
    calls = []
    fake_torchao(monkeypatch, calls)
    monkeypatch.setattr(ts, "require_float8_device", lambda device: None)
    row_file = tmp_path / "row.json"
    assert ts.main([*SPEED, "--corpus", str(corpus), "--worker", "torchao_float8_rowwise",
                    "--row-file", str(row_file)]) == 0
    row = json.loads(row_file.read_text())
    assert calls == ["rowwise"]
    assert row["recipe"] == "torchao_float8_rowwise" and row["torchao"] == "0.17.0-fake"
    assert row["float8_recipe"] == "rowwise" and row["float8_layers"] == 14  # 2 blocks x 7 linears; not the head
    assert row["backend"] is None and row["mode_counts"] == {"fprop": {}, "dgrad": {}, "wgrad": {}}
    assert len(row["losses"]) == 4 and all(math.isfinite(v) for v in row["losses"])


def test_bench_train_speed_sequence_and_table_with_peers():
    ts = script("bench_train_speed")
    args = ts.parse_args(["--recipes", "torchao_float8_tensorwise", "torchao_float8_rowwise", "mxfp4",
                          "adahop_lv2_tail", "--share-input", "both"])
    plain = ("off", "on", "packed")
    assert ts.sequence(args.recipes, args.share_input) == [
        ("bf16", *plain), ("torchao_float8_tensorwise", *plain), ("torchao_float8_rowwise", *plain),
        ("mxfp4", "on", "on", "packed"), ("mxfp4", "off", "on", "packed"), ("adahop_lv2_tail", "on", "on", "packed"),
        ("adahop_lv2_tail", "off", "on", "packed"), ("bf16", *plain)]
    assert ts.sequence(["torchao_float8_tensorwise", "adahop_lv2"], "on", "both") == [
        ("bf16", *plain), ("torchao_float8_tensorwise", *plain), ("adahop_lv2", "on", "on", "packed"),
        ("adahop_lv2", "on", "off", "packed"), ("bf16", *plain)]
    assert ts.sequence(["adahop_lv2"], "on", "on", "both") == [
        ("bf16", *plain), ("adahop_lv2", "on", "on", "packed"), ("adahop_lv2", "on", "on", "recompute"),
        ("bf16", *plain)]

    def row(recipe, tps, peak_gib, **kw):
        return {"recipe": recipe, "steady_tokens_per_s": tps, "ms_per_step": 1.0, "first_step_s": 1.0,
                "peak_memory_bytes": peak_gib * 2**30, "window": [2, 4], "losses": [1.0] * 4, **kw}

    text = ts.table([row("bf16", 1000, 60), row("torchao_float8_tensorwise", 1250, 44.4, torchao="0.17.0"),
                     row("torchao_float8_rowwise", 960, 44.4, torchao="0.17.0"),
                     row("adahop_lv2", 990, 52.5, share_input=True),
                     row("adahop_lv2_tail", 1100, 54, share_input=True, window_phase="in"), row("bf16", 1000, 60),
                     row("adahop_lv2", 950, 52.5, share_input=True, row_bounds=False),
                     row("adahop_lv2", 940, 45.0, share_input=True, wgrad_input="recompute")])
    assert "| vs bf16 (first) | vs bf16 (last) | vs torchao tensorwise |" in text
    assert "| peak memory | steady peak memory | peak vs bf16 |" in text
    lines = text.splitlines()
    assert lines[3].startswith("| 2 | torchao_float8_tensorwise (torchao 0.17.0) | 1250 | 1.250 | 1.250 | 1.000 |")
    assert "| 44.40 GiB | - | 0.740 |" in lines[3]
    assert lines[5].startswith("| 4 | adahop_lv2 (x shared) | 990 | 0.990 | 0.990 | 0.792 |")
    assert "| 0.875 |" in lines[5]
    assert lines[6].startswith("| 5 | adahop_lv2_tail (x shared), in its BF16 phase | 1100 |")
    assert lines[8].startswith("| 7 | adahop_lv2 (x shared) (exact row maxima) | 950 |")
    assert lines[9].startswith("| 8 | adahop_lv2 (x shared) (wgrad's x recomputed) | 940 |")
    assert all(line.count("|") == 14 for line in lines[:10])


def test_bench_train_speed_times_adahop_lv2_tail_before_or_in_its_phase(corpus, tmp_path, capsys):
    """adahop train's default recipe: measured before its BF16 phase (the preset's length), or
    in it (--run-steps puts the phase's first step before P0); a phase that would begin among
    the measured steps is refused before any run."""
    ts = script("bench_train_speed")
    i = SPEED.index("--steps")
    base = SPEED[:i] + SPEED[i + 3:]
    row_file = tmp_path / "row.json"
    assert ts.main([*SPEED, "--corpus", str(corpus), "--worker", "adahop_lv2_tail", "--row-file", str(row_file)]) == 0
    row = json.loads(row_file.read_text())
    assert row["run_steps"] == 20 and row["bf16_phase_start"] == 0.82 and row["window_phase"] == "before"
    assert "bf16" not in row["mode_counts"]["fprop"]
    # 6 steps: the phase after floor(0.82 * 6) = 4 steps, the timed steps 6..6 after P0 = 5
    assert ts.main([*base, "--steps", "5", "6", "--run-steps", "6", "--corpus", str(corpus), "--worker",
                    "adahop_lv2_tail", "--row-file", str(row_file)]) == 0
    row = json.loads(row_file.read_text())
    assert row["run_steps"] == 6 and row["window_phase"] == "in" and len(row["losses"]) == 6
    assert row["mode_counts"]["fprop"] == {"bf16": 14}  # the forward in BF16: the phase ran
    assert row["mode_counts"]["wgrad"] != {"bf16": 14}
    out = tmp_path / "rows.jsonl"
    assert ts.main([*base, "--steps", "3", "5", "--run-steps", "5", "--corpus", str(corpus), "--recipes",
                    "adahop_lv2_tail", "--out", str(out)]) == 2  # the phase after step 4: inside 4..5
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "inside the measured steps 4..5" in err[0], err
    assert not out.exists()
    with pytest.raises(SystemExit):
        ts.parse_args([*SPEED, "--run-steps", "3"])  # ends before P1 = 4


def test_bench_train_speed_memory_snapshot_needs_cuda(corpus, tmp_path, capsys):
    ts = script("bench_train_speed")
    if not torch.cuda.is_available():
        assert ts.main([*SPEED, "--corpus", str(corpus), "--memory-snapshot", "--out", str(tmp_path / "r")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--memory-snapshot records the CUDA allocator" in err[0], err
    for argv in (["--memory-snapshot", "--cudagraphs"], ["--memory-pickle-dir", str(tmp_path)]):
        with pytest.raises(SystemExit) as e:
            ts.parse_args(argv)
        assert e.value.code == 2


def test_bench_train_speed_worker_records_the_step_after_p1(corpus, tmp_path, monkeypatch):
    """--memory-snapshot: recording starts after P1 and stops one step later, with the
    optimizer the trainer built (its state is a kind); the summary goes into the row. (The
    recorder itself needs CUDA: a stand-in here.)"""
    ts = script("bench_train_speed")
    mp = script("memory_profile")
    events = []

    class FakeStepMemory:
        def __init__(self, device):
            self.device = device

        def start(self):
            events.append("start")

        def stop(self, model, optimizer):
            kinds = collections.Counter(t["kind"] for t in mp.end_of_step_tensors(model, optimizer))
            events.append("stop")
            return {"kinds": dict(kinds)}, {"segments": []}

    monkeypatch.setattr(ts, "require_memory_device", lambda device: None)
    monkeypatch.setattr(ts, "StepMemory", FakeStepMemory)
    row_file = tmp_path / "row.json"
    assert ts.main([*SPEED, "--corpus", str(corpus), "--worker", "bf16", "--memory-snapshot", "--memory-pickle-dir",
                    str(tmp_path), "--row-file", str(row_file)]) == 0
    row = json.loads(row_file.read_text())
    assert events == ["start", "stop"] and row["memory_step"] == 5 and len(row["losses"]) == 5
    n_params = row["memory_profile"]["kinds"]["parameter"]
    assert n_params == 2 * 9 + 2  # per block 7 linears and 2 norms; the embedding (the head's too), the last norm
    assert row["memory_profile"]["kinds"] == {"parameter": n_params, "gradient": n_params,
                                              "optimizer_state": 3 * n_params}  # AdamW: step, exp_avg, exp_avg_sq
    assert Path(row["memory_pickle"]).parent == tmp_path and Path(row["memory_pickle"]).exists()


def hand_made_snapshot():
    """A snapshot in torch.cuda.memory._snapshot()'s format (segments and blocks at the end,
    device_traces with frames innermost first) of one step: a parameter and optimizer state
    alive throughout, last step's gradient freed first (zero_grad), the forward saving a bf16 x
    and uint8 codes beside a temporary, the backward marker, the gradient allocated at the old
    one's address, the backward's buffer (the peak), the saved tensors freed."""
    mp = script("memory_profile")
    adahop_frame = lambda f, n: {"filename": f"/root/repo/src/adahop/{f}", "line": 1, "name": n}  # noqa: E731
    inductor = {"filename": "/tmp/torchinductor_root/ab/cabc.py", "line": 9, "name": "call"}
    trainer = adahop_frame("train/trainer.py", "_train")
    backward = {"filename": "/venv/torch/_tensor.py", "line": 5, "name": "backward"}
    events = [
        ("free_requested", 0x3000, 1024, []),
        ("alloc", 0x4000, 4096, [adahop_frame("layer/gemms.py", "forward_gemms"), trainer]),
        ("alloc", 0x5000, 8192, [inductor, trainer]),
        ("free_requested", 0x5000, 8192, []),
        ("free_completed", 0x5000, 8192, []),
        ("alloc", 0x6000, 512, [adahop_frame("kernels/quantize.py", "quantize_both"), inductor, trainer]),
        ("alloc", 0x7000, 512, [{"filename": "/root/repo/benchmarks/memory_profile.py", "line": 3,
                                 "name": mp.MARKER}, trainer]),
        ("free_requested", 0x7000, 512, []),
        ("alloc", 0x3000, 1024, [{"filename": "/venv/torch/autograd/graph.py", "line": 2,
                                  "name": "_engine_run_backward"}, backward, trainer]),
        ("alloc", 0x8000, 16384, [inductor, {"filename": "/venv/torch/_functorch/x.py", "line": 1,
                                             "name": "backward"}, backward, trainer]),
        ("segment_alloc", 0x10000, 2**20, []),
        ("free_requested", 0x8000, 16384, []),
        ("free_requested", 0x4000, 4096, []),
        ("free_requested", 0x6000, 512, []),
    ]
    trace = [{"action": a, "addr": addr, "size": size, "stream": 0, "frames": frames}
             for a, addr, size, frames in events]
    block = lambda addr, size, state: {"address": addr, "size": size, "requested_size": size,  # noqa: E731
                                       "state": state, "frames": []}
    segments = [{"device": 0, "address": 0x1000, "total_size": 0x8000, "stream": 0, "segment_type": "large",
                 "allocated_size": 4096, "active_size": 4096,
                 "blocks": [block(0x1000, 1024, "active_allocated"), block(0x1400, 0xc00, "inactive"),
                            block(0x2000, 2048, "active_allocated"), block(0x2800, 0x800, "inactive"),
                            block(0x3000, 1024, "active_allocated"), block(0x3400, 0x5c00, "inactive")]},
                {"device": 1, "address": 0x90000, "total_size": 4096, "blocks": [block(0x90000, 4096,
                                                                                       "active_allocated")]}]
    tensors = [
        {"address": 0x1000, "bytes": 1024, "kind": "parameter", "dtype": "float32", "shape": [16, 16], "at": "end"},
        {"address": 0x3000, "bytes": 1024, "kind": "gradient", "dtype": "float32", "shape": [16, 16], "at": "end"},
        {"address": 0x2000, "bytes": 2048, "kind": "optimizer_state", "dtype": "float32", "shape": [2, 16, 16],
         "at": "end"},
        {"address": 0x4000, "bytes": 4000, "kind": "saved_activation", "dtype": "bfloat16", "shape": [40, 50],
         "at": "backward"},
        {"address": 0x6000, "bytes": 400, "kind": "saved_activation", "dtype": "uint8", "shape": [20, 20],
         "at": "backward"},
        # the weight saved for the backward is the parameter
        {"address": 0x1000, "bytes": 1024, "kind": "saved_activation", "dtype": "float32", "shape": [16, 16],
         "at": "backward"},
    ]
    return {"segments": segments, "device_traces": [trace, []]}, tensors


def test_memory_profile_summarizes_the_peak_of_a_hand_made_snapshot():
    mp = script("memory_profile")
    snapshot, tensors = hand_made_snapshot()
    s = mp.summarize(snapshot, tensors)
    # alive before: 1024 + 2048 + 1024 (the old gradient); the peak after the backward's buffer
    assert s["peak_bytes"] == 1024 + 2048 + 4096 + 512 + 1024 + 16384 and s["peak_in"] == "backward"
    assert s["backward_start_bytes"] == 1024 + 2048 + 4096 + 512
    assert s["by_kind"] == {"parameter": 1024, "gradient": 1024, "optimizer_state": 2048, "saved_activation": 4608,
                            "other": 16384}
    assert s["saved_by_dtype"] == {"bfloat16": 4096, "uint8": 512}
    assert s["saved_by_shape"][0] == ["bfloat16", [40, 50], 4096, 1]
    assert {name: b for name, b, _ in s["by_site"]} == {
        "other: compiled backward (Inductor)": 16384, "saved_activation: adahop/layer/gemms.py:forward_gemms": 4096,
        "optimizer_state: (allocated before the recorded step)": 2048,
        "gradient: torch/autograd/graph.py:_engine_run_backward": 1024,
        "parameter: (allocated before the recorded step)": 1024,
        "saved_activation: adahop/kernels/quantize.py:quantize_both": 512}
    # without the tensors every block is "other"
    bare = mp.summarize(snapshot)
    assert bare["peak_bytes"] == s["peak_bytes"] and bare["by_kind"]["other"] == s["peak_bytes"]
    assert mp.summarize(snapshot, device=1)["peak_bytes"] == 4096  # alive all through, no trace
    text = mp.markdown(s)
    assert "| saved_activation | 0.00 GiB | 18.4% |" in text and "| uint8 |" in text


def test_memory_profile_command_line(tmp_path, capsys):
    import pickle

    mp = script("memory_profile")
    snapshot, tensors = hand_made_snapshot()
    path = tmp_path / "snap.pickle"
    path.write_bytes(pickle.dumps({**snapshot, "memory_profile_tensors": tensors}))
    assert mp.main([str(path), "--out", str(tmp_path / "s.json")]) == 0
    assert json.loads((tmp_path / "s.json").read_text()) == json.loads(json.dumps(mp.summarize(snapshot, tensors)))
    assert "| optimizer_state |" in capsys.readouterr().out
    (tmp_path / "t.json").write_text("[]")
    assert mp.main([str(path), "--tensors", str(tmp_path / "t.json"), "--out", str(tmp_path / "s.json")]) == 0
    assert json.loads((tmp_path / "s.json").read_text())["by_kind"]["other"] == 25088
    capsys.readouterr()
    (tmp_path / "bad.pickle").write_bytes(pickle.dumps([1, 2]))
    for bad in (tmp_path / "bad.pickle", tmp_path / "none.pickle"):
        assert mp.main([str(bad)]) == 2
        assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_memory_profile_lists_what_the_autograd_graph_saves():
    """The saved tensors of a loss's graph, walked before its backward: an AdaHOP layer's packed
    codes (uint8) beside the bf16 input autocast saves for nn.Linear, each storage once."""
    import adahop

    mp = script("memory_profile")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))
    adahop.convert_to_adahop_training(model, config=adahop.AdaHOPConfig.from_recipe_name("mxfp4"),
                                      module_filter_fn=lambda mod, fqn: fqn == "0")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(torch.randn(32, 64))
    loss = torch.nn.functional.cross_entropy(logits.float(), torch.zeros(32, dtype=torch.long))
    saved = mp.saved_tensors(loss)
    assert all(t["kind"] == "saved_activation" and t["at"] == "backward" for t in saved)
    assert len({t["address"] for t in saved}) == len(saved)
    by = collections.defaultdict(set)
    for t in saved:
        by[t["dtype"]].add(tuple(t["shape"]))
    assert (32, 64) in by["bfloat16"]  # the second linear's input (the ReLU's output), saved once
    assert by["uint8"]  # the converted layer's packed operands
    assert any(t["address"] == model[0].weight.untyped_storage().data_ptr() for t in saved)
    loss.backward()


def test_bench_train_speed_worker_runs_torchao_itself_where_installed(corpus, tmp_path, monkeypatch):
    """The real torchao's API as the peers call it (its float8 training runs on the CPU too, through
    torch._scaled_mm; the GPU check is what the CPU lacks). CI has no torchao: the fake above
    tests the wiring there."""
    pytest.importorskip("torchao.float8")
    ts = script("bench_train_speed")
    monkeypatch.setattr(ts, "require_float8_device", lambda device: None)
    row_file = tmp_path / "row.json"
    assert ts.main([*SPEED, "--corpus", str(corpus), "--worker", "torchao_float8_tensorwise",
                    "--row-file", str(row_file)]) == 0
    row = json.loads(row_file.read_text())
    import torchao

    assert row["torchao"] == torchao.__version__ and row["float8_layers"] == 14
    assert all(math.isfinite(v) for v in row["losses"])


@pytest.mark.parametrize("fails_in", ["start", "stop"])
def test_bench_train_speed_keeps_the_speed_when_the_memory_snapshot_fails(fails_in, corpus, tmp_path, monkeypatch,
                                                                          capsys):
    ts = script("bench_train_speed")

    class BrokenStepMemory:
        def __init__(self, device):
            pass

        def start(self):
            if fails_in == "start":
                raise RuntimeError("no history")

        def stop(self, model, optimizer):
            raise RuntimeError("no history")

    monkeypatch.setattr(ts, "require_memory_device", lambda device: None)
    monkeypatch.setattr(ts, "StepMemory", BrokenStepMemory)
    row_file = tmp_path / "row.json"
    assert ts.main([*SPEED, "--corpus", str(corpus), "--worker", "bf16", "--memory-snapshot",
                    "--row-file", str(row_file)]) == 0
    row = json.loads(row_file.read_text())
    assert row["memory_error"] == "RuntimeError: no history" and row["memory_profile"] is None
    assert row["steady_tokens_per_s"] > 0
    assert "RuntimeError: no history" in capsys.readouterr().err


def test_bench_train_speed_docstring_1b_commands_time_the_tail_in_its_phase():
    """The 1B comparison the docstring gives parses, and times adahop_lv2_tail in its BF16 phase
    (the config as run_config makes it, less the device check: the CPU has no 1B GPU run)."""
    import dataclasses
    import shlex

    from adahop.train.recipes import preset

    ts = script("bench_train_speed")
    text = ts.__doc__.replace("\\\n", " ")
    commands = [shlex.split(line.strip())[2:] for line in text.splitlines()
                if line.strip().startswith("python benchmarks/bench_train_speed.py") and "torchao_float8" in line]
    assert len(commands) == 4  # the third: with and without the row bounds; the fourth: x packed and recomputed
    recipes = set()
    for argv in commands:
        args = ts.parse_args(argv)
        assert args.model_size == "1b" and args.memory_snapshot and args.compile == "model" and not args.cudagraphs
        recipes |= set(args.recipes)
        for recipe in args.recipes:
            cfg = preset(args.preset, recipe="bf16" if recipe in ts.PEERS else recipe, model_size=args.model_size,
                         calibration_steps=args.calibration_steps, steps=args.run_steps)
            cfg = dataclasses.replace(cfg, steps=max(cfg.steps, ts.last_step(args)))
            assert cfg.batch_size * cfg.seq_len == 64 * 512
            phase = ts.window_phase(cfg, recipe, args.steps[0], ts.last_step(args))
            assert phase == ("in" if recipe == "adahop_lv2_tail" else None)
    assert recipes == {"torchao_float8_tensorwise", "torchao_float8_rowwise", "mxfp4", "adahop_lv2", "adahop_lv2_tail"}


def test_memory_profile_lists_the_plain_tensors_inside_a_saved_subclass():
    """A saved tensor subclass that wraps others (torchao's float8 tensors, run eagerly) counts
    as the tensors that hold its memory."""
    from torch.testing._internal.two_tensor import TwoTensor

    mp = script("memory_profile")
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    w = torch.randn(4, 4, requires_grad=True)
    loss = (TwoTensor(a, b).requires_grad_() @ w).sum()
    addresses = {t["address"] for t in mp.saved_tensors(loss)}
    assert {a.untyped_storage().data_ptr(), b.untyped_storage().data_ptr()} <= addresses


def test_memory_profile_step_memory_with_the_cuda_calls_stood_in(monkeypatch):
    """StepMemory on the CPU, with torch.cuda's recording calls replaced: the loss's saved tensors
    are listed when the trainer's cross_entropy returns it, cross_entropy is put back, the
    recording is switched off, the summary carries the measured peak and the snapshot the tensors."""
    mp = script("memory_profile")
    calls = []
    snapshot, _ = hand_made_snapshot()
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: calls.append("reset"))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 12345)
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history",
                        lambda enabled, **kw: calls.append(("record", enabled, kw.get("stacks"))))
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda device=None: snapshot)
    real = torch.nn.functional.cross_entropy
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters())
    recorder = mp.StepMemory(torch.device("cpu"))
    recorder.start()
    assert torch.nn.functional.cross_entropy is not real
    loss = torch.nn.functional.cross_entropy(model(torch.randn(3, 8)), torch.tensor([0, 1, 2]))
    loss.backward()
    opt.step()
    summary, snap = recorder.stop(model, opt)
    assert torch.nn.functional.cross_entropy is real
    assert calls == ["reset", ("record", "all", "python"), ("record", None, None)]
    assert summary["measured_peak_bytes"] == 12345 and summary["peak_bytes"] == 25088
    kinds = collections.Counter(t["kind"] for t in snap["memory_profile_tensors"])
    assert kinds["parameter"] == 2 and kinds["gradient"] == 2 and kinds["optimizer_state"] == 6
    assert kinds["saved_activation"] >= 1  # the linear's input, the loss's log-softmax
