"""One linear layer, forward + backward, per recipe against BF16 ``nn.Linear`` on a CUDA GPU.

    python benchmarks/bench_linear.py [--sections linear,memory] [--recipes ...] [--shapes all]
        [--pairs 3] [--grads fresh] [--rep 100] [--no-emulation] [--no-row-bounds] [--out FILE]
    python benchmarks/bench_linear.py --sections sizes [--size-grid 256,...,8192] [--size-tokens 32768]

Sections:
  linear:  AdaHOPLinear (hopper_fp8 backend) forward + backward per recipe against BF16
           ``nn.Linear`` at T = 16384 tokens, for each --shapes layer. Each ratio comes from
           --pairs alternating timings of BF16 and the recipe (ratio of the medians), since
           BF16's own time drifts by several percent between runs. Also the naive mxfp4 recipe
           on the reference backend (fake-quant emulation, what FP4 libraries do on Hopper;
           --no-emulation skips it). Each timed iteration starts with no .grad on x and the
           weight, as a training step does after ``zero_grad()`` (--grads accumulate: keep and
           add to them).
  torchao: torchao float8 rowwise and tensorwise (compiled) at (14336, 4096), with the AdaHOP
           recipes in the same rows (one BF16 baseline), when torchao imports.
  profile: where the time of one adahop_lv2 layer goes (CUDA kernels, host enqueue, cProfile),
           at (14336, 4096) or each --shapes layer given.
  graph:   forward + backward captured in a CUDA graph and replayed, AdaHOP and BF16, against
           eager: what removing the host's share would give (each replay advances the layer's
           SR counter on the device, so it draws new bits, as a CUDA-graphed training step does).
  memory:  bytes autograd saves for the backward per recipe against BF16, at (14336, 4096).
  sizes:   where MXFP4 pays: adahop_lv2 (fprop IHT, dgrad IHT, wgrad IHT+OE-right, the modes a
           trained layer runs) and the naive mxfp4 recipe, both hopper_fp8, paired against BF16
           ``nn.Linear`` for every (out_features, in_features) of --size-grid at --size-tokens
           tokens (32768: a 125M step of 64 x 512), each timed twice (--size-timing): eager like
           BF16 (every launch from Python: what a compiled model without CUDA graphs pays, host
           time included) and replayed from a CUDA graph (kernel time alone: what
           ``adahop train --cudagraphs`` pays). Prints each shape's ratios, which shapes pay
           (> 1.0x), and per timing the smallest layer size (the harmonic mean of in and out,
           adahop.convert.layer_size) from which every shape pays: what
           adahop.convert.HOPPER_MIN_FEATURES (the size rule of convert_to_adahop_training) is
           set from. --pairs 2, --rep 50 unless given (81 shapes, about two minutes on an H200).

The adaptive recipes run with the modes a calibrated layer typically gets (activations
col-wise, gradients row-wise: fprop IHT, dgrad IHT+OE-left, wgrad IHT+OE-right). Operands are
random bf16 with channel outliers. Times are ``triton.testing.do_bench`` medians (ms). Rows go
to --out (JSONL, default runs/bench/bench_linear.jsonl), each with the environment.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time

import common
import torch
from common import (
    SHAPES_HELP,
    Results,
    T,
    activation,
    add_out_arg,
    bench,
    paired_speedup,
    parse_sections_and_shapes,
    run_sections,
    script_parser,
    start,
)

import adahop
from adahop.convert import layer_size
from adahop.transforms.hadamard import HADAMARD_SIZES

SECTIONS = ("linear", "torchao", "profile", "graph", "memory", "sizes")
DEFAULT_SECTIONS = ("linear", "memory")
DEFAULT_RECIPES = ("mxfp4", "mxfp4_iht", "tseng", "adahop_lv2", "adahop_lv1")
BACKEND = "hopper_fp8"
SINGLE_SHAPE = (14336, 4096)  # the layer of torchao, profile and memory
# the modes of a typical calibrated layer (activations column-wise, gradients row-wise), which
# every adaptive recipe runs here
ADAHOP_MODES = {"fprop": "iht", "dgrad": "iht+oe_left", "wgrad": "iht+oe_right"}
# What happens to the leaves' .grad between iterations of a timed forward + backward:
# "fresh" (the default) drops x.grad and the weight's .grad first, as a training step does after
# ``optimizer.zero_grad()`` (set_to_none): the backward then writes the gradients, and x's
# gradient would flow on to the layer below. "accumulate" keeps them, so every iteration also
# pays autograd's adds into them. At (14336, 4096) on the H200 that is 0.32 ms of adahop_lv2's
# time and 0.18 ms of BF16's, whose bf16 weight gradient autograd casts to float32 either way.
GRADS = "fresh"
# sizes: the dims of the grid (every (out, in) pair of them), the tokens per GEMM, the modes
SIZE_GRID = (256, 512, 768, 1024, 1536, 2048, 3072, 4096, 8192)
SIZE_TOKENS = 32768  # a 125M training step: 64 sequences of 512
SIZE_MODES = {"fprop": "iht", "dgrad": "iht", "wgrad": "iht+oe_right"}
SIZE_VARIANTS = ("adahop_lv2", "mxfp4")
SIZE_TIMINGS = ("eager", "graph")
# the section's timing budget where --pairs / --rep are not given: 81 shapes x 2 variants x
# 2 pairs x 2 timings of about 75 ms each (do_bench's 25 ms warm-up + 50 ms) is about a minute
SIZE_PAIRS, SIZE_REP = 2, 50
# per section where --pairs / --rep are not given
DEFAULT_PAIRS, DEFAULT_REP = 3, 100


def parse_recipe(recipe: str) -> tuple[str, int | None]:
    """``NAME`` or ``NAME@hN`` (every GEMM's Hadamard N wide, e.g. ``adahop_lv2@h16``): the recipe
    and the Hadamard size (None: the recipe's). ValueError naming what is allowed."""
    name, sep, size = recipe.partition("@h")
    if name not in adahop.RECIPES or (sep and size not in map(str, HADAMARD_SIZES)):
        raise ValueError(f"a recipe is one of {','.join(adahop.RECIPES)}, optionally with @hN for a Hadamard "
                         f"N wide (N of {', '.join(map(str, HADAMARD_SIZES))}); got {recipe!r}")
    return name, int(size) if sep else None


def make_layer(recipe, N, K, backend, modes=None):
    """BF16 ``nn.Linear`` ("bf16_nn") or an AdaHOPLinear of ``recipe`` on ``backend``, no bias,
    frozen to ``modes`` (default for an adaptive recipe: ``ADAHOP_MODES``)."""
    lin = torch.nn.Linear(K, N, bias=False, device=common.DEVICE)
    if recipe == "bf16_nn":
        return lin
    name, hadamard_size = parse_recipe(recipe)
    cfg = adahop.AdaHOPConfig.from_recipe_name(name, backend=backend)
    if hadamard_size is not None:
        cfg = cfg.with_gemm_settings(hadamard_size=hadamard_size)
    layer = adahop.AdaHOPLinear.from_float(lin, config=cfg, name="bench")
    if modes is not None:
        layer.set_modes(modes)
    elif layer.calibrating:
        layer.set_modes(ADAHOP_MODES)
    return layer


def trained_modes(path) -> list[tuple[dict, int]]:
    """The distinct (fprop, dgrad, wgrad) modes of a trained run's modes.json, most layers first,
    with how many layers run each: what a calibrated model runs, beside the fixed ADAHOP_MODES."""
    with open(path) as f:
        modes = json.load(f)
    if not isinstance(modes, dict) or not modes:
        raise ValueError(f"{path}: expected a modes.json of adahop train ({{layer: {{fprop, dgrad, wgrad}}}})")
    counts: dict[tuple, int] = {}
    for layer, entry in modes.items():
        if not isinstance(entry, dict) or not all(g in entry for g in ("fprop", "dgrad", "wgrad")):
            raise ValueError(f"{path}: layer {layer!r} has no fprop/dgrad/wgrad modes (a calibrated run's file?)")
        key = (entry["fprop"], entry["dgrad"], entry["wgrad"])
        counts[key] = counts.get(key, 0) + 1
    return [(dict(zip(("fprop", "dgrad", "wgrad"), k)), n) for k, n in sorted(counts.items(), key=lambda kv: -kv[1])]


def fwd_bwd_fn(layer, x, g):
    """One forward under BF16 autocast and one backward with ``g``, as a function to time."""
    params = list(layer.parameters())
    fresh = GRADS == "fresh"

    def run():
        if fresh:
            x.grad = None
            for p in params:
                p.grad = None
        with torch.autocast(common.DEVICE, dtype=torch.bfloat16):
            y = layer(x)
        y.backward(g)
    return run


def linear_inputs(N, K):
    """The input and output gradient of a layer of shape (N, K) at T tokens."""
    return activation((T, K)).requires_grad_(), activation((T, N), seed=5)


# ---- linear / torchao: paired against BF16 ------------------------------------------------------------
def section_linear(recipes, shapes, with_reference, with_torchao, pairs=3, rep=100, modes_from=None) -> list[dict]:
    """Each recipe paired against BF16 per shape; with ``modes_from`` (a trained run's modes.json)
    also every distinct mode triple it holds, as ``trained:fprop/dgrad/wgrad`` (adahop_lv2's
    settings, the layers running it in ``trained_layers``)."""
    trained = trained_modes(modes_from) if modes_from else []
    rows = []
    for N, K in shapes:
        x, g = linear_inputs(N, K)
        base_fn = fwd_bwd_fn(make_layer("bf16_nn", N, K, None), x, g)
        row = {"shape": (N, K), "grads": GRADS, "pairs": pairs, "rep_ms": rep, "speedup_vs_bf16": {}, "times_ms": {}}

        def timed(name, layer, rep=rep):
            ratio, t_base, t = paired_speedup(base_fn, fwd_bwd_fn(layer, x, g), pairs, rep=rep)  # noqa: B023
            row["speedup_vs_bf16"][name] = ratio  # noqa: B023
            row["times_ms"][name] = {"bf16": t_base, name: t}  # noqa: B023

        for recipe in recipes:
            timed(recipe, make_layer(recipe, N, K, BACKEND))
        for modes, n_layers in trained:
            name = "trained:" + "/".join(modes[g] for g in ("fprop", "dgrad", "wgrad"))
            timed(name, make_layer("adahop_lv2", N, K, BACKEND, modes=modes))
            row.setdefault("trained_layers", {})[name] = n_layers
        if with_reference:
            timed("mxfp4_reference_emulation", make_layer("mxfp4", N, K, "reference"), rep=rep * 3 // 5)
        if with_torchao:
            try:
                from torchao.float8 import Float8LinearConfig, convert_to_float8_training

                for rname in ("rowwise", "tensorwise"):
                    m = torch.nn.Sequential(torch.nn.Linear(K, N, bias=False, device=common.DEVICE))
                    convert_to_float8_training(m, config=Float8LinearConfig.from_recipe_name(rname))
                    timed(f"torchao_{rname}", torch.compile(m))
            except Exception as e:  # only torchao's absence or refusal is recorded, not raised
                row["torchao"] = f"unavailable: {type(e).__name__}: {e}"[:200]
        # BF16's time: the median of every BF16 timing of this shape
        row["bf16_ms"] = statistics.median(t for d in row["times_ms"].values() for t in d["bf16"])
        rows.append(row)
        print("  linear", {k: v for k, v in row.items() if k != "times_ms"}, flush=True)
    return rows


# ---- profile: where the time of one AdaHOP linear goes ---------------------------------------------------
def section_profile(shape, recipe="adahop_lv2") -> list[dict]:
    import cProfile
    import io
    import pstats

    N, K = shape
    layer = make_layer(recipe, N, K, BACKEND)
    x = activation((T, K)).requires_grad_()
    g = activation((T, N), seed=5)
    run = fwd_bwd_fn(layer, x, g)
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            run()
        torch.cuda.synchronize()
    table = []
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if t > 0:
            table.append((ev.key[:90], t / 5 / 1000.0, ev.count // 5))
    table.sort(key=lambda r: -r[1])
    # Host side: the time to enqueue one iteration (no sync) vs the time per iteration overall.
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        run()
    t_enqueue = (time.perf_counter() - t0) / 20
    torch.cuda.synchronize()
    t_total = (time.perf_counter() - t0) / 20
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(5):
        run()
    torch.cuda.synchronize()
    pr.disable()
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(15)
    pstats.Stats(pr, stream=buf).sort_stats("cumulative").print_stats(30)
    print(f"  host: enqueue {t_enqueue * 1e3:.2f} ms/iter, total {t_total * 1e3:.2f} ms/iter", flush=True)
    print(buf.getvalue()[-9000:], flush=True)
    for name, ms, n in table[:25]:
        print(f"  prof {ms:7.3f} ms  x{n:<3d} {name}", flush=True)
    return [dict(recipe=recipe, shape=shape, per_iteration_ms=[list(r) for r in table[:25]],
                 host_enqueue_ms=t_enqueue * 1e3, host_total_ms=t_total * 1e3, cprofile=buf.getvalue()[-9000:])]


# ---- graph: CUDA-graph replay against eager -------------------------------------------------------------
def capture_graph(run, warmup: int = 3) -> torch.cuda.CUDAGraph:
    """``run`` captured in a CUDA graph, after ``warmup`` calls on a side stream (capture wants
    its allocations and lazy initialisations done off the default stream first)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return graph


def section_graph(recipes, shapes, rep=100) -> list[dict]:
    rows = []
    for N, K in shapes:
        x, g = linear_inputs(N, K)
        base = bench(fwd_bwd_fn(make_layer("bf16_nn", N, K, None), x, g), rep=rep)
        row = {"shape": (N, K), "grads": GRADS, "bf16_eager_ms": base}
        for recipe in ["bf16_nn", *recipes]:
            run = fwd_bwd_fn(make_layer(recipe, N, K, BACKEND), x, g)
            if recipe != "bf16_nn":
                row[f"{recipe}_eager_ms"] = bench(run, rep=rep)
            try:
                graph = capture_graph(run)
                row[f"{recipe}_graph_ms"] = bench(graph.replay, rep=rep)
                del graph
            except Exception as e:
                row[f"{recipe}_graph_ms"] = f"{type(e).__name__}: {e}"[:300]
        for recipe in recipes:
            for mode in ("eager", "graph"):
                t = row.get(f"{recipe}_{mode}_ms")
                if isinstance(t, float):
                    row[f"{recipe}_{mode}_vs_bf16_eager"] = base / t
        rows.append(row)
        print("  graph", row, flush=True)
    return rows


# ---- memory: what autograd saves for the backward ---------------------------------------------------------
def section_memory(recipes) -> list[dict]:
    N, K = SINGLE_SHAPE
    x = activation((T, K)).requires_grad_()
    saved = {}
    for recipe in ["bf16_nn", *recipes]:
        layer = make_layer(recipe, N, K, BACKEND)
        params = {p.data_ptr() for p in layer.parameters()}
        total = 0

        def pack(t):
            nonlocal total
            # x counts: a real network would free it otherwise
            if t.data_ptr() not in params:  # noqa: B023
                total += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with torch.autocast(common.DEVICE, dtype=torch.bfloat16):
                layer(x)
        saved[recipe] = total
    base = saved["bf16_nn"]
    return [dict(shape=(N, K), recipe=recipe, saved_bytes=v, ratio_vs_bf16=base / v if v else None)
            for recipe, v in saved.items()]


# ---- sizes: which layer sizes MXFP4 pays for ---------------------------------------------------------------
def section_sizes(grid=SIZE_GRID, tokens=SIZE_TOKENS, pairs=SIZE_PAIRS, rep=SIZE_REP,
                  timings=SIZE_TIMINGS) -> list[dict]:
    """One row per (N, K) = (out_features, in_features) of ``grid`` x ``grid``: each of
    ``SIZE_VARIANTS`` paired against BF16 (``paired_speedup``) at ``tokens`` tokens, under each of
    ``timings`` ("eager": launched from Python; "graph": replayed from a CUDA graph, BF16 too),
    keyed ``variant`` (eager) and ``variant/graph``; then one ``summary`` row per variant and
    timing (``size_threshold``). Prints the table (``sizes_table``)."""
    rows = []
    keys = size_keys(timings)
    for N in grid:
        for K in grid:
            x, g = activation((tokens, K)).requires_grad_(), activation((tokens, N), seed=5)
            base_fn = fwd_bwd_fn(make_layer("bf16_nn", N, K, None), x, g)
            row = {"shape": (N, K), "tokens": tokens, "grads": GRADS, "pairs": pairs, "rep_ms": rep,
                   "modes": {"adahop_lv2": SIZE_MODES}, "speedup_vs_bf16": {}, "times_ms": {}}
            base_graph = capture_graph(base_fn) if "graph" in timings else None
            for name in SIZE_VARIANTS:
                fn = fwd_bwd_fn(make_layer(name, N, K, BACKEND, modes=SIZE_MODES if name == "adahop_lv2" else None),
                                x, g)
                for timing in timings:
                    if timing == "graph":
                        graph = capture_graph(fn)
                        ratio, t_base, t = paired_speedup(base_graph.replay, graph.replay, pairs, rep=rep)
                        del graph
                    else:
                        ratio, t_base, t = paired_speedup(base_fn, fn, pairs, rep=rep)
                    key = size_key(name, timing)
                    row["speedup_vs_bf16"][key] = ratio
                    row["times_ms"][key] = {"bf16": t_base, name: t}
            row["bf16_ms"] = statistics.median(t for k, d in row["times_ms"].items() if "/" not in k for t in d["bf16"])
            rows.append(row)
            print(f"  sizes ({N}, {K}):", {k: round(v, 3) for k, v in row["speedup_vs_bf16"].items()}, flush=True)
            del x, g, base_fn, base_graph
    summary = [{"summary": key, "tokens": tokens, **size_threshold(rows, key)} for key in keys]
    print(sizes_table(rows, summary, keys), flush=True)
    return rows + summary


def size_key(variant: str, timing: str) -> str:
    """The key of a (variant, timing) in a sizes row: ``adahop_lv2`` (eager), ``adahop_lv2/graph``."""
    return variant if timing == "eager" else f"{variant}/{timing}"


def size_keys(timings=SIZE_TIMINGS) -> list[str]:
    return [size_key(name, timing) for name in SIZE_VARIANTS for timing in timings]


def size_threshold(rows: list[dict], variant: str) -> dict:
    """The size rule that ``rows`` (section sizes) decide for ``variant``: ``min_features``, the
    smallest ``layer_size`` (adahop.convert's: the harmonic mean of N and K, rounded up) of the
    grid from which every shape is faster than BF16 (None when even the largest are not), with
    the paying shapes it leaves in BF16 (``paying_left_in_bf16``) and every shape that pays. The
    rule converts when layer_size(N, K) >= min_features; any value in (the grid's next smaller
    size, min_features] splits this grid alike."""
    pays = {tuple(r["shape"]): r["speedup_vs_bf16"][variant] > 1.0 for r in rows}

    def size(s):
        return math.ceil(layer_size(*s))

    threshold = next((d for d in sorted({size(s) for s in pays})
                      if all(p for s, p in pays.items() if size(s) >= d)), None)
    left = sorted(s for s, p in pays.items() if p and (threshold is None or size(s) < threshold))
    return {"min_features": threshold, "paying_left_in_bf16": left, "paying": sorted(s for s, p in pays.items() if p),
            "shapes": len(pays)}


def sizes_table(rows: list[dict], summary: list[dict], keys=None) -> str:
    """Markdown: one line per shape (out, in, layer_size, each variant's speed over BF16 per
    timing, which pay), then each threshold."""
    names = list(keys or size_keys())
    lines = ["| out (N) | in (K) | layer_size | bf16 ms | " + " | ".join(f"{n} vs bf16" for n in names) + " | pays |",
             "|---:|---:|---:|---:|" + "---:|" * len(names) + "---|"]
    for r in sorted(rows, key=lambda r: (layer_size(*r["shape"]), tuple(r["shape"]))):
        N, K = r["shape"]
        ratios = r["speedup_vs_bf16"]
        paying = ", ".join(n for n in names if ratios[n] > 1.0) or "-"
        lines.append(f"| {N} | {K} | {layer_size(N, K):.0f} | {r['bf16_ms']:.3f} | "
                     + " | ".join(f"{ratios[n]:.2f}x" for n in names) + f" | {paying} |")
    for s in summary:
        t = s["min_features"]
        rule = (f"min_features = {t}: every shape with layer_size >= {t} pays" if t is not None
                else "no threshold: some of the largest shapes do not pay")
        lines.append(f"{s['summary']}: {len(s['paying'])}/{s['shapes']} shapes pay; {rule}; "
                     f"{len(s['paying_left_in_bf16'])} paying shapes below it")
    return "\n".join(lines)


def run_section(name: str, args) -> list[dict]:
    if name == "sizes":
        return section_sizes(args.size_grid, args.size_tokens,
                             pairs=args.pairs or SIZE_PAIRS, rep=args.rep or SIZE_REP, timings=args.size_timing)
    pairs, rep = args.pairs or DEFAULT_PAIRS, args.rep or DEFAULT_REP
    if name == "linear":
        return section_linear(args.recipes, args.shapes, with_reference=not args.no_emulation, with_torchao=False,
                              pairs=pairs, rep=rep, modes_from=args.modes_from)
    if name == "torchao":  # the AdaHOP recipes again in the same rows: one BF16 baseline for all
        return section_linear(args.recipes, [SINGLE_SHAPE], with_reference=False, with_torchao=True,
                              pairs=pairs, rep=rep)
    if name == "profile":
        return [row for shape in ([SINGLE_SHAPE] if args.shapes_given == "all" else args.shapes)
                for row in section_profile(shape)]
    if name == "graph":
        return section_graph(args.recipes, args.shapes, rep=rep)
    if name == "memory":
        return section_memory(list(adahop.RECIPES))
    raise ValueError(f"unknown section {name!r}")


def parse_args(argv=None):
    p = script_parser(__doc__)
    p.add_argument("--sections", default=",".join(DEFAULT_SECTIONS),
                   help=f"comma-separated sections to run, in order, of {','.join(SECTIONS)} "
                        "(default: %(default)s)")
    p.add_argument("--recipes", default=",".join(DEFAULT_RECIPES),
                   help="comma-separated AdaHOP recipes for linear, torchao and graph, each optionally @hN: "
                        "every GEMM's Hadamard N wide (e.g. adahop_lv2@h16) (default: %(default)s)")
    p.add_argument("--shapes", default="all",
                   help=f"layers (N,K) for linear and graph (and profile, when given): {SHAPES_HELP}")
    p.add_argument("--pairs", type=int, default=None,
                   help=f"alternating BF16 / recipe timings per ratio in linear, torchao and sizes "
                        f"(default: {DEFAULT_PAIRS}; sizes {SIZE_PAIRS})")
    p.add_argument("--grads", choices=("fresh", "accumulate"), default="fresh",
                   help="x.grad and the weight's .grad dropped before each timed backward (fresh, as after "
                        "zero_grad) or kept and added to (accumulate) (default: %(default)s)")
    p.add_argument("--rep", type=int, default=None,
                   help=f"do_bench's time budget per timing, ms, in linear, torchao, graph and sizes (the "
                        f"reference emulation gets 3/5 of it) (default: {DEFAULT_REP}; sizes {SIZE_REP})")
    p.add_argument("--no-emulation", action="store_true", help="skip the reference-backend timing in linear")
    p.add_argument("--no-row-bounds", action="store_true",
                   help="hopper_fp8's e4m3 operands with the exact row maxima (two passes) instead of the "
                        "row bounds the layer takes (one pass; the library's default)")
    p.add_argument("--modes-from", default=None, metavar="MODES_JSON",
                   help="a trained run's modes.json: linear also times each distinct mode triple it holds "
                        "(what a calibrated model runs), beside --recipes")
    p.add_argument("--size-grid", default=",".join(map(str, SIZE_GRID)),
                   help="sizes: comma-separated dims; every (out_features, in_features) pair of them is timed "
                        "(default: %(default)s)")
    p.add_argument("--size-tokens", type=int, default=SIZE_TOKENS,
                   help="sizes: tokens T per GEMM (default: %(default)s, a 125M step of 64 x 512)")
    p.add_argument("--size-timing", default=",".join(SIZE_TIMINGS),
                   help="sizes: comma-separated timings, eager (launched from Python) and/or graph (replayed from "
                        "a CUDA graph) (default: %(default)s)")
    add_out_arg(p, "bench_linear")
    args = p.parse_args(argv)
    args.shapes_given = args.shapes
    args.recipes = [r for r in args.recipes.split(",") if r]
    if not args.recipes:
        p.error("--recipes takes at least one AdaHOP recipe")
    for r in args.recipes:
        try:
            name, _ = parse_recipe(r)
        except ValueError as e:
            p.error(f"--recipes takes comma-separated recipes: {e}")
        if name == "bf16":
            p.error("--recipes takes AdaHOP recipes other than bf16, which every ratio is against")
    if (args.pairs is not None and args.pairs < 1) or (args.rep is not None and args.rep < 1):
        p.error("--pairs and --rep must be >= 1")
    try:
        args.size_grid = tuple(int(d) for d in args.size_grid.split(","))
    except ValueError:
        args.size_grid = ()
    if not args.size_grid or min(args.size_grid) < 1 or args.size_tokens < 1:
        p.error("--size-grid takes comma-separated dims >= 1 (e.g. 256,1024,4096) and --size-tokens an int >= 1")
    args.size_timing = tuple(t for t in args.size_timing.split(",") if t)
    if not args.size_timing or not set(args.size_timing) <= set(SIZE_TIMINGS):
        p.error(f"--size-timing takes comma-separated timings of {','.join(SIZE_TIMINGS)}, got {args.size_timing!r}")
    if args.modes_from:
        try:
            trained_modes(args.modes_from)
        except (OSError, ValueError) as e:
            p.error(f"--modes-from: {e}")
    parse_sections_and_shapes(p, args, SECTIONS)
    return args


def main(argv=None) -> int:
    global GRADS
    args = parse_args(argv)
    env = start("bench_linear.py", argv)
    GRADS = args.grads
    if args.no_row_bounds:
        from adahop.ops.backends.hopper_fp8 import HopperFP8Backend

        HopperFP8Backend.takes_row_bounds = False  # the switch benchmarks use (ops.backends.hopper_fp8)
    env["row_bounds"] = not args.no_row_bounds
    return run_sections(args.sections, lambda name: run_section(name, args), Results(args.out, "bench_linear", env))


if __name__ == "__main__":
    sys.exit(main())
