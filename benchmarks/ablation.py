"""Where does an MXFP4 recipe's loss gap come from, and what closes it? Train the same model
under variants that each change one thing (a GEMM kept in BF16, the rounding, the scale mode, one
weight for the forward and dgrad, a BF16 phase, oscillation dampening, the policy) and compare
held-out losses with bf16 and naive mxfp4, paired by seed.

    python benchmarks/ablation.py --corpus runs/corpus --out runs/ablation --preset cpu \\
        --variants bf16 mxfp4 lv2 lv2_one_weight --seeds 0 1 2 --jobs 2
    python benchmarks/ablation.py --corpus runs/corpus --out runs/ablation --report

Each (variant, seed) is one training run in ``<out>/<variant>-s<seed>``; a finished one (its
``ablation.json`` written) is not run again. ``--runs lv2:1,2 measured_c10:0`` names the pairs
to make when they are not every ``--variants`` x ``--seeds`` pair. ``--jobs N`` runs N of them at
once, each in its own process (its output in ``<out>/logs/``): on a GPU several small runs share
it better than one does. On a GPU machine use a GPU preset (``--preset h200_125m``, ``--threads 0``).

The report (``ablation.md``, also ``--report``) pairs every gap by seed (a seed fixes the
initialisation and the data order, which move the loss far more than the numerics do): gap =
variant(seed) - bf16(seed), and the difference to naive mxfp4 the same way; mean and spread (the
sample standard deviation over seeds) of each. It refuses runs that differ in anything but the
variant and the seed (preset, steps, data, batch, compile, ...), and lists each run's machine,
share of linear-layer FLOPs in MXFP4, speed and memory.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from common import environment, environment_line, print_environment

import adahop
from adahop.llama.model import SIZES
from adahop.policy import GEMMS, table_policy
from adahop.schedule import NO_SCHEDULE
from adahop.train.recipes import PRESETS
from adahop.train.trainer import COMPILE_CHOICES


@dataclasses.dataclass(frozen=True)
class Variant:
    """A recipe (its numerics, an ``AdaHOPConfig``, and its precision schedule: ``adahop.recipes``)
    and the other TrainConfig fields it sets (oscillation dampening, drift, calibration
    micro-batches); ``what``: one line for the report."""

    numerics: Callable[[], adahop.AdaHOPConfig]
    what: str
    train: tuple = ()  # (field, value) pairs
    # The variant's own calibration length; None: the preset's (which scales with the model).
    calibration_steps: int | None = None
    schedule: adahop.PrecisionSchedule = NO_SCHEDULE  # a BF16 phase, BF16 blocks

    @property
    def train_fields(self) -> dict:
        s = self.schedule
        return {"bf16_phase_start": s.bf16_phase_start, "bf16_phase_gemms": s.bf16_phase_gemms,
                "bf16_blocks": s.bf16_blocks, **dict(self.train)}


def _recipe(name: str, **changes) -> Callable[[], adahop.AdaHOPConfig]:
    """The numerics of the library's recipe ``name`` (``adahop.recipe``)."""
    return lambda: adahop.recipe(name, **changes).config


def _lv2_forcing(**forced):
    """adahop_lv2 whose policy output is overridden for some GEMMs (e.g. dgrad="bf16")."""

    def policy(summary):
        modes = table_policy(summary, "lv2")
        modes.update(forced)
        return modes

    return _recipe("adahop_lv2", policy_fn=policy)


def _settings(recipe: str, grad_rne: bool = False, **changes):
    """``recipe`` with GemmConfig fields changed in all three GEMMs (``grad_rne``: the backward's
    gradient rounded to nearest instead of stochastically)."""

    def make():
        cfg = adahop.recipe(recipe).config.with_gemm_settings(**changes)
        if grad_rne:
            cfg = cfg.replace(dgrad=dataclasses.replace(cfg.dgrad, a_rounding="rne"),
                              wgrad=dataclasses.replace(cfg.wgrad, a_rounding="rne"))
        return cfg

    return make


