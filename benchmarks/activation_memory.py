"""What a training step keeps for the backward, per token and per transformer block, by recipe:
the tensors the compiled graph saves, read from the graph itself, on the CPU.

    python benchmarks/activation_memory.py --model-size 1b --recipes bf16 mxfp4 --share-input both

The library's Llama is compiled whole (``torch.compile(fullgraph=True)``, bf16 autocast) through
AOTAutograd with the min-cut partitioner, which is what Inductor uses to choose what the forward
saves; the forward graph's outputs beyond the loss are those tensors. One block's share is the
difference between the model with two blocks and with one (the embedding, the head and the
loss cancel). Each saved tensor is listed with the op that made it (views looked through),
its shape and dtype; a tensor whose shape holds the token count T (or T/2, T/32: x packed
along the tokens) is an activation (bytes per token), the rest are per-block constants (the
bf16 copies of the weights that autocast saves for ``F.linear``'s backward). Parameters
themselves are not counted: they are alive anyway.

What this predicts is the activation part of a step's peak memory: bytes per token per block x
tokens per step x blocks. At 1B, with the parameters and optimizer state added, it came within
1.5% of the H200's measured peaks, under them (docs/results.md, 'What the speed targets would
need'). Adaptive recipes need their modes (``--modes``, a ``modes.json`` of the same model size),
since a calibrating layer runs eagerly and is not in the graph. ``--wgrad-input`` sets
``AdaHOPConfig.wgrad_input``: with "recompute" the layers keep x itself for the backward, which
quantizes it, and the partitioner may recompute x there instead of saving it.

torchao's float8 training is traced as a peer, as ``bench_train_speed.py`` runs it:
``torchao_float8_tensorwise`` and ``torchao_float8_rowwise`` build the model as for bf16 and
convert the linears adahop's conversion would take whose dims are multiples of 16 with
``torchao.float8.convert_to_float8_training`` (``Float8LinearConfig.from_recipe_name``), the
linears it leaves running ``F.linear`` as in bf16. The config is the recipe's with
``emulate=True``, so that the step runs on the CPU: only the GEMM differs from the GPU's (a
``torch.mm`` of the dequantized operands for ``torch._scaled_mm``); the casts to float8, whose
outputs the partitioner may save, are the same ops. (Traced with ``torch._scaled_mm`` itself,
which torch 2.13 runs on the CPU too, the 1B step saves the same bytes per token, its float8
e4m3 x included, under other producers' names.) torchao is needed for these alone
(``pip install torchao``).
"""

from __future__ import annotations

import json
import sys
from collections import Counter

import torch
from bench_train_speed import PEERS, float8_filter, torchao_float8
from common import Results, add_out_arg, environment, print_environment, script_parser

import adahop

VIEWS = ("aten.view", "aten._unsafe_view", "aten.detach", "aten.t.", "aten.transpose", "aten.permute",
         "aten.reshape", "aten.select", "aten.slice", "aten.expand", "aten.alias")


def convert_peer(model, recipe: str) -> str:
    """Convert ``model`` (built as for bf16) to torchao's float8 training in the peer's recipe,
    emulated (see the module docstring), the linears taken as ``bench_train_speed.py`` takes
    them. Returns torchao's version; a ValueError naming ``pip install torchao`` without it."""
    import dataclasses

    from adahop.convert import default_module_filter

    version, config_class, convert = torchao_float8()
    config = dataclasses.replace(config_class.from_recipe_name(PEERS[recipe]), emulate=True)
    convert(model, config=config, module_filter_fn=float8_filter(default_module_filter(model)))
    return version


