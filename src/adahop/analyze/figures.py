"""The report's PNG figures (matplotlib, headless), each readable without the code:

- ``patterns_heatmap.png``: the voted pattern of X, W and G of every layer (blocks down, layer
  kinds across when the names have a block index, else one row per layer);
- ``scores_depth.png``: the detector's decision statistic log2(cv_row / cv_col) over depth, per
  tensor and layer kind, with the thresholds +-log2(tau) between which a tensor is "none";
- ``pattern_changes.png``: per step, the share of layers whose label differs from their vote;
- ``sqnr_by_pair.png``: per (A, B) pattern pair, the mean output SQNR of every strategy, with the
  lv2 table's pick marked;
- ``policies.png``: per GEMM (fprop, dgrad, wgrad), the mean output SQNR of each policy's picks
  beside naive MXFP4 and the ceiling, each with its share of FLOPs in BF16.
"""

from __future__ import annotations

import math
from pathlib import Path

from adahop.analyze.strategies import strategy_of_mode
from adahop.patterns.calibration import TENSOR_ROLES
from adahop.patterns.detect import PATTERNS
from adahop.policy import table_mode
from adahop.train.plot import pyplot, save_figure

PATTERN_COLORS = {"row": "#d62728", "col": "#1f77b4", "none": "#e6e6e6"}
ROLE_NAMES = {"x": "X (activation)", "w": "W (weight)", "g": "G (output gradient)"}
FIGURES = ("patterns_heatmap.png", "scores_depth.png", "pattern_changes.png", "sqnr_by_pair.png", "policies.png")


def _plt():
    return pyplot("the report's figures")


def _short(kind: str) -> str:
    return kind.rsplit(".", 1)[-1]


def _grid(layers: list[dict]):
    """(row labels, column kinds, cell -> layer) of the block x kind grid, or None when the
    layers have no block index (or a single block)."""
    blocks = sorted({la["block"] for la in layers if la["block"] is not None})
    if len(blocks) < 2 or any(la["block"] is None for la in layers):
        return None
    kinds = list(dict.fromkeys(la["kind"] for la in layers))
    cells = {(la["block"], la["kind"]): la for la in layers}
    return blocks, kinds, cells