_LV2 = _recipe("adahop_lv2")
_ONE_W = _recipe("adahop_lv2", dgrad_weight="forward")
# adahop train's default recipe, adahop_lv2_tail: the forward in BF16 for the last 18% of the steps
_FPROP_TAIL = adahop.recipe("adahop_lv2_tail").schedule

VARIANTS: dict[str, Variant] = {
    "bf16": Variant(_recipe("bf16"), "every GEMM in BF16 (the baseline)"),
    "mxfp4": Variant(_recipe("mxfp4"), "naive MXFP4, no transform"),
    "mxfp4_iht": Variant(_recipe("mxfp4_iht"), "IHT on every GEMM"),
    "lv2": Variant(_LV2, "adahop_lv2"),
    "lv1": Variant(_recipe("adahop_lv1"), "adahop_lv1"),
    "measured": Variant(_recipe("adahop_measured"), "the measured policy (adahop_measured), 8% FLOP budget"),
    "loss_aware": Variant(_recipe("adahop_loss_aware"), "the loss-aware policy (adahop_loss_aware): one knapsack "
                          "over the model's GEMMs by predicted loss, 3% FLOP budget"),
    # An adaptive recipe inside 90% MXFP4 over a 125M run: its BF16 calibration steps and OE slices
    # are what keeps the measured policy at 88% (the lm_head, in BF16 in every recipe, costs 7.7%).
    "measured_b2_c10": Variant(_recipe("adahop_measured", hp_budget=0.02), "the measured policy, 2% FLOP budget, "
                               "10 calibration steps", calibration_steps=10),
    # its two changes apart: the shorter calibration alone (the measured policy's 8% budget)
    "measured_c10": Variant(_recipe("adahop_measured"), "the measured policy, 10 calibration steps",
                            calibration_steps=10),
    # calibration in IHT + MXFP4 instead of BF16: no BF16 activations kept (the memory peak)
    "lv2_calib_iht": Variant(_recipe("adahop_lv2", calibration_gemms="iht"), "lv2, calibration steps in IHT + MXFP4"),
    # the same BF16 calibration, its steps as 4 micro-batches each (a quarter of the activations)
    "lv2_calib_mb4": Variant(_LV2, "lv2, each calibration step run as 4 micro-batches (one observation each step)",
                             (("calibration_micro_batches", 4),)),
    # one GEMM (or two) kept in BF16: where the gap comes from
    "lv2_fprop_bf16": Variant(_lv2_forcing(fprop="bf16"), "lv2, fprop in BF16 (only the backward in MXFP4)"),
    "lv2_dgrad_bf16": Variant(_lv2_forcing(dgrad="bf16"), "lv2, dgrad in BF16"),
    "lv2_wgrad_bf16": Variant(_lv2_forcing(wgrad="bf16"), "lv2, wgrad in BF16"),
    "lv2_bwd_bf16": Variant(_lv2_forcing(dgrad="bf16", wgrad="bf16"), "lv2, only the forward in MXFP4"),
    # The calibration sees the untrained network and gives fprop plain IHT in every layer (125M:
    # 84 of 84), so OE never reaches the forward GEMM: does forcing it there help?
    "lv2_fprop_oe_left": Variant(_lv2_forcing(fprop="iht+oe_left"), "lv2, fprop OE on the k largest tokens of x"),
    "lv2_fprop_oe_right": Variant(_lv2_forcing(fprop="iht+oe_right"), "lv2, fprop OE on the k largest rows of w"),
    "lv2_signs_fprop_oe_right": Variant(
        lambda: _lv2_forcing(fprop="iht+oe_right")().with_gemm_settings(random_signs=True),
        "lv2, fprop OE-right, random-sign Hadamard"),
    # rounding and scales
    "lv2_grad_rne": Variant(_settings("adahop_lv2", grad_rne=True), "lv2, gradients rounded to nearest, not SR"),
    "measured_grad_rne": Variant(_settings("adahop_measured", grad_rne=True),
                                 "the measured policy, gradients rounded to nearest, not SR"),
    "lv2_rceil": Variant(_settings("adahop_lv2", scale_mode="rceil"), "lv2, scales that never clip (rceil)"),
    "lv2_floor": Variant(_settings("adahop_lv2", scale_mode="floor"), "lv2, the OCP scale (clips up to 1.75x)"),
    "lv2_grad_rne_rceil": Variant(_settings("adahop_lv2", grad_rne=True, scale_mode="rceil"), "lv2, RNE + rceil"),
    "lv2_h128": Variant(_settings("adahop_lv2", hadamard_size=128), "lv2, a 128-wide Hadamard in every GEMM"),
    # a 16-wide Hadamard: two groups per MX block; it lowered pretrained SmolLM2's forward cost on
    # every source before training, by less than the draw of random signs moves that cost
    # (benchmarks/pretrained_forward.py --hadamard-size 16; docs/results.md, 'The outlier study')
    "lv2_h16": Variant(_settings("adahop_lv2", hadamard_size=16), "lv2, a 16-wide Hadamard in every GEMM"),
    "mxfp4_iht_h16": Variant(_settings("mxfp4_iht", hadamard_size=16), "IHT on every GEMM, 16 wide"),
    "lv2_signs": Variant(_settings("adahop_lv2", random_signs=True), "lv2, random-sign Hadamard (Tseng et al.)"),
    "lv2_signs_grad_rne": Variant(_settings("adahop_lv2", grad_rne=True, random_signs=True), "lv2, signs + RNE"),
    # one weight for the forward and dgrad (AdaHOPConfig.dgrad_weight, docs/method.md)
    "mxfp4_one_weight": Variant(_recipe("mxfp4", dgrad_weight="forward"),
                                "naive MXFP4, W tile-quantized once for fprop and dgrad"),
    "lv2_one_weight": Variant(_ONE_W, "lv2, dgrad multiplies by the forward's quantized weight"),
    # attention's value projections' forward without the Hadamard (AdaHOPConfig.value_fprop):
    # their weight's error, shared by every token, survives attention's mean over tokens
    "lv2_v_mxfp4": Variant(_recipe("adahop_lv2", value_fprop="mxfp4"), "lv2, V projections' fprop in naive MXFP4"),
    "measured_v_mxfp4": Variant(_recipe("adahop_measured", value_fprop="mxfp4"),
                                "the measured policy, V projections' fprop in naive MXFP4"),
    "mxfp4_iht_v_mxfp4": Variant(_recipe("mxfp4_iht", value_fprop="mxfp4"),
                                 "IHT on every GEMM but the V projections' fprop (naive MXFP4)"),
    # the activation's mean over tokens out of the forward's MXFP4 operand, added back as a BF16
    # GEMV (AdaHOPConfig.fprop_mean_bias, adahop.mean_bias; arXiv 2603.10444)
    "lv2_mean_bias": Variant(_recipe("adahop_lv2", fprop_mean_bias=True), "lv2, fprop with x's mean split off"),
    "mxfp4_iht_mean_bias": Variant(_recipe("mxfp4_iht", fprop_mean_bias=True),
                                   "IHT on every GEMM, fprop with x's mean split off"),
    "lv2_tail_mean_bias": Variant(_recipe("adahop_lv2_tail", fprop_mean_bias=True),
                                  "lv2 + fprop BF16 tail, fprop with x's mean split off", schedule=_FPROP_TAIL),
    # the forward's MXFP4 product scaled back by the rows' unbiasing factors (AdaHOPConfig.fprop_unbias)
    "mxfp4_unbias": Variant(_recipe("mxfp4", fprop_unbias=True), "naive MXFP4, fprop's shrink toward zero undone"),
    # A BF16 phase (a precision schedule's bf16_phase_start / _gemms, adahop.schedule): the last
    # fraction of the steps runs the listed GEMMs in BF16 (the higher-precision final phase of
    # Chmiel et al., "FP4 All the Way", 2025; NVIDIA's NVFP4 recipe switches the forward alone).
    "lv2_bf16_tail": Variant(_LV2, "lv2, the last 10% of the steps in BF16",
                             schedule=adahop.PrecisionSchedule(bf16_phase_start=0.9, bf16_phase_gemms=GEMMS)),
    "lv2_bf16_tail25": Variant(_LV2, "lv2, the last 25% in BF16",
                               schedule=adahop.PrecisionSchedule(bf16_phase_start=0.75, bf16_phase_gemms=GEMMS)),
    "lv2_bf16_fprop_tail": Variant(_recipe("adahop_lv2_tail"), "lv2, fprop in BF16 for the last 18%",
                                   schedule=_FPROP_TAIL),
    "lv2_one_weight_fprop_tail": Variant(_ONE_W, "lv2 + one weight, fprop in BF16 for the last 18%",
                                         schedule=_FPROP_TAIL),
    "measured_fprop_tail": Variant(_recipe("adahop_measured"), "the measured policy, fprop in BF16 for the last 18%",
                                   schedule=_FPROP_TAIL),
    # The longest forward-only BF16 tail that keeps a naive-MXFP4 run >= 90% MXFP4: at 125M the
    # lm_head leaves 92.3% of the linear FLOPs to convert, and a tail f on one GEMM of three
    # takes f/3 of that (92.3% * (1 - 0.07 / 3) = 90.2%).
    "mxfp4_fprop_tail7": Variant(_recipe("mxfp4"), "naive MXFP4, fprop in BF16 for the last 7%",
                                 schedule=adahop.PrecisionSchedule(bf16_phase_start=0.93, bf16_phase_gemms=("fprop",))),
    # the first and last blocks' linears in BF16 (a precision schedule's bf16_blocks): on pretrained
    # SmolLM2 they carry a quarter of the MXFP4 forward's cost (benchmarks/pretrained_forward.py)
    "lv2_bf16_ends": Variant(_LV2, "lv2, the first and last blocks in BF16",
                             schedule=adahop.PrecisionSchedule(bf16_blocks=(1, 1))),
    "measured_bf16_ends": Variant(_recipe("adahop_measured"), "the measured policy, the first and last blocks in BF16",
                                  schedule=adahop.PrecisionSchedule(bf16_blocks=(1, 1))),
    # weight-oscillation dampening (adahop/oscillation.py)
    "lv2_damp1e-3": Variant(_LV2, "lv2, oscillation dampening lambda 1e-3", (("oscillation_dampening", 1e-3),)),
    "lv2_damp1e-2": Variant(_LV2, "lv2, oscillation dampening lambda 1e-2", (("oscillation_dampening", 1e-2),)),
    # re-deciding the modes on the trained network (the drift monitor at each evaluation)
    "lv2_redecide": Variant(_LV2, "lv2, modes re-decided at every evaluation (drift 'apply')",
                            (("drift", "apply"),)),
}
# TrainConfig fields a variant may set; every other field must agree between compared runs.
# (calibration_micro_batches acts only on the variants that calibrate.)
VARIANT_FIELDS = ("recipe", "adahop", "bf16_phase_start", "bf16_phase_gemms", "oscillation_dampening", "drift",
                  "calibration_micro_batches", "bf16_blocks")
