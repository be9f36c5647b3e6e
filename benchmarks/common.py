"""What the benchmark scripts share: the environment header, timing, the test operands, and the
results file.

- ``environment()``: GPU, CUDA, torch, triton, adahop, git commit, date, command. Every script
  prints it first (``print_environment``) and every row it writes carries it.
- ``bench(fn)``: ``triton.testing.do_bench`` median (ms) after its warm-up.
- ``paired_speedup(base_fn, fn, pairs)``: the baseline and the variant timed alternately
  ``pairs`` times, the ratio of the two medians (a baseline timed once moves every ratio with
  its own drift).
- ``activation(shape)``: random operands with channel outliers, as activations have (never
  zeros: a GEMM on zeros runs faster than on data).
- ``Results``: appends one JSON line per row to a file (default ``runs/bench/<script>.jsonl``),
  each with the environment, so rows from several machines and days can sit in one file.
- ``require_cuda``: the one-line refusal of the GPU-only scripts on a machine without CUDA.

``DEVICE`` is where the operands are made ("cuda"); the CPU smoke tests set it to "cpu" and run
the sections at tiny sizes under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

import torch

import adahop

DEVICE = "cuda"
LLAMA_SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336), (6144, 4096)]  # (N, K) of Llama-3-8B's layers
T = 16384  # tokens per GEMM: 16 sequences of 1024, or 32 of 512
REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT_DIR = Path("runs") / "bench"


# ---- environment ----------------------------------------------------------------------------------
def git_commit() -> str | None:
    """``$ADAHOP_COMMIT`` when set (a copy of the tree whose .git is absent or lags its files),
    else the checkout's commit (``+dirty`` when tracked files differ from it), else None."""
    if os.environ.get("ADAHOP_COMMIT"):
        return os.environ["ADAHOP_COMMIT"]
    try:
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        if head.returncode == 0:
            dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                                   capture_output=True, text=True, timeout=10)
            return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return None


def environment(script: str, argv: list[str] | None = None) -> dict:
    """Where and with what a benchmark ran: ``script`` (its file name) with the arguments ``argv``
    (default: this process's)."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    cuda = torch.cuda.is_available()
    args = sys.argv[1:] if argv is None else argv
    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "gpu": torch.cuda.get_device_name() if cuda else None,
        "capability": ".".join(map(str, torch.cuda.get_device_capability())) if cuda else None,
        "cuda": torch.version.cuda if cuda else None,
        "torch": torch.__version__,
        "triton": triton_version,
        "adahop": adahop.__version__,
        "commit": git_commit(),
        "python": platform.python_version(),
        "command": " ".join(shlex.quote(a) for a in ["python", f"benchmarks/{script}", *args]),
    }
    return env


def environment_line(env: dict) -> str:
    """``environment()`` in one line (for stdout and Markdown reports)."""
    gpu = f"{env['gpu']} (sm {env['capability']}, CUDA {env['cuda']})" if env["gpu"] else "no GPU (CPU)"
    return (f"{gpu}; torch {env['torch']}, triton {env['triton']}, adahop {env['adahop']}, "
            f"commit {env['commit'] or 'unknown'}; {env['date']}")


def print_environment(env: dict) -> None:
    print(environment_line(env), flush=True)


def pretrained_corpus(p: argparse.ArgumentParser, init: str, corpus_dir: str):
    """The corpus of a script that reads the pretrained model ``init`` (``--init``: smollm2, a
    .gguf file or a Hugging Face Llama folder), both checked: a bad one is a one-line error
    through ``p``."""
    from adahop.data.corpus import load_corpus
    from adahop.llama.pretrained import check_init

    try:
        check_init(init)
        if init == "scratch":
            raise ValueError("--init scratch has no pretrained weights: give smollm2, a .gguf file or a Hugging Face "
                             "Llama folder")
        return load_corpus(corpus_dir)
    except (ValueError, OSError) as e:
        p.error(str(e))


def load_pretrained(p: argparse.ArgumentParser, init: str, corpus, max_seq_len: int):
    """The pretrained model ``init`` names (float32, on the CPU), whose vocabulary must be the
    corpus's: a mismatch is a one-line error through ``p``."""
    from adahop.llama.pretrained import load_init

    model = load_init(init, max_seq_len=max_seq_len)
    vocab = model.tok_embeddings.num_embeddings
    if vocab != corpus.vocab_size:
        p.error(f"the corpus's vocabulary ({corpus.vocab_size}) is not the model's ({vocab}): build the corpus with "
                "the model's tokenizer (adahop data --tokenizer ...)")
    return model


