"""The quantization-error study (benchmarks/quant_error_study.py) runs, and its --quick numbers
show the effects the full study documents: IHT rescues inner x inner outliers that share
channels, and OE recovers the output energy of outer-dim outliers."""

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPT = BENCH / "quant_error_study.py"


@pytest.fixture(scope="module")
def study():
    if str(BENCH) not in sys.path:  # the scripts import their shared helpers (benchmarks/common.py)
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location("quant_error_study", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    args = mod.parse_args(["--quick", "--magnitudes", "25"])
    assert args.out is None  # --quick writes no file unless --out says where
    return mod, args, mod.run_study(args)[25.0]


def test_every_case_has_every_method(study):
    mod, _, results = study
    assert set(results) == set(mod.CASES)
    for res in results.values():
        assert set(res.sqnr) >= set(mod.METHODS)
        assert res.sqnr["bf16"] > 40  # BF16 operands with fp32 accumulation
        assert all(0 < res.sqnr[m] < 40 for m in mod.FP4_MODES)  # 4-bit: far below BF16


def test_iht_helps_shared_inner_outliers(study):
    _, _, results = study
    res = results[(("col", "row"), "same")]
    assert res.sqnr["iht"] > res.sqnr["mxfp4"] + 4


def test_oe_recovers_outer_outliers(study):
    _, _, results = study
    right = results[(("none", "col"), "distinct")]
    assert right.sqnr["iht+oe_right"] > right.sqnr["iht"] + 4
    left = results[(("row", "none"), "distinct")]
    assert left.sqnr["iht+oe_left"] > left.sqnr["iht"] + 4


def test_report_renders(study):
    mod, args, results = study
    text = mod.report(args, {25.0: results}, 1.0)
    assert "| (col, row) |" in text and "IHT+OE-R" in text