# (corpus_dir is where the corpus lies on the machine that ran it; which corpus it is, its
# corpus_id, is compared apart.)
PER_RUN_FIELDS = ("out_dir", "corpus_dir", "seed", "progress", "extra")


def variant_config(name: str, base: adahop.AdaHOPConfig, seed: int) -> adahop.AdaHOPConfig:
    """Variant ``name``'s numerics with the preset's calibration length (unless the variant sets
    its own), backend and OE k per GEMM (they scale with the model), and the SR seed ``seed``."""
    variant = VARIANTS[name]
    steps = variant.calibration_steps or base.calibration_steps
    q = variant.numerics().replace(calibration_steps=steps, backend=base.backend, seed=seed)
    return q.replace(**{g: dataclasses.replace(q.gemm(g), oe_k=base.gemm(g).oe_k) for g in GEMMS})


def run_config(args, name: str, seed: int):
    from adahop.train.recipes import preset

    out = Path(args.out) / f"{name}-s{seed}"
    overrides = dict(seed=seed, out_dir=str(out), corpus_dir=args.corpus, steps=args.steps, lr=args.lr,
                     model_size=args.model_size, progress=False, compile=args.compile,
                     cudagraphs=args.cudagraphs or None)
    # the preset's AdaHOP settings that scale with the model (calibration length, backend, OE k);
    # the variant brings its own numerics and schedule
    base = preset(args.preset, recipe="adahop_lv2", **overrides).adahop
    numerics = variant_config(name, base, seed)
    if args.drift_measure and numerics.adaptive:
        overrides["drift"] = "measure"  # logged only: the trajectory is the same (adahop.drift)
    overrides.update(VARIANTS[name].train_fields)
    return preset(args.preset, adahop=numerics, **overrides)


