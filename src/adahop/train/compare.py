"""Comparing finished runs: steady throughput from a run's log, and the table + loss-curve plot of
``adahop compare``."""

from __future__ import annotations

import json
import math
from pathlib import Path

from adahop.train.run_log import read_log
from adahop.train.trainer import TrainConfig


def steady_tokens_per_s(records: list[dict], calibration_steps: int = 0) -> float | None:
    """Median tokens/s of the logged steps after calibration and the first 10% of the run
    (compilation, warm-up), leaving out steps that also ran an evaluation."""
    if not records:
        return None
    skip = max(calibration_steps, records[-1]["step"] // 10)  # by step number: any log_every
    rates = sorted(r["tok_per_s"] for r in records if r["step"] > skip and "tok_per_s" in r and "eval" not in r)
    return rates[len(rates) // 2] if rates else None


def run_labels(run_dirs) -> list[str]:
    """One label per run folder: its name, or the path as given where two names are equal."""
    names = [Path(d).name or str(d) for d in run_dirs]
    return [n if names.count(n) == 1 else str(d) for n, d in zip(names, run_dirs)]


def compare_runs(run_dirs, plot_path=None) -> str:
    """A Markdown table of the runs (held-out loss, gap to the first bf16 run, tokens/s, peak
    memory) and, with ``plot_path``, their loss curves as a PNG. Runs are keyed by folder, so two
    runs of one recipe (two seeds, say) are two rows and two curves."""
    from adahop.train.plot import plot_loss_curves

    rows, curves, calibration, phases, seeds = [], {}, {}, {}, {}
    for d, label in zip(run_dirs, run_labels(run_dirs)):
        d = Path(d)
        try:
            cfg = TrainConfig.from_dict(json.loads((d / "config.json").read_text()))
        except (OSError, ValueError) as e:
            raise ValueError(f"{d / 'config.json'} is not a run config of adahop train: {e}") from None
        log = read_log(d)
        curves[label] = [r for r in log if "loss" in r]
        seeds[label] = cfg.seed
        calibration[label] = cfg.adahop.calibration_steps if cfg.adahop.adaptive else None
        switch = next((r for r in log if "bf16_phase" in r), None)  # where the run's BF16 phase began
        if switch is not None:
            phases[label] = (switch["step"], "/".join(switch["bf16_phase"]["gemms"]))
        final = next((r["final_eval"] for r in reversed(log) if "final_eval" in r), None)
        summary = json.loads((d / "summary.json").read_text()) if (d / "summary.json").exists() else {}
        heldout = final["loss"] if final else math.nan
        rows.append((label, cfg.recipe, len(curves[label]), heldout, summary.get("tokens_per_s"),
                     steady_tokens_per_s(curves[label], cfg.adahop.calibration_steps),
                     summary.get("peak_memory_bytes")))
    baseline = next((r for r in rows if r[1] == "bf16"), None)
    lines = ["| run | recipe | steps | held-out loss | gap to bf16 | tokens/s (whole run) | tokens/s (steady) "
             "| vs bf16 | peak GPU memory |",
             "|---|---|---|---|---|---|---|---|---|"]
    for label, recipe, steps, loss, tps, steady, mem in rows:
        gap = f"{loss - baseline[3]:+.4f}" if baseline is not None and math.isfinite(loss) else "-"
        mem_s = f"{mem / 2**30:.2f} GiB" if mem else "-"
        speed = f"{steady / baseline[5]:.2f}x" if baseline is not None and baseline[5] and steady else "-"
        lines.append(f"| {label} | {recipe} | {steps} | {loss:.4f} | {gap} | {tps or 0:.0f} | {steady or 0:.0f} "
                     f"| {speed} | {mem_s} |")
    notes = seed_notes(seeds, baseline[0]) if baseline is not None else {}
    if notes:
        lines.append(f"\nseeds differ from the bf16 run {baseline[0]}'s (seed {seeds[baseline[0]]}): "
                     + ", ".join(f"{label} ({note})" for label, note in notes.items())
                     + "; their gap to bf16 also holds the seeds' difference (not a paired one)")
    table = "\n".join(lines)
    if plot_path:
        plot_loss_curves(curves, plot_path, title="training loss by run",
                         baseline=baseline[0] if baseline is not None else None,
                         calibration_steps=max((c for c in calibration.values() if c), default=None),
                         bf16_phases=phases, notes=notes)
    return table


def seed_notes(seeds: dict[str, int], baseline: str) -> dict[str, str]:
    """A note per run whose seed is not the ``baseline`` run's: its difference to the baseline
    is then not a paired one (other initialisation, data order and rounding streams)."""
    return {label: f"seed {seed} vs {seeds[baseline]}" for label, seed in seeds.items()
            if label != baseline and seed != seeds[baseline]}
