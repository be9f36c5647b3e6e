"""The loss-curve plot: the moving average and the gap-to-baseline panel."""

import pytest

pytest.importorskip("matplotlib")

from adahop.train.plot import moving_average, plot_loss_curves  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_moving_average_is_trailing():
    assert moving_average([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert moving_average([2.0, 4.0], 10) == [2.0, 3.0]
    assert moving_average([], 3) == []


def test_plot_with_a_gap_panel(tmp_path):
    base = [{"step": s, "loss": 5.0 - s / 100} for s in range(1, 101)]
    other = [{"step": s, "loss": 5.02 - s / 100} for s in range(1, 101, 2)]  # logs every other step
    png = plot_loss_curves({"bf16": base, "adahop_lv2": other}, tmp_path / "c.png", baseline="bf16",
                           calibration_steps=10, bf16_phases={"adahop_lv2": (82, "fprop")})
    assert png.read_bytes()[:8] == PNG_MAGIC
    with pytest.raises(ValueError, match="baseline 'fp8'"):
        plot_loss_curves({"bf16": base}, tmp_path / "d.png", baseline="fp8")