def comparable_settings(cfg) -> dict:
    """The settings every compared run must share: the TrainConfig but for the variant's fields
    and the run's own (its folder, its seed)."""
    d = cfg.to_dict()
    return {k: v for k, v in d.items() if k not in VARIANT_FIELDS + PER_RUN_FIELDS}


class FlopShareMeter:
    """The run's share of linear-layer FLOPs in MXFP4, step by step (``on_step`` of ``train``):
    each step counts with the modes it ran (a layer that was calibrating when the step began
    counts as calibrating; a BF16 phase or a drift switch counts from the step after it)."""

    def __init__(self, tokens: int):
        self.tokens, self.shares, self.calibrating = tokens, [], None

    def __call__(self, step: int, model) -> None:
        from adahop.train.precision import mxfp4_flop_share

        layers = adahop.adahop_layers(model)
        if self.calibrating is None:  # the first step: the adaptive layers began it calibrating
            self.calibrating = {n for n, m in layers.items() if m.config.adaptive}
        self.shares.append(mxfp4_flop_share(model, self.tokens, calibrating=self.calibrating))
        self.calibrating = {n for n, m in layers.items() if m.calibrating}

    @property
    def share(self) -> float:
        return sum(self.shares) / len(self.shares) if self.shares else 0.0


def run_one(args, name: str, seed: int, env: dict) -> None:
    import torch

    from adahop.data.corpus import load_corpus
    from adahop.train.run import eval_fn_of, heldout_eval, open_run
    from adahop.train.run_log import read_log
    from adahop.train.trainer import train

    cfg = run_config(args, name, seed)
    out = Path(cfg.out_dir)
    corpus = load_corpus(cfg.corpus_dir)
    model, batches = open_run(cfg, corpus)
    eval_fn = eval_fn_of(cfg, corpus)
    meter = FlopShareMeter(cfg.batch_size * cfg.seq_len)
    summary = train(cfg, model=model, train_batches=batches, eval_fn=eval_fn, on_step=meter)
    if summary.get("already_finished"):
        raise SystemExit(f"{out} holds a finished run without its ablation.json: remove it to run it again")
    drift = [{"step": r["step"], **{k: v for k, v in (r.get("eval") or r.get("final_eval"))["drift"].items()
                                   if k != "changed"}}
             for r in read_log(out) if "drift" in (r.get("eval") or r.get("final_eval") or {})]
    result = {"variant": name, "seed": seed, "what": VARIANTS[name].what, "steps": summary["steps"],
              "heldout_loss": summary["final_eval"]["loss"], "last_train_losses": summary["losses"][-50:],
              "tokens_per_s": summary["tokens_per_s"], "peak_memory_bytes": summary["peak_memory_bytes"],
              "mxfp4_flop_share": meter.share, "settings": comparable_settings(cfg), "corpus_id": corpus.corpus_id,
              "drift": drift, "env": env}
    # The same weights evaluated with every GEMM in BF16: how much of the gap is the MXFP4
    # forward at evaluation time, and how much is in the trained weights.
    for layer in adahop.adahop_layers(model).values():
        layer.set_modes({gemm: "bf16" for gemm in GEMMS})
    with torch.compiler.set_stance("force_eager"):  # new modes: no recompilation for one evaluation
        result["heldout_loss_bf16_eval"] = heldout_eval(model, corpus, seq_len=cfg.seq_len, batch_size=cfg.batch_size,
                                                        max_batches=cfg.eval_batches)["loss"]
    (out / "ablation.json").write_text(json.dumps(result, indent=1))
    print(f"[{name} seed {seed}] held-out {result['heldout_loss']:.4f}, BF16 evaluation "
          f"{result['heldout_loss_bf16_eval']:.4f}, MXFP4 share {meter.share:.1%}", flush=True)