def patterns_heatmap(study: dict, path: Path) -> Path:
    plt = _plt()
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    layers = study["layers"]
    code = {p: i for i, p in enumerate(PATTERNS)}
    cmap = ListedColormap([PATTERN_COLORS[p] for p in PATTERNS])
    grid = _grid(layers)
    if grid is not None:
        blocks, kinds, cells = grid
        cols = [(k, r) for k in kinds for r in TENSOR_ROLES]
        data = [[code[cells[(b, k)]["tensors"][r]["pattern"]] if (b, k) in cells else math.nan for k, r in cols]
                for b in blocks]
        ylabels, ylabel = [str(b) for b in blocks], "block (depth: input at the top)"
        xlabels = [f"{_short(k)}\n{r.upper()}" for k, r in cols]
        xlabel = "layer kind and tensor (X activation, W weight, G output gradient)"
    else:
        cols = [(None, r) for r in TENSOR_ROLES]
        data = [[code[la["tensors"][r]["pattern"]] for _, r in cols] for la in layers]
        ylabels, ylabel = [la["name"] for la in layers], "layer (model order)"
        xlabels, xlabel = [ROLE_NAMES[r] for _, r in cols], "tensor"
    n_rows, n_cols = len(data), len(cols)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.42 * n_cols + 2.5), max(3.0, 0.26 * n_rows + 2.0)), dpi=120)
    ax.imshow(data, cmap=cmap, vmin=-0.5, vmax=len(PATTERNS) - 0.5, aspect="auto", interpolation="nearest")
    ax.set_xticks(range(n_cols), xlabels, fontsize=7 if n_cols > 9 else 9)
    step = max(1, n_rows // 40)
    ax.set_yticks(range(0, n_rows, step), ylabels[::step], fontsize=7 if n_rows > 20 else 9)
    if grid is not None:
        for i in range(1, len(grid[1])):
            ax.axvline(i * len(TENSOR_ROLES) - 0.5, color="black", linewidth=1.2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    steps = study["settings"]["steps"]
    ax.set_title(f"Outlier pattern per layer and tensor (majority over {steps} step{'s' * (steps > 1)})\n"
                 "row: a few rows (tokens, or W's output rows) carry the large values; col: a few columns (channels)",
                 fontsize=9)
    ax.legend(handles=[Patch(color=PATTERN_COLORS[p], label=p) for p in PATTERNS], loc="upper left",
              bbox_to_anchor=(1.01, 1.0), title="pattern", fontsize=8)
    return save_figure(fig, path)


def _log_ratio(mean: dict) -> float:
    r, c = mean.get("cv_row"), mean.get("cv_col")
    if r is None or c is None or not (math.isfinite(r) and math.isfinite(c)) or r <= 0 or c <= 0:
        return math.nan
    return math.log2(r / c)


def scores_depth(study: dict, path: Path) -> Path:
    plt = _plt()
    layers = study["layers"]
    tau = study["settings"]["tau"]
    kinds = list(dict.fromkeys(la["kind"] for la in layers))
    use_blocks = _grid(layers) is not None
    fig, axes = plt.subplots(len(TENSOR_ROLES), 1, figsize=(9, 8.5), dpi=120, sharex=True)
    for ax, r in zip(axes, TENSOR_ROLES):
        for i, kind in enumerate(kinds):
            pts = [(la["block"] if use_blocks else j, _log_ratio(la["tensors"][r]["mean"]))
                   for j, la in enumerate(layers) if la["kind"] == kind]
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, marker="o", markersize=3, linewidth=1.2, color=f"C{i % 10}",
                        label=_short(kind) if use_blocks else None)
        lim = math.log2(tau)
        ax.axhspan(-lim, lim, color="0.9", zorder=0)
        ax.axhline(lim, color="black", linestyle="--", linewidth=0.8)
        ax.axhline(-lim, color="black", linestyle="--", linewidth=0.8)
        ax.text(1.005, lim, " row above", transform=ax.get_yaxis_transform(), va="bottom", fontsize=7)
        ax.text(1.005, -lim, " col below", transform=ax.get_yaxis_transform(), va="top", fontsize=7)
        ax.set_ylabel(f"{ROLE_NAMES[r]}\nlog2(cv_row / cv_col)", fontsize=8)
        ax.grid(alpha=0.3)
    if use_blocks:
        axes[0].legend(fontsize=7, ncol=min(len(kinds), 7), loc="lower left", bbox_to_anchor=(0.0, 1.02))
    axes[-1].set_xlabel("block (depth)" if use_blocks else "layer index (model order)")
    fig.suptitle(f"Detector statistic over depth (mean scores over the steps); grey band: 'none' (tau = {tau:g})",
                 fontsize=9)
    return save_figure(fig, path)


def pattern_changes(study: dict, path: Path) -> Path:
    plt = _plt()
    stab = study["summary"]["stability"]
    steps = study["settings"]["steps"]
    n = study["summary"]["layers"]
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    width = 0.8 / len(TENSOR_ROLES)
    for i, r in enumerate(TENSOR_ROLES):
        differ = stab[r]["differ_from_vote_per_step"]
        xs = [s + 1 + (i - 1) * width for s in range(steps)]
        share = stab[r]["stable_share"]
        ax.bar(xs, [100.0 * d / n for d in differ], width=width, color=f"C{i}",
               label=f"{ROLE_NAMES[r]}: label the same on every step in {100 * (share or 0):.0f}% of layers")
    ax.set_xticks(range(1, steps + 1))
    ax.set_xlabel("step (one batch each; the weights do not change)")
    ax.set_ylabel("layers whose label differs from their vote (%)")
    ax.set_ylim(0, max(5.0, ax.get_ylim()[1]))
    ax.set_title(f"Pattern changes over {steps} step{'s' * (steps > 1)} ({n} layers)", fontsize=10)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8, loc="upper left")
    return save_figure(fig, path)


BASE_COLORS = {"mxfp4": "#7f7f7f", "iht": "#2ca02c", "iht_rs": "#98df8a"}


def _strategy_color(plt, s: str, strategies: list[str]):
    """Grey and greens for the transforms alone; OE-left in oranges, OE-right in blues, darker
    for a larger k."""
    if s in BASE_COLORS:
        return BASE_COLORS[s]
    side = s.split("@")[0]
    same = [t for t in strategies if t.split("@")[0] == side]
    shade = 0.35 + 0.6 * (same.index(s) + 1) / len(same)
    return (plt.cm.Oranges if side == "iht+oe_left" else plt.cm.Blues)(shade)


