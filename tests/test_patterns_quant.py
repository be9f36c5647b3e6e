"""The quantization statistics calibration records (adahop.patterns.quant_error) and their
calibration state (adahop.patterns.calibration): what the measured policy reads."""

from __future__ import annotations

import math
import time

import pytest
import torch

from adahop.formats.mxfp4 import dequantize_mxfp4
from adahop.ops.operand import OperandSpec, quantize_operand, transform_along
from adahop.ops.outliers import topk_outer
from adahop.patterns.calibration import STAT_NAMES, LayerCalibration, TensorObservation, observe_tensor
from adahop.patterns.detect import topk_energy_share, unit_scaled
from adahop.patterns.observation import ENERGY
from adahop.patterns.quant_error import oe_k_ladder, quant_stats, stat_names


def planted(kind: str, shape=(256, 192), seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(shape, generator=g)
    if kind == "row":
        t[[i % shape[0] for i in (3, 70, 200)]] *= 20
    elif kind == "col":
        t[:, [i % shape[1] for i in (5, 99)]] *= 20
    return t


def direct_nsr(m: torch.Tensor, dim: int, hadamard: bool, k: int | None = None) -> float:
    """NSR through ops.operand.quantize_operand (what a GEMM's operand goes through), with the k
    outer slices of the largest norm exact when k is given."""
    spec = OperandSpec(hadamard_size=32 if hadamard else None)
    v = transform_along(m, dim, spec)
    err = (dequantize_mxfp4(quantize_operand(m, dim, spec), keep_padding=True) - v).square()
    if k:
        err[topk_outer(m, 1 - dim, k)] = 0
    return err.sum().item() / m.square().sum().item()


@pytest.mark.parametrize("shape", [(96, 80), (100, 37)])  # 37, 100: padded to the block
def test_quant_stats_equal_the_operand_path_when_nothing_is_sampled(shape):
    m = unit_scaled(planted("col", shape=shape, seed=5))
    st = quant_stats(m, [2, 8])
    assert (st["rows"], st["cols"]) == shape
    for d in (1, 0):
        assert st[f"nsr_mxfp4_d{d}"] == pytest.approx(direct_nsr(m, d, False), rel=1e-5)
        assert st[f"nsr_iht_d{d}"] == pytest.approx(direct_nsr(m, d, True), rel=1e-5)
        for k in (2, 8):
            assert st[f"nsr_oe_d{d}@{k}"] == pytest.approx(direct_nsr(m, d, True, k), rel=1e-5)
    share_r, share_c = topk_energy_share(m, 8)
    assert st["share_rows@8"] == pytest.approx(share_r, rel=1e-5) and st["share_cols@8"] == pytest.approx(share_c)


def test_sampled_quant_stats_are_close_to_the_exact_ones():
    m = unit_scaled(planted("row", shape=(2048, 1536), seed=6))
    exact = quant_stats(m, [16, 64], max_slices=10**9, max_length=10**9)
    sampled = quant_stats(m, [16, 64])  # 64 + 256 of 2048 rows, 1024 of 1536 columns
    for key in exact:
        if key.startswith("prof_"):  # the profiles of a sample: close in sum
            assert sum(sampled[key]) == pytest.approx(sum(exact[key]), rel=0.05), key
        else:
            assert sampled[key] == pytest.approx(exact[key], rel=0.05), key
    assert exact["nsr_oe_d1@64"] < 0.7 * exact["nsr_iht_d1"]  # the planted rows carry a third of the error


def test_quant_stats_scale_with_powers_of_two_and_are_nan_without_signal():
    t = planted("row", shape=(128, 96))
    obs, obs_small = observe_tensor(t, tau=2.0, k=8), observe_tensor(t * 2.0**-50, tau=2.0, k=8)
    # every statistic is scale-free but the tensor's own squared norm, which scales exactly
    assert obs_small.quant.pop(ENERGY) == obs.quant.pop(ENERGY) * 2.0**-100
    assert obs_small == obs
    ks = oe_k_ladder(8)
    profiles = {"prof_mxfp4_d1", "prof_energy_d1", "prof_iht_d1", *(f"prof_oe_d1@{k}" for k in ks)}
    assert set(obs.quant) == {*stat_names(ks), *profiles}
    assert len(obs.quant["prof_iht_d1"]) == 96 // 32 and len(obs.quant["prof_mxfp4_d1"]) == 96
    assert sum(obs.quant["prof_iht_d1"]) == pytest.approx(obs.quant["nsr_iht_d1"], rel=1e-5)
    assert sum(obs.quant["prof_oe_d1@4"]) == pytest.approx(obs.quant["nsr_oe_d1@4"], rel=1e-5)
    assert sum(obs.quant["prof_mxfp4_d1"]) == pytest.approx(obs.quant["nsr_mxfp4_d1"], rel=1e-5)
    assert sum(obs.quant["prof_energy_d1"]) == pytest.approx(1.0, rel=1e-5)
    for bad in (torch.zeros(64, 64), torch.full((64, 64), math.nan)):
        o = observe_tensor(bad, tau=2.0, k=8)
        assert o.pattern == "none" and all(math.isnan(o.quant[s]) for s in o.quant if s not in ("rows", "cols", ENERGY))
        assert o.quant[ENERGY] == 0.0 if bad.isfinite().all() else math.isnan(o.quant[ENERGY])
    assert oe_k_ladder(64) == (16, 32, 64, 128) and oe_k_ladder(2) == (1, 2, 4)


def test_observe_tensor_cost_stays_small():
    """The quantization statistics run on a sample: a tensor 16x larger costs far less than 16x."""

    def cost(shape):
        t = torch.randn(shape)
        observe_tensor(t, tau=2.0, k=16)
        t0 = time.perf_counter()
        observe_tensor(t, tau=2.0, k=16)
        return time.perf_counter() - t0

    small, big = cost((512, 256)), cost((4096, 512))
    assert big < 8 * small + 0.05, (small, big)


# ---- calibration state ---------------------------------------------------------------------------
def test_calibration_state_with_the_new_statistics_loads_and_an_old_one_too(tmp_path):
    cal = LayerCalibration()
    for step in range(3):
        for role, t in (("x", planted("col", seed=step)), ("w", planted("row")), ("g", planted("none", seed=9 + step))):
            cal.add(role, observe_tensor(t, tau=2.0, k=8))
    path = tmp_path / "state.pt"
    torch.save({"calibration": cal.to_dict()}, path)
    back = LayerCalibration.from_dict(torch.load(path, weights_only=True)["calibration"])
    assert back == cal and back.summary()["x"]["nsr_oe_d1@8"] == cal.summary()["x"]["nsr_oe_d1@8"]
    # the state an older calibration wrote: the four detector statistics only
    old = {r: {"votes": {"row": 0, "col": 3, "none": 0}, "sums": dict.fromkeys(STAT_NAMES, 3.0),
               "finite_counts": dict.fromkeys(STAT_NAMES, 3)} for r in ("x", "w", "g")}
    old_cal = LayerCalibration.from_dict(old)
    summary = old_cal.summary()
    assert summary["x"] == {"pattern": "col", **dict.fromkeys(STAT_NAMES, 1.0)}
    old_cal.add("x", TensorObservation("col", 1.0, 1.0, 1.0, 1.0))  # and it keeps calibrating
    assert old_cal.tensors["x"].steps == 4