# ---- the report --------------------------------------------------------------------------------------
def _mean_spread(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:+.4f}"
    return f"{statistics.mean(values):+.4f} ± {statistics.stdev(values):.4f}"


def _with_defaults(settings: dict | None) -> dict | None:
    """``settings`` with the TrainConfig fields it lacks at their defaults (a field added to
    TrainConfig after a run was made gets a default that does what the code did before it), and
    without the per-run fields an older run recorded."""
    from adahop.train.trainer import TrainConfig

    if settings is None:
        return None
    return {k: v for k, v in {**comparable_settings(TrainConfig()), **settings}.items()
            if k not in VARIANT_FIELDS + PER_RUN_FIELDS}


def check_comparable(runs: list[dict]) -> None:
    """Stop when two runs differ in a setting that is not the variant's or the seed's."""
    ref = None
    for r in runs:
        key = (_with_defaults(r.get("settings")), r.get("corpus_id"))
        if ref is None:
            ref = (key, r)
            continue
        if key != ref[0]:
            a, b = ref[1], r
            sa, sb = _with_defaults(a.get("settings")) or {}, _with_defaults(b.get("settings")) or {}
            fields = sorted(k for k in set(sa) | set(sb) if sa.get(k) != sb.get(k))
            if a.get("corpus_id") != b.get("corpus_id"):
                fields.append("corpus")
            raise SystemExit(f"runs {a['variant']}-s{a['seed']} and {b['variant']}-s{b['seed']} are not comparable: "
                             f"they differ in {', '.join(fields) or 'settings recorded by one only'}")


