"""Loss curves of several runs in one PNG (matplotlib, headless)."""

from __future__ import annotations

import os
from pathlib import Path


def plot_loss_curves(runs: dict[str, list[dict]], path: str | os.PathLike, *, title: str = "", smooth: int = 10) -> Path:
    """``runs``: name -> training log records (``step``, ``loss``). Draws the raw loss faintly and
    a moving average of ``smooth`` steps on top; writes ``path`` (PNG)."""
    try:
        import matplotlib
    except ImportError as e:
        raise ValueError("plotting needs matplotlib: pip install matplotlib (or adahop[train])") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    for i, (name, records) in enumerate(runs.items()):
        pts = [(r["step"], r["loss"]) for r in records if "loss" in r]
        if not pts:
            continue
        steps, losses = zip(*pts)
        color = f"C{i % 10}"
        ax.plot(steps, losses, color=color, alpha=0.25, linewidth=0.8)
        k = max(1, min(smooth, len(losses)))
        avg = [sum(losses[max(0, j - k + 1): j + 1]) / len(losses[max(0, j - k + 1): j + 1]) for j in range(len(losses))]
        ax.plot(steps, avg, color=color, linewidth=1.6, label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats/token)")
    ax.set_title(title or "training loss")
    ax.grid(alpha=0.3)
    ax.legend()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