def saved_tensors(recipe: str, size: str, n_layers: int, tokens: int, share_input: bool, modes: str | None,
                  vocab: int, wgrad_input: str = "packed") -> Counter:
    """Bytes the compiled forward saves for the backward, by (producer, shape, dtype)."""
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    from adahop.llama.model import Llama, LlamaConfig

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Llama(LlamaConfig.from_size(size, vocab_size=vocab, max_seq_len=tokens, n_layers=n_layers))
    if recipe in PEERS:
        # adahop converts nothing: the linears torchao leaves run F.linear, as bf16's do
        convert_peer(model, recipe)
    else:
        config = adahop.AdaHOPConfig.from_recipe_name(recipe, backend="reference", share_input=share_input,
                                                      wgrad_input=wgrad_input)
        adahop.convert_to_adahop_training(model, config=config)
        if modes is not None:
            adahop.load_modes(model, modes)
        if not adahop.is_calibrated(model):
            raise ValueError(f"{recipe} calibrates: give its modes (--modes modes.json of a {size} run)")
    saved: Counter = Counter()

    def forward_compiler(gm, example_inputs):
        outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        for node in outputs[1:]:  # outputs[0]: the loss's input (the logits)
            value = node.meta.get("val") if hasattr(node, "meta") else None
            if not isinstance(value, torch.Tensor) or node.op == "placeholder":
                continue  # a parameter or an input: alive anyway
            src = node
            while src.op == "call_function" and str(src.target).startswith(VIEWS):
                src = src.args[0]
            producer = str(src.target) if src.op == "call_function" else src.op
            saved[(producer, tuple(value.shape), str(value.dtype).removeprefix("torch."))] += (
                value.numel() * value.element_size())
        return make_boxed_func(gm.forward)

    backend = aot_autograd(fw_compiler=forward_compiler, bw_compiler=lambda gm, _: make_boxed_func(gm.forward),
                           partition_fn=min_cut_rematerialization_partition)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = compiled(torch.randint(0, vocab, (1, tokens))).float().logsumexp(-1).mean()
    loss.backward()
    return saved