def report(out: Path) -> str:
    runs = [json.loads(p.read_text()) for p in sorted(out.glob("*/ablation.json"))]
    check_comparable(runs)
    loss = {(r["variant"], r["seed"]): r["heldout_loss"] for r in runs}
    base = {seed: v for (name, seed), v in loss.items() if name == "bf16"}
    if not base:
        raise SystemExit("no finished bf16 run to compare with")
    naive = {seed: v for (name, seed), v in loss.items() if name == "mxfp4"}
    share = {(r["variant"], r["seed"]): r.get("mxfp4_flop_share") for r in runs}
    lines = ["Held-out loss gap to bf16, paired by seed (mean ± sample standard deviation over seeds):", "",
             "| variant | seeds | gap to bf16 | minus mxfp4 (paired) | gap per seed | held-out loss per seed "
             "| MXFP4 share of linear FLOPs |",
             "|---|---|---|---|---|---|---|"]
    names = list(VARIANTS) + sorted({r["variant"] for r in runs} - set(VARIANTS))
    for name in names:
        seeds = sorted(seed for (v, seed) in loss if v == name and seed in base)
        if not seeds:
            continue
        gaps = [loss[name, s] - base[s] for s in seeds]
        paired = [loss[name, s] - naive[s] for s in seeds if s in naive]
        vs_naive = _mean_spread(paired) + (f" ({len(paired)})" if len(paired) != len(seeds) else "") \
            if paired and name != "mxfp4" else "-"
        per_seed = ", ".join(f"s{s}: {g:+.4f}" for s, g in zip(seeds, gaps))
        losses = ", ".join(f"{loss[name, s]:.4f}" for s in seeds)
        shares = [share[name, s] for s in seeds if share.get((name, s)) is not None]
        share_txt = f"{statistics.mean(shares):.1%}" if shares else "-"
        lines.append(f"| {name} | {len(seeds)} | {_mean_spread(gaps)} | {vs_naive} | {per_seed} | {losses} "
                     f"| {share_txt} |")
    table = "\n".join(lines) + "\n"
    # The runs that also evaluated their weights with BF16 GEMMs.
    bf16_eval = {(r["variant"], r["seed"]): r["heldout_loss_bf16_eval"] for r in runs if "heldout_loss_bf16_eval" in r}
    if bf16_eval:
        lines = ["", "Held-out loss with every GEMM in BF16 at evaluation (the same trained weights), gap to the "
                 "bf16 run:", "",
                 "| variant | seeds | gap, MXFP4 evaluation | gap, BF16 evaluation | BF16-evaluation gap per seed |",
                 "|---|---|---|---|---|"]
        for name in names:
            seeds = sorted(seed for (v, seed) in bf16_eval if v == name and seed in base)
            if not seeds or name == "bf16":
                continue
            gaps = [bf16_eval[name, s] - base[s] for s in seeds]
            mx = [loss[name, s] - base[s] for s in seeds]
            per_seed = ", ".join(f"s{s}: {g:+.4f}" for s, g in zip(seeds, gaps))
            lines.append(f"| {name} | {len(seeds)} | {_mean_spread(mx)} | {_mean_spread(gaps)} | {per_seed} |")
        table += "\n".join(lines) + "\n"
    drifted = [r for r in runs if r.get("drift")]
    if drifted:
        lines = ["", "Drift of the calibrated layers (adahop.drift at each evaluation; labels: 3 tensors per "
                 "layer, modes: 3 GEMMs per layer):", "",
                 "| run | step: label changes / mode changes (of layers) |", "|---|---|"]
        for r in drifted:
            cells = ", ".join(f"{d['step']}: {d['label_changes']} / {d['mode_changes']} ({d['layers']})"
                              for d in r["drift"])
            lines.append(f"| {r['variant']}-s{r['seed']} | {cells} |")
        table += "\n".join(lines) + "\n"
    lines = ["", "| run | tokens/s | peak memory (GiB) |", "|---|---|---|"]
    for r in runs:
        mem = r.get("peak_memory_bytes")
        lines.append(f"| {r['variant']}-s{r['seed']} | {r['tokens_per_s'] or 0:,.0f} | "
                     f"{mem / 2**30:.2f} |" if mem else f"| {r['variant']}-s{r['seed']} | "
                     f"{r['tokens_per_s'] or 0:,.0f} | - |")
    table += "\n".join(lines) + "\n"
    machines = sorted({environment_line(r["env"]) for r in runs if "env" in r})
    if machines:
        table += "\nRuns made on: " + " / ".join(machines) + "\n"
    (out / "ablation.md").write_text(table)
    return table


