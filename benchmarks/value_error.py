"""How the V projection's quantization error reaches the attention output, block by block of a
pretrained model: the SQNR of V = X Wv^T and of the attention output softmax(Q K^T) V, under naive
MXFP4 and under IHT (a block Hadamard of 32 on both operands, then MXFP4), for the whole error
and for the weight's and the activation's error apart, with the share of the weight's error that
every token has in common and how much of the activation's energy a few channels carry.

A GEMM's output SQNR, which the measured policy ranks the modes by, weighs every token's error
alike. Attention hands each query a weighted mean of the tokens' V rows: an error that differs
from token to token shrinks in that mean, an error that every token shares does not. The
weight's quantization error, met by activations with a large common part (a few channels that
carry most of the energy in every token), is such an error; the activation's rounding mostly
is not. So a mode can win on V's SQNR and lose on the attention output's.

    python benchmarks/value_error.py --init smollm2 --corpus runs/corpus_smollm2 --out runs/value_error.jsonl

The numerics are the reference's forward (round to nearest even, the default scale rule, blocks
of 32 along the contraction dim); the attention is recomputed in float32 from the block's own
Q and K (RoPE, causal mask, grouped K/V heads), and matches the model's within float32 rounding.
The corpus must be built with the model's tokenizer (``adahop data --tokenizer smollm2``).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from common import add_heldout_args, heldout_setup, script_parser, sqnr_db  # noqa: E402

from adahop.formats.mxfp4 import fake_quantize_mxfp4  # noqa: E402
from adahop.llama.model import apply_rope, repeat_kv  # noqa: E402
from adahop.transforms.hadamard import block_hadamard  # noqa: E402

MODES = ("mxfp4", "iht")
TOP_CHANNELS = 4  # the input channels of the largest energy that ``channels`` reports on
PARTS = ("both", "weight", "activation")  # which operand's quantization error is kept


def capture_attention_inputs(model, inputs: torch.Tensor) -> list[dict]:
    """Per block: the attention's input x [B, T, D] and its post-RoPE q [B, H, T, d] and k
    [B, G, T, d], and the block's attention module, from one forward of ``model`` on ``inputs``."""
    captured = []

    def hook(module, args):
        x, cos, sin = args
        b, t, _ = x.shape
        with torch.no_grad():
            q = module.wq(x).view(b, t, module.n_heads, module.head_dim).transpose(1, 2)
            k = module.wk(x).view(b, t, module.n_kv_heads, module.head_dim).transpose(1, 2)
            captured.append({"x": x.detach().float(), "q": apply_rope(q, cos, sin).float(),
                             "k": apply_rope(k, cos, sin).float(), "attention": module})

    handles = [block.attention.register_forward_pre_hook(hook) for block in model.layers]
    try:
        with torch.no_grad():
            model(inputs)
    finally:
        for h in handles:
            h.remove()
    return captured


def attention_probs(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Causal softmax(q k^T / sqrt(d)) [B, H, T, T], K's heads repeated for grouped queries."""
    t, d = q.shape[-2], q.shape[-1]
    k = repeat_kv(k, q.shape[1] // k.shape[1])
    mask = torch.full((t, t), -math.inf, device=q.device).triu(1)
    return torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d) + mask, dim=-1)