def per_block(recipe: str, size: str, tokens: int, share_input: bool, modes: str | None, vocab: int,
              wgrad_input: str = "packed") -> dict:
    """One row: the tensors one block saves, its activation bytes per token and its constants."""
    one = saved_tensors(recipe, size, 1, tokens, share_input, modes, vocab, wgrad_input)
    two = saved_tensors(recipe, size, 2, tokens, share_input, modes, vocab, wgrad_input)
    block = {k: two[k] - one.get(k, 0) for k in two if two[k] - one.get(k, 0)}
    token_dims = {tokens, tokens // 2, tokens // 32}  # (x packed along T: codes [K, T/2], scales [K, T/32])
    items = [{"producer": p, "shape": list(s), "dtype": d, "bytes": b,
              "per_token": bool(token_dims & set(s))} for (p, s, d), b in sorted(block.items(), key=lambda kv: -kv[1])]
    activation = sum(i["bytes"] for i in items if i["per_token"])
    peer = {"torchao": torchao_float8()[0], "float8_recipe": PEERS[recipe], "float8_emulated": True} \
        if recipe in PEERS else {}
    return {
        "recipe": recipe, "model_size": size, "tokens": tokens, "share_input": share_input, "modes": modes,
        "wgrad_input": None if peer or recipe == "bf16" else wgrad_input, **peer,
        "activation_bytes_per_token": activation / tokens,
        "constant_bytes": sum(i["bytes"] for i in items if not i["per_token"]),
        "items": items,
    }


def run_name(r: dict) -> str:
    """A row's name: the recipe, with x shared, or torchao's version for a peer."""
    if r.get("torchao"):
        return f"{r['recipe']} (torchao {r['torchao']}, emulated)"
    recomputed = " (wgrad's x recomputed)" if r.get("wgrad_input") == "recompute" else ""
    return f"{r['recipe']}{' (x shared)' if r['share_input'] else ''}{recomputed}"


def table(rows: list[dict], project_tokens: int, n_layers: int) -> str:
    lines = [f"| recipe | x shared | wgrad's x | bytes per token per block | per-block constants | {n_layers} "
             f"blocks x {project_tokens} tokens |", "|---|---|---|---|---|---|"]
    for r in rows:
        total = (r["activation_bytes_per_token"] * project_tokens + r["constant_bytes"]) * n_layers
        # sharing x's quantization is adahop's: bf16 quantizes nothing, a peer is torchao's conversion
        shared = "-" if r["recipe"] == "bf16" or r["recipe"] in PEERS else "yes" if r["share_input"] else "no"
        name = f"{r['recipe']} (torchao {r['torchao']})" if r.get("torchao") else r["recipe"]
        lines.append(f"| {name} | {shared} | {r.get('wgrad_input') or '-'} | {r['activation_bytes_per_token']:,.0f} "
                     f"| {r['constant_bytes'] / 2**20:.1f} MiB | {total / 2**30:.2f} GiB |")
    return "\n".join(lines)


def main(argv=None) -> int:
    from adahop.llama.model import SIZES

    p = script_parser(__doc__)
    p.add_argument("--model-size", default="1b", choices=list(SIZES), help="the Llama's size (default: %(default)s)")
    p.add_argument("--recipes", nargs="+", default=["bf16", "mxfp4"], choices=[*adahop.RECIPES, *PEERS],
                   help="recipes to trace: adahop's and torchao's float8 peers (default: bf16 mxfp4; adaptive ones "
                        "need --modes)")
    p.add_argument("--tokens", type=int, default=160,
                   help="tokens of the traced step: a multiple of 32 whose T, T/2 and T/32 are none of the "
                        "model's dims, so that a shape tells an activation (default: %(default)s)")
    p.add_argument("--share-input", choices=("on", "off", "both"), default="on",
                   help="AdaHOPConfig.share_input of the converted model (on: the library's default; both: each "
                        "recipe both ways) (default: %(default)s)")
    p.add_argument("--wgrad-input", choices=("packed", "recompute", "both"), default="packed",
                   help="AdaHOPConfig.wgrad_input of the converted model (packed: the library's default; both: each "
                        "adahop recipe both ways) (default: %(default)s)")
    p.add_argument("--modes", default=None, help="modes.json for the adaptive recipes (the same model size)")
    p.add_argument("--project-tokens", type=int, default=32768,
                   help="tokens per step of the projection in the table (default: %(default)s, 64 x 512)")
    add_out_arg(p, "activation_memory")
    args = p.parse_args(argv)
    if args.tokens < 32 or args.tokens % 32:
        p.error(f"--tokens must be a positive multiple of 32 (MX blocks run along the tokens), got {args.tokens}")
    shape = SIZES[args.model_size]
    head_dim = shape["dim"] // shape["n_heads"]
    model_dims = {shape["dim"], shape["ffn_dim"], shape["n_heads"], shape["n_kv_heads"], head_dim,
                  shape["n_kv_heads"] * head_dim, 1, 2, 8192}
    clash = sorted(model_dims & {args.tokens, args.tokens // 2, args.tokens // 32})
    if clash:
        p.error(f"--tokens {args.tokens}: T, T/2 or T/32 equals a dim of the {args.model_size} model ({clash}); "
                "take another multiple of 32, e.g. 160")
    env = environment("activation_memory.py", argv)  # (a CPU script: no CUDA needed)
    print_environment(env)
    results = Results(args.out, "activation_memory", env)
    shares = {"on": (True,), "off": (False,), "both": (False, True)}[args.share_input]
    inputs = ("packed", "recompute") if args.wgrad_input == "both" else (args.wgrad_input,)
    rows = []
    for recipe in args.recipes:
        adahop_recipe = recipe != "bf16" and recipe not in PEERS
        for share, wgrad_input in [(s, w) for s in shares for w in inputs] if adahop_recipe else [(False, "packed")]:
            try:
                row = per_block(recipe, args.model_size, args.tokens, share, args.modes, vocab=8192,
                                wgrad_input=wgrad_input)
            except ValueError as e:
                print(f"activation_memory.py: {e}", file=sys.stderr)
                return 2
            rows.append(row)
            results.write("block", [row])
            print(f"{run_name(row)}: {row['activation_bytes_per_token']:,.0f} bytes per token per block", flush=True)
            for item in row["items"][:12]:
                unit = f"{item['bytes'] / args.tokens:10,.0f} B/token" if item["per_token"] else \
                    f"{item['bytes'] / 2**20:10.2f} MiB    "
                print(f"    {unit}  {item['producer']} {item['shape']} {item['dtype']}")
    print()
    print(table(rows, args.project_tokens, SIZES[args.model_size]["n_layers"]))
    print(json.dumps({"out": str(args.out)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