# ---- several runs at once --------------------------------------------------------------------------
def run_jobs(argv: list[str], pending: list[tuple[str, int]], jobs: int, out: Path) -> list[str]:
    """Run each pending (variant, seed) as its own process of this script, ``jobs`` at a time.
    Returns the runs that failed."""
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    rest = _strip(argv, ("--variants", "--seeds", "--runs", "--jobs"))
    queue, running, failed = list(pending), [], []
    while queue or running:
        while queue and len(running) < jobs:
            name, seed = queue.pop(0)
            log = (logs / f"{name}-s{seed}.log").open("w")
            cmd = [sys.executable, str(Path(__file__).resolve()), *rest, "--variants", name, "--seeds", str(seed),
                   "--jobs", "1", "--no-report"]
            running.append((name, seed, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), log))
        time.sleep(1)
        for item in list(running):
            name, seed, proc, log = item
            if proc.poll() is not None:
                log.close()
                running.remove(item)
                status = "finished" if proc.returncode == 0 else f"FAILED (exit {proc.returncode}, see {log.name})"
                print(f"[{name} seed {seed}] {status}", flush=True)
                if proc.returncode != 0:
                    failed.append(f"{name}-s{seed}")
    return failed


def _strip(argv: list[str], options: tuple[str, ...]) -> list[str]:
    """``argv`` without the listed options and their values."""
    out, skip = [], False
    for a in argv:
        if a in options:
            skip = True
            continue
        if skip and not a.startswith("--"):
            continue
        skip = False
        out.append(a)
    return out