def attend(probs: torch.Tensor, v: torch.Tensor, n_kv_heads: int, head_dim: int) -> torch.Tensor:
    """The attention output [B, H, T, d] for the V projection's output v [B, T, G * d]."""
    b, t, _ = v.shape
    v = v.view(b, t, n_kv_heads, head_dim).transpose(1, 2)
    return probs @ repeat_kv(v, probs.shape[1] // n_kv_heads)


def quantized(a: torch.Tensor, mode: str) -> torch.Tensor:
    """``a`` as the forward GEMM sees it under ``mode``, in the basis it is multiplied in."""
    if mode == "iht":
        a = block_hadamard(a, dim=-1)
    return fake_quantize_mxfp4(a, dim=-1)


def value_errors(x: torch.Tensor, w: torch.Tensor, probs: torch.Tensor, n_kv_heads: int, head_dim: int) -> dict:
    """``{mode: {part: {"v_db", "out_db"}, "common_share": float}}`` for the V projection of one
    block: ``x`` [B, T, D] its input, ``w`` [G * d, D] its weight, ``probs`` the block's attention.
    ``common_share``: the share of the weight-only error's energy in V that is the same for every
    token (the error of the token-mean of V)."""
    v = x @ w.t()
    out = attend(probs, v, n_kv_heads, head_dim)
    result = {}
    for mode in MODES:
        exact = block_hadamard(x, dim=-1) if mode == "iht" else x
        exact_w = block_hadamard(w, dim=-1) if mode == "iht" else w
        qx, qw = quantized(x, mode), quantized(w, mode)
        row = {}
        for part, (a, b) in {"both": (qx, qw), "weight": (exact, qw), "activation": (qx, exact_w)}.items():
            vq = a @ b.t()
            row[part] = {"v_db": sqnr_db(v, vq), "out_db": sqnr_db(out, attend(probs, vq, n_kv_heads, head_dim))}
        weight_err = (exact @ qw.t() - v).flatten(0, 1)  # [B * T, G * d]
        total = weight_err.double().pow(2).sum().item()
        common = weight_err.mean(0).double().pow(2).sum().item() * weight_err.shape[0]
        row["common_share"] = common / total if total > 0 else math.nan
        result[mode] = row
    return result


def channels(x: torch.Tensor, w: torch.Tensor, top: int = TOP_CHANNELS) -> dict:
    """The ``top`` input channels of the largest energy over all tokens: their share of x's
    energy, and the mean |w| on them over the mean |w| of all channels."""
    energy = x.flatten(0, -2).double().pow(2).sum(0)
    idx = energy.topk(top).indices
    return {"top_channels": idx.tolist(), "top_energy_share": (energy[idx].sum() / energy.sum()).item(),
            "top_weight_ratio": (w[:, idx].abs().mean() / w.abs().mean()).item()}


def measure(model, batches: list[torch.Tensor]) -> list[dict]:
    """One row per block: ``value_errors`` over ``batches`` of token ids (their SQNRs as the
    ratio of the summed energies: the batches concatenated), ``channels``, and the mean attention
    weight on the first token of each window."""
    per_block: dict[int, list] = {}
    for inputs in batches:
        for i, c in enumerate(capture_attention_inputs(model, inputs)):
            attn = c["attention"]
            probs = attention_probs(c["q"], c["k"])
            per_block.setdefault(i, []).append((c["x"], attn.wv.weight.detach().float(), probs, attn))
    rows = []
    for i, items in per_block.items():
        attn = items[0][3]
        x = torch.cat([it[0] for it in items])
        probs = torch.cat([it[2] for it in items])
        rows.append({"block": i, **value_errors(x, items[0][1], probs, attn.n_kv_heads, attn.head_dim),
                     **channels(x, items[0][1]), "first_token_attention": probs[..., 0].mean().item()})
    return rows


def table(rows: list[dict]) -> str:
    """The rows as a markdown table, with their mean as the last row."""
    lines = ["| block | V SQNR mxfp4 / iht (dB) | attention output mxfp4 / iht | weight error only, output | "
             "activation error only, output | weight error common to all tokens, mxfp4 / iht | top-4 channels' "
             "share of X's energy | their mean \\|W\\| over all | attention on the first token |",
             "|---:|---|---|---|---|---|---:|---:|---:|"]

    def pair(r, part, key):
        return f"{r['mxfp4'][part][key]:.2f} / {r['iht'][part][key]:.2f}"

    def mean(values):
        return sum(values) / len(rows)

    mean_row = {"block": "mean", **{k: mean(r[k] for r in rows) for k in (
        "top_energy_share", "top_weight_ratio", "first_token_attention")}}
    for m in MODES:
        mean_row[m] = {p: {k: mean(r[m][p][k] for r in rows) for k in ("v_db", "out_db")} for p in PARTS}
        mean_row[m]["common_share"] = mean(r[m]["common_share"] for r in rows)
    for r in [*rows, mean_row]:
        lines.append(f"| {r['block']} | {pair(r, 'both', 'v_db')} | {pair(r, 'both', 'out_db')} | "
                     f"{pair(r, 'weight', 'out_db')} | {pair(r, 'activation', 'out_db')} | "
                     f"{r['mxfp4']['common_share']:.2f} / {r['iht']['common_share']:.2f} | "
                     f"{r['top_energy_share']:.2f} | {r['top_weight_ratio']:.2f} | {r['first_token_attention']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = script_parser(__doc__)
    add_heldout_args(p, "JSON lines file: one row per block, with the environment")
    args = p.parse_args(argv)
    model, env, batches = heldout_setup(p, args, "value_error.py", argv)
    rows = measure(model, batches)
    print(table(rows))
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("a") as f:
            for r in rows:
                f.write(json.dumps({"benchmark": "value_error", **r, "settings": {
                    k: v for k, v in vars(args).items() if k not in ("out", "threads")}, "env": env}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
