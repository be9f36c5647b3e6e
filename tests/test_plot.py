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


def _records(offset, steps=60):
    return [{"step": s, "loss": 5.0 + offset - s / 100} for s in range(1, steps + 1)]


def test_twelve_runs_get_distinct_styles_and_legends_beside_the_panels():
    from adahop.train.plot import loss_curve_figure, run_styles

    styles = run_styles(12)
    assert len(set(styles)) == 12 and len({c for c, _ in styles}) == 12  # no colour repeats (was C{i % 10})
    runs = {"bf16": _records(0.0), **{f"run-{i:02d}": _records(0.01 * i) for i in range(1, 12)}}
    fig = loss_curve_figure(runs, baseline="bf16", gap_smooth=5, notes={"run-03": "seed 1 vs 0"})
    ax, ax_gap = fig.axes
    gap_lines = [ln for ln in ax_gap.get_lines() if not ln.get_label().startswith("_")]
    assert len({ln.get_color() for ln in gap_lines}) == 11
    assert "run-03 (seed 1 vs 0)" in [t.get_text() for t in ax_gap.get_legend().get_texts()]
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for a in (ax, ax_gap):  # each legend lies right of the panels: it covers no curve
        assert a.get_legend().get_window_extent(renderer).x0 >= a.get_window_extent(renderer).x1
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_compare_notes_runs_of_another_seed_than_bf16(tmp_path, monkeypatch):
    import json

    import adahop.train.plot as plot_mod
    from adahop.train.compare import compare_runs
    from adahop.train.recipes import preset

    dirs = []
    for name, recipe, seed in (("b", "bf16", 0), ("same", "adahop_lv2", 0), ("other", "adahop_lv2", 3)):
        d = tmp_path / name
        d.mkdir()
        cfg = preset("debug", recipe=recipe, seed=seed, out_dir=str(d), corpus_dir=str(tmp_path))
        (d / "config.json").write_text(json.dumps(cfg.to_dict()))
        (d / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _records(0.0, 5)))
        dirs.append(d)
    drawn = {}
    monkeypatch.setattr(plot_mod, "plot_loss_curves", lambda curves, path, **kw: drawn.update(kw))
    table = compare_runs(dirs, tmp_path / "c.png")
    assert "seeds differ from the bf16 run b's (seed 0): other (seed 3 vs 0)" in table
    assert "same (" not in table
    assert drawn["notes"] == {"other": "seed 3 vs 0"}
    assert "seeds differ" not in compare_runs(dirs[:2])