def parse_runs(parser: argparse.ArgumentParser, items: list[str]) -> list[tuple[str, int]]:
    """``--runs`` items ``VARIANT:SEED[,SEED...]`` as (variant, seed) pairs, in order, each once."""
    runs = []
    for item in items:
        name, sep, seeds = item.partition(":")
        if name not in VARIANTS:
            parser.error(f"--runs {item!r}: unknown variant {name!r} (see --variants for the choices)")
        try:
            values = [int(v) for v in seeds.split(",")] if sep else []
        except ValueError:
            values = []
        if not values or any(v < 0 for v in values):
            parser.error(f"--runs {item!r}: write VARIANT:SEEDS, seeds as integers >= 0 separated by commas "
                         "(e.g. lv2:0,1)")
        runs += [(name, v) for v in values if (name, v) not in runs]
    return runs


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", default="runs/corpus", help="corpus folder made by adahop data (default: %(default)s)")
    p.add_argument("--out", default="runs/ablation",
                   help="folder of the runs (<variant>-s<seed>) and ablation.md (default: %(default)s)")
    p.add_argument("--preset", default="cpu", choices=list(PRESETS),
                   help="training preset; a GPU one (h200, h200_125m) on a GPU machine (default: %(default)s)")
    p.add_argument("--steps", type=int, default=None, help="training steps (default: the preset's)")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default: the preset's)")
    p.add_argument("--model-size", choices=list(SIZES), default=None,
                   help="model size (default: the preset's); a variant's winner confirmed at another size")
    p.add_argument("--variants", nargs="+", default=["bf16", "mxfp4", "lv2"], choices=list(VARIANTS),
                   help="variants to train (default: bf16 mxfp4 lv2)")
    p.add_argument("--seeds", nargs="+", type=int, default=[0],
                   help="seeds (initialisation, data order and SR draws); gaps are paired by seed (default: 0)")
    p.add_argument("--runs", nargs="+", default=None, metavar="VARIANT:SEEDS",
                   help="the runs to make, in place of every --variants x --seeds pair: e.g. "
                        "lv2_bf16_fprop_tail:1,2 measured_c10:0")
    p.add_argument("--jobs", type=int, default=1, help="runs at once, one process each (default: %(default)s)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads per run, 0 for torch's default (default: 1, fastest for small CPU runs)")
    p.add_argument("--compile", choices=COMPILE_CHOICES, default="auto",
                   help="adahop train --compile: the whole model, each block or nothing; auto: the model on a GPU "
                        "(default: %(default)s)")
    p.add_argument("--cudagraphs", action="store_true", help="replay each compiled step as CUDA graphs")
    p.add_argument("--drift-measure", action="store_true",
                   help="adaptive variants also measure drift at each evaluation (logged; same trajectory)")
    p.add_argument("--report", action="store_true", help="only write the table of the finished runs")
    p.add_argument("--no-report", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.jobs < 1:
        p.error(f"--jobs must be >= 1, got {args.jobs}")
    if args.runs and any(a.split("=")[0] in ("--variants", "--seeds") for a in argv):
        p.error("--runs names the runs in place of --variants and --seeds: give one or the other")
    runs = parse_runs(p, args.runs) if args.runs else [(n, s) for s in args.seeds for n in args.variants]
    env = environment("ablation.py", argv)
    print_environment(env)
    out = Path(args.out)
    if not args.report:
        import torch

        if args.threads:
            torch.set_num_threads(args.threads)
        pending = [(name, seed) for name, seed in runs if not (out / f"{name}-s{seed}" / "ablation.json").is_file()]
        if args.jobs > 1 and len(pending) > 1:
            failed = run_jobs(argv, pending, args.jobs, out)
            if failed:
                print(f"failed: {', '.join(failed)}", file=sys.stderr)
        else:
            failed = []
            for name, seed in pending:
                run_one(args, name, seed, env)
        if args.no_report:
            return 0
        if failed and not list(out.glob("*/ablation.json")):
            return 1
    print(report(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