def sqnr_by_pair(study: dict, path: Path) -> Path:
    plt = _plt()
    by_pair = study["summary"]["by_pair"]
    k = study["settings"]["policy_oe_k"]
    strategies = [s for s in study["strategies"] if s != "bf16"]  # BF16 sits ~35 dB above: in the labels
    fig, ax = plt.subplots(figsize=(max(8.0, 1.35 * len(by_pair) + 2.5), 5.5), dpi=120)
    if not by_pair:
        ax.text(0.5, 0.5, "no GEMM was multiplied (sqnr_steps = 0)", ha="center", va="center", transform=ax.transAxes)
        ax.set_xlabel("(A, B) pattern pair")
        ax.set_ylabel("output SQNR (dB)")
        return save_figure(fig, path)
    order = [f"({a}, {b})" for a in ("row", "none", "col") for b in ("row", "none", "col")]
    pairs = [p for p in order if p in by_pair]
    width = 0.84 / len(strategies)
    values = []
    for j, s in enumerate(strategies):
        xs = [i + (j - (len(strategies) - 1) / 2) * width for i in range(len(pairs))]
        ys = [by_pair[p]["mean_sqnr_db"][s] for p in pairs]
        ys = [math.nan if y is None else y for y in ys]
        values += [y for y in ys if math.isfinite(y)]
        ax.bar(xs, ys, width=width, color=_strategy_color(plt, s, strategies), label=s)
    labels, marked = [], False
    for i, p in enumerate(pairs):
        a, b = p.strip("()").split(", ")
        pick = strategy_of_mode(table_mode((a, b), "lv2"), k)
        bf16 = by_pair[p]["mean_sqnr_db"]["bf16"]
        labels.append(f"{p}\n{by_pair[p]['gemms']} GEMMs\nbf16 {bf16:.0f} dB" + ("\n(lv2 picks bf16)" if pick == "bf16"
                                                                                    else ""))
        if pick in strategies and by_pair[p]["mean_sqnr_db"][pick] is not None:
            j = strategies.index(pick)
            ax.plot(i + (j - (len(strategies) - 1) / 2) * width, by_pair[p]["mean_sqnr_db"][pick] + 0.3, marker="v",
                    color="black", markersize=6, linestyle="none",
                    label=None if marked else f"lv2 table's pick (OE k = {k})")
            marked = True
    ax.set_xticks(range(len(pairs)), labels, fontsize=8)
    lo, hi = (min(values), max(values)) if values else (0.0, 1.0)
    ax.set_ylim(max(0.0, lo - 3), hi + 2)
    ax.set_xlabel("(A, B) pattern pair of the GEMM (A row = outer-dim outliers, A col = inner; B row = inner, "
                  "B col = outer)", fontsize=8)
    ax.set_ylabel("mean output SQNR vs float64 (dB, higher is better)")
    ax.set_title("GEMM output SQNR of each 4-bit strategy, per pattern pair (MXFP4 blocks of 32, RNE; "
                 "the BF16 level is under each pair)", fontsize=10)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.25))
    return save_figure(fig, path)


def policies(study: dict, path: Path) -> Path:
    plt = _plt()
    gemms = ("fprop", "dgrad", "wgrad")
    measured = [(la, g, la["gemms"][g]) for la in study["layers"] for g in gemms if "sqnr_db" in la["gemms"][g]]
    fig, ax = plt.subplots(figsize=(10, 5.2), dpi=120)
    ax.set_xlabel("GEMM (every studied layer, the measured steps)")
    ax.set_ylabel("mean output SQNR vs float64 (dB, higher is better)")
    if not measured:
        ax.text(0.5, 0.5, "no GEMM was multiplied (sqnr_steps = 0)", ha="center", va="center", transform=ax.transAxes)
        return save_figure(fig, path)

    def series(strategy_of) -> tuple[list[float], float]:
        means, hp, flops = [], 0.0, 0.0
        for g in (*gemms, None):
            vals = []
            for la, gm, d in measured:
                if g is None or gm == g:
                    s = strategy_of(la, gm, d)
                    vals += [v for v in d["sqnr_db"][s] if v is not None] if s else d["best_sqnr_db"]
                    if g is None:
                        hp += d["flops"] * d["hp_share"][s or d["best"][0]]
                        flops += d["flops"]
            means.append(sum(vals) / len(vals) if vals else math.nan)
        return means, hp / flops

    rows = [("naive MXFP4", lambda la, g, d: "mxfp4")]
    rows += [(p, lambda la, g, d, p=p: la["policies"][p][g]["strategy"]) for p in study["policies"]]
    rows.append(("the ceiling (best 4-bit mode)", lambda la, g, d: None))
    width = 0.84 / len(rows)
    values = []
    for j, (name, fn) in enumerate(rows):
        means, hp = series(fn)
        xs = [i + (j - (len(rows) - 1) / 2) * width for i in range(len(means))]
        ax.bar(xs, means, width=width, color=f"C{j % 10}", label=f"{name}: {100 * hp:.1f}% of FLOPs in BF16")
        values += [m for m in means if math.isfinite(m)]
    ax.set_xticks(range(len(gemms) + 1), [*gemms, "all GEMMs"])
    ax.set_ylim(max(0.0, min(values) - 3), max(values) + 2)
    ax.set_title("Mean output SQNR of each policy's picks, per GEMM (a BF16 pick counts at its ~55 dB)", fontsize=10)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.13))
    return save_figure(fig, path)


def write_figures(study: dict, folder: Path) -> list[Path]:
    folder = Path(folder)
    return [patterns_heatmap(study, folder / FIGURES[0]), scores_depth(study, folder / FIGURES[1]),
            pattern_changes(study, folder / FIGURES[2]), sqnr_by_pair(study, folder / FIGURES[3]),
            policies(study, folder / FIGURES[4])]

