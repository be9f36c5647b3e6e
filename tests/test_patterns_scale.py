"""The detector's scale invariance and its defined results (adahop.patterns.detect, docs/method.md,
'Outlier patterns and their detection')."""

from __future__ import annotations

import math

import pytest
import torch

from adahop.patterns.detect import detect_outlier_pattern, outlier_scores, topk_energy_share, unit_scaled


def planted(kind: str, shape=(256, 192), seed=0, dtype=torch.float32, device="cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(shape, generator=g, dtype=torch.float64)
    if kind == "row":
        t[[i % shape[0] for i in (3, 70, 200)]] *= 20
    elif kind == "col":
        t[:, [i % shape[1] for i in (5, 99)]] *= 20
    return t.to(dtype).to(device)


def reference_scores(t: torch.Tensor) -> tuple[float, float]:
    """The AdaHOP reference's scores, with its absolute 1e-8 (what the library used to run)."""
    m = t.double()
    r, c = m.var(dim=1), m.var(dim=0)
    cv_r = (r.std() / (r.mean() + 1e-8)).item() / math.sqrt(2 / (m.shape[1] - 1))
    cv_c = (c.std() / (c.mean() + 1e-8)).item() / math.sqrt(2 / (m.shape[0] - 1))
    return cv_r, cv_c


def reference_label(t: torch.Tensor, tau: float = 2.0) -> str:
    cv_r, cv_c = reference_scores(t)
    if cv_r / (cv_c + 1e-8) > tau:
        return "row"
    return "col" if cv_c / (cv_r + 1e-8) > tau else "none"


@pytest.mark.parametrize("kind", ["row", "col", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_scores_and_labels_are_scale_invariant(kind, dtype):
    t = planted(kind, dtype=dtype)
    s = outlier_scores(t)
    label = detect_outlier_pattern(t)
    assert label == kind
    for factor in (1e-6, 1e6, 1e-20, 1e20):
        u = (t.double() * factor).to(dtype)
        su = outlier_scores(u)
        # bf16 rounds the scaled values again: its tolerance is bf16's, not float32's
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
        assert su.cv_row == pytest.approx(s.cv_row, rel=tol) and su.cv_col == pytest.approx(s.cv_col, rel=tol)
        assert detect_outlier_pattern(u) == label
        assert topk_energy_share(u, 4) == pytest.approx(topk_energy_share(t, 4), rel=tol)
    for e in (-100, -60, 60, 100):  # a power of two changes exponents only: bit-identical scores
        if dtype == torch.float64 or abs(e) <= 60:
            assert outlier_scores(t * 2.0**e) == s


def test_the_reference_detector_loses_small_tensors_and_this_one_does_not():
    """Below unit scale the reference's 1e-8 outgrows the variances: its scores shrink (at 1e-6,
    the scale of a gradient of a mean loss over many tokens) and then its label goes (1e-10); ours
    are those at unit scale."""
    t = planted("row", dtype=torch.float64)
    assert reference_scores(t * 1e-6)[0] < 0.01 * reference_scores(t)[0]
    assert reference_label(t) == "row" and reference_label(t * 1e-10) == "none"
    s = outlier_scores(t)
    for factor in (1e-6, 1e-10):
        su = outlier_scores(t * factor)
        assert (su.cv_row, su.cv_col) == pytest.approx((s.cv_row, s.cv_col), rel=1e-5)
        assert detect_outlier_pattern(t * factor) == "row"


@pytest.mark.parametrize("scale", [1.0, 1e-30, 1e30])
def test_gaussian_scores_about_one_at_any_scale(scale):
    t = planted("none", shape=(512, 256), seed=3) * scale
    s = outlier_scores(t)
    assert 0.8 < s.cv_row < 1.2 and 0.8 < s.cv_col < 1.2, s


def test_defined_results_for_zero_tiny_and_bad_tensors():
    # all zero: no spread at all, scores 0, "none"; no energy to share
    s = outlier_scores(torch.zeros(8, 8))
    assert (s.cv_row, s.cv_col) == (0.0, 0.0)
    assert detect_outlier_pattern(torch.zeros(8, 8)) == "none"
    assert all(math.isnan(v) for v in topk_energy_share(torch.zeros(8, 8), 2))
    # every row constant: the rows have no variance (cv_row 0); the columns all the same one
    rows_const = torch.arange(8.0).repeat_interleave(8).reshape(8, 8)
    s = outlier_scores(rows_const)
    assert s.cv_row == 0.0 and s.cv_col == pytest.approx(0.0, abs=1e-6)
    # subnormal float32 values: scaled exactly into range, a defined label
    sub = planted("row") * 1e-42
    assert sub.abs().max() < torch.finfo(torch.float32).tiny
    s_sub = outlier_scores(sub)
    assert math.isfinite(s_sub.cv_row) and math.isfinite(s_sub.cv_col)
    assert detect_outlier_pattern(sub) in ("row", "none")  # few mantissa bits left: defined, not exact
    # float64 beyond float32's range: scaled before the cast
    huge, ref = outlier_scores(planted("col", dtype=torch.float64) * 1e300), outlier_scores(planted("col"))
    assert (huge.cv_row, huge.cv_col) == pytest.approx((ref.cv_row, ref.cv_col), rel=1e-5)
    # NaN / Inf, fewer than 2 rows or columns, empty: NaN scores, "none"
    for t in (torch.full((4, 4), math.nan), planted("row").index_fill(0, torch.tensor([1]), math.inf),
              torch.randn(1, 64), torch.randn(64, 1), torch.zeros(0, 8)):
        s = outlier_scores(t)
        assert math.isnan(s.cv_row) and math.isnan(s.cv_col) and detect_outlier_pattern(t) == "none"


def test_unit_scaled_is_a_power_of_two_scaling():
    t = planted("row") * 3e-7
    u = unit_scaled(t)
    ratio = (u / t)[t != 0]
    assert torch.all(ratio == ratio[0]) and math.frexp(ratio[0].item())[0] == 0.5  # one power of two
    assert 0.5 <= u.abs().max().item() < 1.0
    assert torch.equal(unit_scaled(torch.zeros(3, 3)), torch.zeros(3, 3))
