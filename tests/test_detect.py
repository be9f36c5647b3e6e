"""Outlier-pattern detector (adahop.patterns.detect) and calibration vote
(adahop.patterns.calibration)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from adahop.patterns.calibration import LayerCalibration, TensorObservation, observe_tensor
from adahop.patterns.detect import (
    PATTERNS,
    detect_outlier_pattern,
    outlier_scores,
    topk_energy_share,
)

SHAPES = [(256, 512), (512, 256), (128, 128), (1024, 64), (64, 1024)]


def ref_scores(t: torch.Tensor):
    """The detector's statistic (docs/method.md, 'Outlier patterns and their detection') in float64
    numpy (torch's std/var are unbiased: ddof=1)."""
    m = t.reshape(-1, t.shape[-1]).double().numpy()
    R, C = m.shape
    r = m.var(axis=1, ddof=1)
    c = m.var(axis=0, ddof=1)
    cv_r = r.std(ddof=1) / (r.mean() + 1e-8) / math.sqrt(2 / max(C - 1, 1))
    cv_c = c.std(ddof=1) / (c.mean() + 1e-8) / math.sqrt(2 / max(R - 1, 1))
    return cv_r, cv_c


def plant_rows(x, rows, factor):
    x = x.clone()
    x[rows] *= factor
    return x


def plant_cols(x, cols, factor):
    x = x.clone()
    x[:, cols] *= factor
    return x


# ----------------------------------------------------------------------------- scores


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gaussian_scores_about_one_and_none(shape, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen)
    s = outlier_scores(x)
    assert 0.7 < s.cv_row < 1.3 and 0.7 < s.cv_col < 1.3, s
    assert detect_outlier_pattern(x) == "none"
    # scale does not matter
    assert detect_outlier_pattern(x * 1e3) == "none"
    assert detect_outlier_pattern(x.to(torch.bfloat16)) == "none"


@pytest.mark.parametrize("shape", [(256, 512), (100, 37)])
def test_scores_match_formula(shape):
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(shape, generator=gen)
    x = plant_rows(x, [3, 50], 7.0)
    s = outlier_scores(x)
    r, c = ref_scores(x)
    assert s.cv_row == pytest.approx(r, rel=1e-4)
    assert s.cv_col == pytest.approx(c, rel=1e-4)


@pytest.mark.parametrize("factor", [20.0, 50.0, 100.0])
@pytest.mark.parametrize("shape", [(256, 512), (512, 256), (1024, 128)])
def test_planted_rows_detected(factor, shape):
    gen = torch.Generator().manual_seed(int(factor))
    x = torch.randn(shape, generator=gen)
    rows = torch.randperm(shape[0], generator=gen)[:4]
    y = plant_rows(x, rows, factor)
    s = outlier_scores(y)
    assert s.cv_row / s.cv_col > 2.0
    assert detect_outlier_pattern(y) == "row"
    # the transposed tensor has column outliers
    assert detect_outlier_pattern(y.T) == "col"


@pytest.mark.parametrize("factor", [20.0, 50.0, 100.0])
@pytest.mark.parametrize("shape", [(256, 512), (512, 256), (128, 1024)])
def test_planted_cols_detected(factor, shape):
    gen = torch.Generator().manual_seed(int(factor) + 1)
    x = torch.randn(shape, generator=gen)
    cols = torch.randperm(shape[1], generator=gen)[:3]
    y = plant_cols(x, cols, factor)
    assert detect_outlier_pattern(y) == "col"
    assert detect_outlier_pattern(y.T) == "row"


def test_3d_tensors_are_flattened_into_rows():
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(4, 64, 256, generator=gen)
    x[1, 10] *= 50  # a token outlier
    x[3, 40] *= 50
    assert detect_outlier_pattern(x) == "row"
    s3, s2 = outlier_scores(x), outlier_scores(x.reshape(-1, 256))
    assert s3 == s2
    c = torch.randn(4, 64, 256, generator=gen)
    c[..., 17] *= 50  # a channel outlier
    assert detect_outlier_pattern(c) == "col"
    assert outlier_scores(c) == outlier_scores(c.reshape(256, 256))


def test_undefined_cases_are_none_with_nan_scores():
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(64, 64, generator=gen)
    for bad in (float("nan"), float("inf"), float("-inf")):
        y = plant_rows(x, [1, 2], 100.0)
        y[5, 5] = bad
        assert detect_outlier_pattern(y) == "none"
        s = outlier_scores(y)
        assert math.isnan(s.cv_row) and math.isnan(s.cv_col)
    single_row = torch.randn(1, 128, generator=gen)
    single_row[0, :4] *= 100
    for t in (single_row, single_row[0], torch.randn(128, 1, generator=gen)):
        assert detect_outlier_pattern(t) == "none"
        s = outlier_scores(t)
        assert math.isnan(s.cv_row) and math.isnan(s.cv_col)
    assert detect_outlier_pattern(torch.zeros(0, 8)) == "none"


def test_tensor_with_zero_columns_is_none():
    # module doc: "A tensor with fewer than 2 rows or columns ... is "none" ... and its scores are NaN"
    for t in (torch.zeros(5, 0), torch.zeros(2, 3, 0)):
        assert detect_outlier_pattern(t) == "none"
        s = outlier_scores(t)
        assert math.isnan(s.cv_row) and math.isnan(s.cv_col)


def test_detector_rejects_non_float_tensors():
    with pytest.raises(ValueError):
        detect_outlier_pattern(torch.ones(4, 4, dtype=torch.int64))
    with pytest.raises(ValueError):
        outlier_scores(torch.tensor(1.0))


@pytest.mark.parametrize("tau", [0, 0.0, -1.0, float("nan"), True, "2", None])
def test_bad_tau(tau):
    x = torch.randn(16, 16)
    with pytest.raises(ValueError, match="tau"):
        detect_outlier_pattern(x, tau=tau)


def test_tau_controls_threshold():
    gen = torch.Generator().manual_seed(9)
    y = plant_rows(torch.randn(256, 256, generator=gen), [0, 1, 2], 30.0)
    s = outlier_scores(y)
    ratio = s.cv_row / (s.cv_col + 1e-8)
    assert detect_outlier_pattern(y, tau=ratio * 0.99) == "row"
    assert detect_outlier_pattern(y, tau=ratio * 1.01) == "none"
    assert detect_outlier_pattern(y, tau=2) == "row"  # an int tau is fine


# ----------------------------------------------------------------------------- energy share


def test_topk_energy_share():
    gen = torch.Generator().manual_seed(10)
    x = torch.randn(128, 64, generator=gen, dtype=torch.float64)
    r, c = topk_energy_share(x, 4)
    e = x.square()
    tot = e.sum()
    exp_r = (e.sum(1).sort(descending=True).values[:4].sum() / tot).item()
    exp_c = (e.sum(0).sort(descending=True).values[:4].sum() / tot).item()
    assert r == pytest.approx(exp_r, rel=1e-5) and c == pytest.approx(exp_c, rel=1e-5)
    assert 0 < r < 1 and 0 < c < 1
    # i.i.d.: roughly k / n of the energy (a bit more, the top k are the largest)
    assert 4 / 128 <= r < 3 * 4 / 128 and 4 / 64 <= c < 3 * 4 / 64
    # k >= the number of slices: everything
    r_all, c_all = topk_energy_share(x, 1000)
    assert r_all == pytest.approx(1.0, rel=1e-6) and c_all == pytest.approx(1.0, rel=1e-6)
    # planted rows: the top-k rows carry nearly all the energy
    y = plant_rows(x, [1, 2, 3, 4], 100.0)
    r_y, c_y = topk_energy_share(y, 4)
    assert r_y > 0.99 and c_y < 0.2
    # monotone in k
    shares = [topk_energy_share(x, k)[0] for k in (1, 2, 8, 32)]
    assert shares == sorted(shares)
    # undefined: zero, NaN and empty tensors
    for t in (torch.zeros(4, 4), plant_rows(x, [0], float("nan")), torch.zeros(0, 4)):
        a, b = topk_energy_share(t, 2)
        assert math.isnan(a) and math.isnan(b)


# ----------------------------------------------------------------------------- calibration


def obs(pattern, cv_row=1.0, cv_col=1.0, er=0.1, ec=0.1):
    return TensorObservation(pattern, cv_row, cv_col, er, ec)


def test_observe_tensor():
    gen = torch.Generator().manual_seed(11)
    y = plant_rows(torch.randn(128, 256, generator=gen), [0, 9], 50.0)
    o = observe_tensor(y, tau=2.0, k=2)
    assert o.pattern == "row" == detect_outlier_pattern(y)
    s = outlier_scores(y)
    assert (o.cv_row, o.cv_col) == (s.cv_row, s.cv_col)
    assert (o.row_energy_topk, o.col_energy_topk) == topk_energy_share(y, 2)
    assert observe_tensor(y, tau=1e9, k=2).pattern == "none"


def test_majority_vote_and_ties():
    cal = LayerCalibration()
    assert cal.steps == 0
    assert cal.patterns() == {"x": "none", "w": "none", "g": "none"}  # no votes: tie of zeros
    for p in ["col", "col", "row"]:
        cal.add("x", obs(p))
    for p in ["row", "col"]:  # tie row/col -> none
        cal.add("w", obs(p))
    for p in ["row", "row", "row", "none", "col"]:
        cal.add("g", obs(p))
    assert cal.patterns() == {"x": "col", "w": "none", "g": "row"}
    assert cal.steps == 5  # counted by the output gradients
    # a tie between "row" and "none" gives "none" too; a tie of three gives "none"
    cal2 = LayerCalibration()
    for p in ["row", "none", "row", "none"]:
        cal2.add("x", obs(p))
    for p in ["row", "col", "none"]:
        cal2.add("w", obs(p))
    for p in ["col", "col", "none", "row", "row", "col"]:
        cal2.add("g", obs(p))
    assert cal2.patterns() == {"x": "none", "w": "none", "g": "col"}


def test_summary_means_skip_nan():
    cal = LayerCalibration()
    cal.add("x", obs("col", 1.0, 5.0, 0.2, 0.8))
    cal.add("x", obs("col", 3.0, math.nan, 0.4, math.nan))
    cal.add("x", obs("none", math.nan, 7.0, math.nan, 0.6))
    summ = cal.summary()
    assert summ["x"]["pattern"] == "col"
    assert summ["x"]["cv_row"] == pytest.approx(2.0)
    assert summ["x"]["cv_col"] == pytest.approx(6.0)
    assert summ["x"]["row_energy_topk"] == pytest.approx(0.3)
    assert summ["x"]["col_energy_topk"] == pytest.approx(0.7)
    assert summ["g"]["pattern"] == "none" and math.isnan(summ["g"]["cv_row"])
    assert set(summ) == {"x", "w", "g"}


def test_calibration_round_trip_through_json():
    gen = torch.Generator().manual_seed(12)
    cal = LayerCalibration()
    for step in range(7):
        x = plant_cols(torch.randn(64, 128, generator=gen), [3], 40.0)
        w = torch.randn(96, 128, generator=gen)
        g = plant_rows(torch.randn(64, 96, generator=gen), [step], 40.0)
        for role, t in (("x", x), ("w", w), ("g", g)):
            cal.add(role, observe_tensor(t, tau=2.0, k=4))
    cal.add("w", obs("row", math.nan, math.nan, math.nan, math.nan))  # NaN stats are skipped
    assert cal.patterns() == {"x": "col", "w": "none", "g": "row"}
    d = cal.to_dict()
    back = LayerCalibration.from_dict(d)
    assert back == cal
    assert back.patterns() == cal.patterns() and back.steps == cal.steps == 7
    text = json.dumps(d)  # plain, finite data
    assert "NaN" not in text
    back2 = LayerCalibration.from_dict(json.loads(text))
    assert back2 == cal
    assert back2.summary() == cal.summary()
    # the copy is independent of the original
    back2.add("x", obs("row"))
    assert back2 != cal and cal.tensors["x"].steps == 7


def test_patterns_constant():
    assert set(PATTERNS) == {"row", "col", "none"}
    assert np.all([isinstance(p, str) for p in PATTERNS])