def add_heldout_args(p: argparse.ArgumentParser, out_help: str) -> None:
    """The arguments of a script that runs a pretrained model over held-out batches of each of
    its corpus's sources (``heldout_setup``)."""
    p.add_argument("--init", default="smollm2", help="smollm2, a .gguf file or a Hugging Face Llama folder")
    p.add_argument("--corpus", required=True, help="a corpus built with the model's tokenizer")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per window (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=2, help="windows per batch (default: %(default)s)")
    p.add_argument("--batches", type=int, default=1, help="held-out batches of each source (default: %(default)s)")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    p.add_argument("--out", default=None, help=out_help)


def heldout_setup(p: argparse.ArgumentParser, args, script: str, argv: list[str] | None):
    """``(model, env, batches)`` of ``add_heldout_args``'s arguments: the pretrained model, the
    environment (printed) and the first ``--batches`` held-out batches of each source. Bad
    arguments are one-line errors through ``p``."""
    import itertools

    from adahop.data.corpus import TokenBatches

    for name in ("seq_len", "batch_size", "batches"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    corpus = pretrained_corpus(p, args.init, args.corpus)
    model = load_pretrained(p, args.init, corpus, args.seq_len)
    env = environment(script, sys.argv[1:] if argv is None else argv)
    print_environment(env)
    batches = [x for s in corpus.sources for x, _ in itertools.islice(
        TokenBatches(corpus, "val", batch_size=args.batch_size, seq_len=args.seq_len, sources=[s]), args.batches)]
    return model, env, batches


def sqnr_db(ref: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio of ``approx`` against ``ref``, in dB, in float64 (inf
    where they are equal)."""
    err = (approx.double() - ref.double()).pow(2).sum().item()
    return math.inf if err == 0 else 10 * math.log10(ref.double().pow(2).sum().item() / err)


def require_cuda(script: str) -> None:
    """Exit with status 2 and one line on stderr when there is no CUDA GPU."""
    if not torch.cuda.is_available():
        print(f"{script}: needs a CUDA GPU (torch.cuda.is_available() is False on this machine)", file=sys.stderr)
        raise SystemExit(2)


# ---- timing -------------------------------------------------------------------------------------------
def bench(fn, rep: int = 100) -> float:
    """Median time of ``fn()`` in ms: ``do_bench`` runs it for about 25 ms of warm-up, then for
    ``rep`` ms, and flushes the L2 cache before each call."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=rep, return_mode="median")


def paired_speedup(base_fn, fn, pairs: int, rep: int = 100) -> tuple[float, list[float], list[float]]:
    """The baseline's time over ``fn``'s, from ``pairs`` alternating timings of the two, as the
    ratio of the two medians; with every timing, for the record. (The H200's BF16 time for one
    layer moved by up to 17% between runs of one day, 7.78-9.07 ms at (14336, 4096): one BF16
    timing per shape moved every ratio with it.)"""
    t_base, t = [], []
    for _ in range(pairs):
        t_base.append(bench(base_fn, rep=rep))
        t.append(bench(fn, rep=rep))
    return statistics.median(t_base) / statistics.median(t), t_base, t


# ---- operands and comparisons ---------------------------------------------------------------------------
def activation(shape, dtype=torch.bfloat16, seed=0) -> torch.Tensor:
    """N(0, 1) on ``DEVICE`` with the first 8 columns 30x larger (channel outliers)."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(shape, generator=g, device=DEVICE)
    x[:, :8] *= 30
    return x.to(dtype)


def same_bits(a: dict, b: dict) -> bool:
    """Two outputs of the quantize kernels (``quantize_operand_triton``'s dicts) are bit-identical:
    the e4m3 bytes and row scales, and the packed codes and scale bytes, whichever are there."""
    same = True
    if "e4m3" in a:
        same &= torch.equal(a["e4m3"].view(torch.uint8), b["e4m3"].view(torch.uint8)) and \
            torch.equal(a["row_scale"], b["row_scale"])
    if "mx" in a:
        same &= torch.equal(a["mx"].codes, b["mx"].codes) and torch.equal(a["mx"].scale_e8m0, b["mx"].scale_e8m0)
    return bool(same)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


# ---- arguments and results -----------------------------------------------------------------------------
SHAPES_HELP = ("'all' (Llama-3-8B's four: " + "/".join(f"{n},{k}" for n, k in LLAMA_SHAPES)
               + ") or N,K pairs joined by '/'")


def script_parser(doc: str) -> argparse.ArgumentParser:
    """A script's parser: the first paragraph of its docstring as the description, the rest as
    the epilog (printed as written)."""
    parts = doc.split("\n\n")
    return argparse.ArgumentParser(description=parts[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                   epilog="\n\n".join(parts[1:]))


def add_out_arg(p: argparse.ArgumentParser, script: str) -> None:
    p.add_argument("--out", default=str(default_out(script)),
                   help="JSONL file the rows are appended to (default: %(default)s)")


def parse_sections_and_shapes(p: argparse.ArgumentParser, args, known: tuple[str, ...]) -> None:
    """``args.sections`` (and ``args.shapes``, where the script has it) parsed in place; a bad
    value is the parser's one-line error."""
    try:
        args.sections = parse_sections(args.sections, known)
        if hasattr(args, "shapes"):
            args.shapes = parse_shapes(args.shapes)
    except ValueError as e:
        p.error(str(e))


def start(script: str, argv: list[str] | None) -> dict:
    """A GPU script's start: refuse without CUDA, then print and return the environment."""
    require_cuda(script)
    env = environment(script, argv)
    print_environment(env)
    return env


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """'all' (``LLAMA_SHAPES``) or shapes 'N,K' joined by '/'."""
    if text == "all":
        return list(LLAMA_SHAPES)
    try:
        shapes = [tuple(int(v) for v in part.split(",")) for part in text.split("/")]
    except ValueError:
        shapes = []
    if not shapes or any(len(s) != 2 or min(s) < 1 for s in shapes):
        raise ValueError(f"--shapes takes 'all' or N,K pairs joined by '/' (e.g. 14336,4096/4096,4096), got {text!r}")
    return shapes


def parse_sections(text: str, known: tuple[str, ...]) -> list[str]:
    sections = [s for s in text.split(",") if s]
    unknown = [s for s in sections if s not in known]
    if unknown or not sections:
        raise ValueError(f"--sections takes a comma-separated subset of {','.join(known)}, got {text!r}")
    return sections


def default_out(script: str) -> Path:
    return DEFAULT_OUT_DIR / f"{script}.jsonl"


class Results:
    """Rows appended to a JSONL file, each ``{"benchmark", "section", <the row>, "env"}``."""

    def __init__(self, path: str | os.PathLike, benchmark: str, env: dict):
        self.path, self.benchmark, self.env = Path(path), benchmark, env
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, section: str, rows: list[dict]) -> None:
        with self.path.open("a") as f:
            for row in rows:
                f.write(json.dumps({"benchmark": self.benchmark, "section": section, **row, "env": self.env},
                                   default=str) + "\n")


def run_sections(sections: list[str], run, results: Results) -> int:
    """``run(name)`` returns a section's rows; each section's rows are written when it ends. A
    section that raises is reported (traceback printed, an ``error`` row written) and the others
    still run. Returns 1 if any section failed, else 0."""
    import time
    import traceback

    failed = False
    for name in sections:
        t0 = time.perf_counter()
        try:
            rows = run(name)
        except Exception:
            failed = True
            error = traceback.format_exc()
            print(error, file=sys.stderr, flush=True)
            rows = [{"error": error}]
        results.write(name, rows)
        print(f"[{name}] {time.perf_counter() - t0:.0f} s, {len(rows)} rows -> {results.path}", flush=True)
    return 1 if failed else 0
