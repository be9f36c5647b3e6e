"""Comparing finished runs: steady throughput from a run's log, and the table + loss-curve plot of
``adahop compare``."""

from __future__ import annotations

import json
import math
from pathlib import Path

from adahop.train.trainer import TrainConfig, read_log


def steady_tokens_per_s(records: list[dict], calibration_steps: int = 0) -> float | None:
    """Median tokens/s of the logged steps after calibration and the first 10% of the run
    (compilation, warm-up), leaving out steps that also ran an evaluation."""
    if not records:
        return None
    skip = max(calibration_steps, records[-1]["step"] // 10)  # by step number: any log_every
    rates = sorted(r["tok_per_s"] for r in records if r["step"] > skip and "tok_per_s" in r and "eval" not in r)
    return rates[len(rates) // 2] if rates else None


def compare_runs(run_dirs, plot_path=None) -> str:
    """A Markdown table of the runs (held-out loss, gap to bf16, tokens/s, peak memory) and, with
    ``plot_path``, their loss curves as a PNG."""
    from adahop.train.plot import plot_loss_curves

    rows, curves = [], {}
    for d in run_dirs:
        d = Path(d)
        cfg = TrainConfig.from_dict(json.loads((d / "config.json").read_text()))
        log = read_log(d)
        curves[cfg.recipe] = [r for r in log if "loss" in r]
        final = next((r["final_eval"] for r in reversed(log) if "final_eval" in r), None)
        summary = json.loads((d / "summary.json").read_text()) if (d / "summary.json").exists() else {}
        heldout = final["loss"] if final else math.nan
        rows.append((cfg.recipe, len(curves[cfg.recipe]), heldout, summary.get("tokens_per_s"),
                     steady_tokens_per_s(curves[cfg.recipe], cfg.adahop.calibration_steps),
                     summary.get("peak_memory_bytes")))
    base = next((r[2] for r in rows if r[0] == "bf16"), None)
    base_tps = next((r[4] for r in rows if r[0] == "bf16"), None)
    lines = ["| recipe | steps | held-out loss | gap to bf16 | tokens/s (whole run) | tokens/s (steady) | vs bf16 "
             "| peak GPU memory |",
             "|---|---|---|---|---|---|---|---|"]
    for recipe, steps, loss, tps, steady, mem in rows:
        gap = f"{loss - base:+.4f}" if base is not None and math.isfinite(loss) else "-"
        mem_s = f"{mem / 2**30:.2f} GiB" if mem else "-"
        speed = f"{steady / base_tps:.2f}x" if base_tps and steady else "-"
        lines.append(f"| {recipe} | {steps} | {loss:.4f} | {gap} | {tps or 0:.0f} | {steady or 0:.0f} | {speed} | {mem_s} |")
    table = "\n".join(lines)
    if plot_path:
        plot_loss_curves(curves, plot_path, title="training loss by recipe",
                         baseline="bf16" if "bf16" in curves else None)
    return table
