"""Loss curves of several runs in one PNG (matplotlib, headless).

The recipes' curves lie within a few hundredths of a nat of each other, invisible on a plot that
spans the whole descent, so a second panel shows each run's training loss minus the baseline
run's at the same step. The runs share data order and seed, so the step-by-step difference is a
paired one: a moving average of it is far less noisy than either curve.
"""

from __future__ import annotations

import os
from pathlib import Path


def pyplot(what: str):
    """``matplotlib.pyplot`` on the headless Agg backend; a one-line ValueError naming ``what``
    needs it when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError as e:
        raise ValueError(f"{what} needs matplotlib: pip install matplotlib (or adahop[train])") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path) -> Path:
    """Lay ``fig`` out, write it to ``path`` and close it; an OSError names the file."""
    plt = pyplot("saving a figure")
    fig.tight_layout()
    try:
        fig.savefig(path, bbox_inches="tight")
    except OSError as e:
        plt.close(fig)
        raise OSError(e.errno, e.strerror, str(path)) from e
    plt.close(fig)
    return path


def moving_average(values, k: int) -> list[float]:
    """Trailing mean over ``k`` values (fewer at the start)."""
    out, acc = [], 0.0
    for j, v in enumerate(values):
        acc += v
        if j >= k:
            acc -= values[j - k]
        out.append(acc / min(j + 1, k))
    return out


LINESTYLES = ("-", (0, (5, 2)), (0, (1, 1.5)), (0, (5, 2, 1, 2)))  # solid, dashed, dotted, dash-dot


def run_styles(n: int) -> list[tuple[tuple[float, ...], object]]:
    """A (colour, line style) per run, no two alike: matplotlib's ten default colours up to ten
    runs; beyond, evenly spaced colours of a colormap (tab20 up to 20 runs, then turbo), with the
    line style cycling so that neighbouring colours differ in the dash too."""
    plt = pyplot("plotting")
    if n <= 10:
        colors = [plt.get_cmap("tab10")(i) for i in range(n)]
    elif n <= 20:
        cmap = plt.get_cmap("tab20")
        colors = [cmap(i) for i in range(n)]
    else:
        cmap = plt.get_cmap("turbo")
        colors = [cmap(0.05 + 0.9 * i / (n - 1)) for i in range(n)]
    return [(tuple(c), LINESTYLES[0] if n <= 10 else LINESTYLES[i % len(LINESTYLES)]) for i, c in enumerate(colors)]


def plot_loss_curves(runs: dict[str, list[dict]], path: str | os.PathLike, **kwargs) -> Path:
    """``loss_curve_figure(runs, **kwargs)`` written to ``path`` (PNG)."""
    fig = loss_curve_figure(runs, **kwargs)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return save_figure(fig, path)  # (tight_layout there makes room for the lower panel's two-line y-label)


def loss_curve_figure(runs: dict[str, list[dict]], *, title: str = "", smooth: int = 10,
                      baseline: str | None = None, gap_smooth: int = 50, calibration_steps: int | None = None,
                      bf16_phases: dict[str, tuple[int, str]] | None = None, notes: dict[str, str] | None = None):
    """``runs``: name -> training log records (``step``, ``loss``). Draws the raw loss faintly and
    a moving average of ``smooth`` steps on top (the legend, right of the panels, says which is
    which). With ``baseline`` (a name in ``runs``), a lower panel shows every other run's loss
    minus the baseline's at the steps both logged, averaged over ``gap_smooth`` steps; ``notes``
    (name -> text) go beside a run's name in that panel's legend (e.g. that its seed is not the
    baseline's, so the difference is not a paired one). With ``calibration_steps``, the BF16
    calibration window (steps 1 to that) is shaded. With ``bf16_phases`` (name -> (steps done at
    the switch, the GEMMs switched)), a dashed line in the run's colour marks where its BF16
    phase began. Returns the matplotlib figure."""
    if baseline is not None and baseline not in runs:
        raise ValueError(f"baseline {baseline!r} is not one of the runs {list(runs)}")
    plt = pyplot("plotting")
    notes = notes or {}

    curves = {name: dict((r["step"], r["loss"]) for r in records if "loss" in r) for name, records in runs.items()}
    with_gap = baseline is not None and len(runs) > 1
    if with_gap:
        fig, (ax, ax_gap) = plt.subplots(2, 1, figsize=(11, 7.5), dpi=120, sharex=True,
                                         gridspec_kw={"height_ratios": [3, 2]})
    else:
        fig, ax = plt.subplots(figsize=(11, 5), dpi=120)
    styles = dict(zip(curves, run_styles(len(curves))))
    for name, curve in curves.items():
        if not curve:
            continue
        steps, losses = zip(*sorted(curve.items()))
        color, dash = styles[name]
        ax.plot(steps, losses, color=color, alpha=0.25, linewidth=0.8)
        ax.plot(steps, moving_average(losses, max(1, smooth)), color=color, linestyle=dash, linewidth=1.6,
                label=name)
        if with_gap and name != baseline:
            both = sorted(set(curve) & set(curves[baseline]))
            if both:
                diff = [curve[s] - curves[baseline][s] for s in both]
                label = f"{name} ({notes[name]})" if name in notes else name
                ax_gap.plot(both, moving_average(diff, max(1, gap_smooth)), color=color, linestyle=dash,
                            linewidth=1.4, label=label)
    if calibration_steps:
        for a in (ax, ax_gap) if with_gap else (ax,):
            a.axvspan(0, calibration_steps, color="0.85", zorder=0)
        ax.plot([], [], color="0.85", linewidth=6,
                label=f"adaptive recipes: BF16 calibration, steps 1-{calibration_steps}")
    for name in curves:
        if name in (bf16_phases or {}):
            step, gemms = bf16_phases[name]
            for a in (ax, ax_gap) if with_gap else (ax,):
                a.axvline(step, color=styles[name][0], linestyle="--", linewidth=1.0)
            ax.plot([], [], color=styles[name][0], linestyle="--", linewidth=1.0,
                    label=f"{name}: {gemms} in BF16 from step {step + 1}")
    ax.plot([], [], color="0.4", alpha=0.25, linewidth=0.8, label="faint: loss of each step")
    ax.plot([], [], color="0.4", linewidth=1.6, label=f"solid: {smooth}-step moving average")
    ax.set_ylabel("training loss (nats/token)")
    ax.set_title(title or "training loss")
    ax.grid(alpha=0.3)
    # the legends right of the panels, never over the curves (save_figure's tight bounding box
    # widens the PNG to hold them)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    if with_gap:
        ax_gap.axhline(0.0, color="black", linewidth=0.8)
        ax_gap.set_ylabel(f"loss minus {baseline}\n({gap_smooth}-step mean)")
        ax_gap.set_xlabel("step")
        ax_gap.grid(alpha=0.3)
        ax_gap.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    else:
        ax.set_xlabel("step")
    return fig
