"""Systematic errors of the forward GEMM's MXFP4 operands on a pretrained model: whether round to
nearest shrinks the values toward zero (and the Hadamard makes it worse), and how much of the
activation is a mean over tokens that MXFP4 quantizes badly.

For each block linear of the model (its input X captured on held-out windows, its weight W), per
mode (naive MXFP4; IHT: a block Hadamard of 32 along K first) and per scale mode, with round to
nearest even as the forward does:

* each operand's *gain*, ``<Q(v), v> / <v, v> - 1`` (v the operand in the basis it is quantized
  in): the component of the error along the operand itself. Negative is a shrink toward zero;
  an unbiased rounding would leave it at 0 up to noise;
* each operand's *magnitude bias*, ``sum(|Q(v)| - |v|) / sum(|v|)``: the mean signed relative
  error of the magnitudes, weighted by magnitude;
* the share of the operand's blocks whose largest element is clipped (scaled above 6);
* the output's gain ``<y_q, y> / <y, y> - 1`` (y = X W^T, y_q the MXFP4 GEMM) and its SQNR;
* what an unbiasing factor would make of the output: y_q scaled by ``c_x c_w`` with
  ``c = <v, v> / <Q(v), v>`` per tensor, or per row (a token of X, an output channel of W), the
  factor that makes the error orthogonal to the operand (its gain 0);
* the activation's mean over tokens: its share of X's energy, ``T |mu|^2 / |X|^2``, and the SQNR
  of the forward with the mean taken out before quantization and added back exactly
  (``Q(X - mu) Q(W)^T + mu W^T``, ``adahop.mean_bias``).

    python benchmarks/fprop_bias.py --init smollm2 --corpus runs/corpus_smollm2 --out runs/fprop_bias.jsonl

The corpus must be built with the model's tokenizer (``adahop data --tokenizer smollm2``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from common import add_heldout_args, heldout_setup, script_parser, sqnr_db  # noqa: E402

from adahop.formats.mxfp4 import E2M1_MAX, fake_quantize_mxfp4, scale_exponent  # noqa: E402
from adahop.transforms.hadamard import block_hadamard  # noqa: E402

MODES = ("mxfp4", "iht")
SCALE_MODES = ("even", "rceil")  # the forward's (every recipe's) and the unsaturating one


def capture_linear_inputs(model, batches: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """``{name: X [tokens, K]}`` of every linear inside the model's blocks, over ``batches``."""
    captured: dict[str, list] = {}
    handles = []
    for name, mod in model.layers.named_modules():
        if isinstance(mod, torch.nn.Linear):
            def hook(module, args, name=f"layers.{name}"):
                captured.setdefault(name, []).append(args[0].detach().float().flatten(0, -2))
            handles.append(mod.register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            for inputs in batches:
                model(inputs)
    finally:
        for h in handles:
            h.remove()
    return {k: torch.cat(v) for k, v in captured.items()}


def basis(v: torch.Tensor, mode: str) -> torch.Tensor:
    return block_hadamard(v, dim=-1) if mode == "iht" else v


def operand_stats(v: torch.Tensor, q: torch.Tensor, scale_mode: str) -> dict:
    """Gain, magnitude bias and clipped-block share of ``q``, the MXFP4 values of ``v`` (the
    operand in its quantization basis, blocks of 32 along the last dim)."""
    v64, q64 = v.double(), q.double()
    blocks = v.reshape(*v.shape[:-1], -1, 32)
    amax = blocks.abs().amax(-1)
    e = scale_exponent(amax, scale_mode).double()
    clipped = (amax.double() * torch.pow(2.0, -e) > E2M1_MAX) & (amax > 0)
    e64 = q64 - v64
    return {"gain": ((q64 * v64).sum() / v64.pow(2).sum()).item() - 1,
            "db": sqnr_db(v64, q64),
            # <e, Q(v)> / <v, v>: 0 where the error is orthogonal to the rounded values (then the
            # gain is -1 / SQNR: the shrink of any rounding whose error is uncorrelated with its output)
            "err_along_q": ((e64 * q64).sum() / v64.pow(2).sum()).item(),
            "mag_bias": ((q64.abs() - v64.abs()).sum() / v64.abs().sum()).item(),
            "clipped_blocks": clipped.double().mean().item()}


def unbiasing(v: torch.Tensor, q: torch.Tensor, dim: int | None) -> torch.Tensor:
    """``<v, v> / <q, v>`` (float64) over the whole tensor (``dim`` None) or along ``dim``."""
    v64, q64 = v.double(), q.double()
    if dim is None:
        return v64.pow(2).sum() / (q64 * v64).sum()
    return v64.pow(2).sum(dim) / (q64 * v64).sum(dim)


def gain(ref: torch.Tensor, approx: torch.Tensor) -> float:
    return ((approx.double() * ref.double()).sum() / ref.double().pow(2).sum()).item() - 1


def linear_stats(x: torch.Tensor, w: torch.Tensor) -> dict:
    """One row: per mode and scale mode the operands' and the output's statistics; the mean's."""
    y = x.double() @ w.double().t()
    mu = x.mean(0, keepdim=True)
    row = {"K": x.shape[1], "N": w.shape[0], "tokens": x.shape[0],
           "mean_energy_share": (x.shape[0] * mu.double().pow(2).sum() / x.double().pow(2).sum()).item()}
    for mode in MODES:
        xv, wv = basis(x, mode), basis(w, mode)
        for sm in SCALE_MODES:
            qx, qw = fake_quantize_mxfp4(xv, dim=-1, scale_mode=sm), fake_quantize_mxfp4(wv, dim=-1, scale_mode=sm)
            yq = qx.double() @ qw.double().t()
            r = {"x": operand_stats(xv, qx, sm), "w": operand_stats(wv, qw, sm),
                 "y_gain": gain(y, yq), "y_db": sqnr_db(y, yq)}
            if sm == "even":  # the forward's scale mode: unbiasing factors; the mean taken out of X
                for per in ("tensor", "row"):
                    dims = None if per == "tensor" else -1
                    cx, cw = unbiasing(xv, qx, dims), unbiasing(wv, qw, dims)
                    yu = yq * (cx.reshape(-1, 1) if per == "row" else cx) * (cw.reshape(1, -1) if per == "row" else cw)
                    r[f"unbiased_per_{per}"] = {"y_gain": gain(y, yu), "y_db": sqnr_db(y, yu)}
                qr = fake_quantize_mxfp4(basis(x - mu, mode), dim=-1, scale_mode=sm)
                ymb = qr.double() @ qw.double().t() + mu.double() @ w.double().t()
                r["mean_removed"] = {"y_gain": gain(y, ymb), "y_db": sqnr_db(y, ymb)}
            row[f"{mode}/{sm}"] = r
    return row


def summary(rows: list[dict]) -> str:
    """Means over the linears as two markdown tables (the operands; the output), one line per
    mode and scale mode, and the mean's energy share."""
    def mean(f):
        return sum(f(r) for r in rows) / len(rows)

    def cell(path, fmt):
        def get(r):
            for part in path:
                r = r[part]
            return r
        return format(mean(get), fmt)

    ops = ["| mode / scale | operand | gain | magnitude bias | error along Q(v) | SQNR (dB) | clipped blocks |",
           "|---|---|---:|---:|---:|---:|---:|"]
    out = ["| mode / scale | y gain | y SQNR (dB) | unbiased per tensor: gain, SQNR | unbiased per row: gain, SQNR | "
           "mean removed: gain, SQNR |", "|---|---:|---:|---|---|---|"]
    for mode in MODES:
        for sm in SCALE_MODES:
            k = f"{mode}/{sm}"
            for o in ("x", "w"):
                ops.append(f"| {k} | {o.upper()} | {cell((k, o, 'gain'), '+.4f')} | "
                           f"{cell((k, o, 'mag_bias'), '+.4f')} | "
                           f"{cell((k, o, 'err_along_q'), '+.4f')} | {cell((k, o, 'db'), '.2f')} | "
                           f"{cell((k, o, 'clipped_blocks'), '.3f')} |")
            extra = ["- | - | -"] if sm != "even" else [" | ".join(
                f"{cell((k, v, 'y_gain'), '+.4f')}, {cell((k, v, 'y_db'), '.2f')}"
                for v in ("unbiased_per_tensor", "unbiased_per_row", "mean_removed"))]
            out.append(f"| {k} | {cell((k, 'y_gain'), '+.4f')} | {cell((k, 'y_db'), '.2f')} | {extra[0]} |")
    share = ("mean over the linears of the share of X's energy in its mean over tokens: "
             f"{cell(('mean_energy_share',), '.3f')}")
    return "\n".join([*ops, "", *out, "", share])


def main(argv: list[str] | None = None) -> int:
    p = script_parser(__doc__)
    add_heldout_args(p, "JSON lines file: one row per linear, with the environment")
    args = p.parse_args(argv)
    model, env, batches = heldout_setup(p, args, "fprop_bias.py", argv)
    xs = capture_linear_inputs(model, batches)
    weights = {f"layers.{n}": m.weight.detach().float() for n, m in model.layers.named_modules()
               if isinstance(m, torch.nn.Linear)}
    rows = []
    for name, x in xs.items():
        rows.append({"linear": name, **linear_stats(x, weights[name])})
    print(summary(rows))
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("w") as f:
            for r in rows:
                f.write(json.dumps({"benchmark": "fprop_bias", **r, "settings": {
                    k: v for k, v in vars(args).items() if k not in ("out", "threads")}, "env": env}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
