"""Check on a CUDA GPU that a converted model compiles whole and replays in CUDA graphs with the
eager model's numerics and fresh stochastic rounding.

Sections (``--sections``, in order):

- ``stream``: the compiled quantize kernels with an ``SRStream`` seed (the layer's SR state on
  the device) give the bits of its int seed, for both kernels, including a call count of two
  words;
- ``graph``: a tiny Llama converted under each recipe (the backend ``auto`` picks), after its
  calibration, traces as one graph with no break (``torch._dynamo.explain``);
- ``compiled``: the same model compiled whole with ``fullgraph=True`` three ways, each against
  a deep copy run eagerly on the same batches, for --steps forward + backward passes (no
  optimizer step, so every step sees the same weights): ``aot_eager`` (AOTAutograd without code
  generation: the same bits as eager), ``inductor`` and ``inductor`` with CUDA graphs
  (``mode="reduce-overhead"``) (close to eager: Inductor's fused elementwise kernels round
  otherwise; bf16 shows how much by itself). Each row records the largest relative difference of
  the gradients (as one vector) over the steps and whether each step drew new SR bits (the same
  batch and weights give other gradients);
- ``host``: ms per forward + backward of that model at --tokens tokens, eager, compiled and
  CUDA-graphed, and the share of each step the GPU was idle (1 - kernel time / step time, from
  ``torch.profiler``).

    python benchmarks/check_compile.py [--sections stream,graph,compiled,host] [--out FILE]

Rows go to --out (JSONL, default runs/bench/check_compile.jsonl), each with the environment; a
summary is printed last. Exit status 1 when a check fails.
"""

from __future__ import annotations

import copy
import sys
import time

import torch
from common import Results, add_out_arg, parse_sections_and_shapes, run_sections, script_parser, start

import adahop

SECTIONS = ("stream", "graph", "compiled", "host")
RECIPES = ("bf16", "mxfp4", "mxfp4_iht", "tseng", "adahop_lv1", "adahop_lv2")
VOCAB = 256


def section_stream() -> list[dict]:
    from adahop.formats.rng import SRStream, mix_seeds_from
    from adahop.kernels.quantize import quantize_operand_triton
    from adahop.kernels.quantize_both import quantize_both
    from adahop.ops import OperandSpec

    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(2048, 1536, device="cuda", generator=g).to(torch.bfloat16)
    for prefix, call, gemm, operand in ((12345, 7, 1, 0), (2**32 - 5, 2**33 + 3, 2, 1)):
        stream = SRStream(torch.tensor([prefix, call], device="cuda"), gemm, operand)
        seed = mix_seeds_from(prefix, call, gemm, operand)
        by_int, by_stream = (OperandSpec(rounding="sr", sr_seed=s, hadamard_size=32) for s in (seed, stream))
        for dim in (0, 1):
            for form in ("packed", "e4m3"):
                kw = dict(packed=form == "packed", e4m3=form == "e4m3")
                a = quantize_operand_triton(x, dim, by_int, **kw)
                b = quantize_operand_triton(x, dim, by_stream, **kw)
                same = (torch.equal(a["mx"].codes, b["mx"].codes) if form == "packed"
                        else torch.equal(a["e4m3"].view(torch.uint8), b["e4m3"].view(torch.uint8)))
                rows.append(dict(kernel="quantize", call=call, dim=dim, form=form, same_bits=same))
        by_int, by_stream = (OperandSpec(rounding="sr", sr_seed=s) for s in (seed, stream))
        a = quantize_both(x, by_int, by_int)
        b = quantize_both(x, by_stream, by_stream)
        same = all(torch.equal(p["e4m3"].view(torch.uint8), q["e4m3"].view(torch.uint8)) for p, q in zip(a, b))
        rows.append(dict(kernel="quantize_both", call=call, same_bits=same))
    return rows


def tiny_llama(recipe: str, seed: int = 0, n_layers: int = 2, seq: int = 256):
    """A converted tiny Llama on the GPU in bf16 autocast after its calibration (one step)."""
    from adahop.llama.model import Llama, LlamaConfig

    torch.manual_seed(seed)
    model = Llama(LlamaConfig.from_size("tiny", vocab_size=VOCAB, max_seq_len=seq, n_layers=n_layers)).cuda()
    cfg = adahop.AdaHOPConfig.from_recipe_name(recipe, calibration_steps=1)
    adahop.convert_to_adahop_training(model, config=cfg.with_gemm_settings(oe_k=16))
    step(model, batch(seq))
    return model


def batch(seq: int, rows: int = 8, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randint(0, VOCAB, (rows, seq + 1), device="cuda", generator=g)


def step(model, tok):
    """Forward + backward under bf16 autocast; the loss and all gradients flattened (cleared)."""
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(tok[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tok[:, 1:].flatten())
    loss.backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def section_graph() -> list[dict]:
    rows = []
    for recipe in RECIPES:
        model = tiny_llama(recipe)
        torch._dynamo.reset()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            explained = torch._dynamo.explain(model)(batch(256)[:, :-1])
        rows.append(dict(recipe=recipe, graphs=explained.graph_count, graph_breaks=explained.graph_break_count,
                         one_graph=explained.graph_count == 1 and explained.graph_break_count == 0,
                         reasons=[str(r.reason)[:200] for r in explained.break_reasons]))
    return rows


def section_compiled(steps: int) -> list[dict]:
    from adahop.train.compile import compile_model

    rows = []
    for recipe in ("bf16", "tseng", "adahop_lv2"):
        base = tiny_llama(recipe)
        for name, options in (("aot_eager", dict(backend="aot_eager")), ("inductor", {}),
                              ("cudagraphs", dict(mode="reduce-overhead"))):
            torch._dynamo.reset()
            eager, compiled = copy.deepcopy(base), copy.deepcopy(base)
            compile_model(compiled, fullgraph=True, **options)
            worst, losses_equal, grads = 0.0, True, []
            for _ in range(steps):
                (loss_e, grad_e), (loss_c, grad_c) = step(eager, batch(256)), step(compiled, batch(256))
                losses_equal &= torch.equal(loss_e, loss_c)
                worst = max(worst, ((grad_e - grad_c).norm() / grad_e.norm()).item())
                grads.append(grad_c)
            new_bits = all(not torch.equal(grads[i], grads[i + 1]) for i in range(len(grads) - 1))
            calls_e = [la.calls for la in adahop.adahop_layers(eager).values()]
            calls_c = [la.calls for la in adahop.adahop_layers(compiled).values()]
            row = dict(recipe=recipe, compile=name, steps=steps, losses_equal=losses_equal,
                       grad_diff_rel_norm=worst, new_sr_bits_each_step=new_bits, calls_equal=calls_e == calls_c)
            # Inductor's elementwise kernels round otherwise than eager's, and a quantized GEMM
            # turns an input that moved by an ulp into a code step now and then: close, not equal
            # (bf16 gives the scale of Inductor's own part).
            close = worst == 0.0 if name == "aot_eager" else worst < (1e-2 if recipe == "bf16" else 0.1)
            row["ok"] = row["calls_equal"] and close and (new_bits or recipe == "bf16")
            rows.append(row)
    return rows


def section_host(tokens: int) -> list[dict]:
    from adahop.train.compile import compile_model

    rows = []
    seq = 512
    for recipe in ("bf16", "adahop_lv2"):
        for name, options in (("eager", None), ("compiled", {}), ("cudagraphs", dict(mode="reduce-overhead"))):
            torch._dynamo.reset()
            model = tiny_llama(recipe, n_layers=4, seq=seq)
            if options is not None:
                compile_model(model, fullgraph=True, **options)
            tok = batch(seq, rows=max(1, tokens // seq))
            for _ in range(5):  # compile, warm up (cudagraph trees record on the second call)
                step(model, tok)
            torch.cuda.synchronize()
            n = 20
            t0 = time.perf_counter()
            for _ in range(n):
                step(model, tok)
            torch.cuda.synchronize()
            ms = (time.perf_counter() - t0) * 1e3 / n
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(n):
                    step(model, tok)
                torch.cuda.synchronize()
            kernel_ms = sum(e.device_time_total for e in prof.key_averages() if e.device_time_total > 0) / 1e3 / n
            rows.append(dict(recipe=recipe, compile=name, tokens=tok.shape[0] * seq, ms_per_step=ms,
                             kernel_ms_per_step=kernel_ms, gpu_idle_share=max(0.0, 1 - kernel_ms / ms)))
    return rows


def parse_args(argv=None):
    p = script_parser(__doc__)
    p.add_argument("--sections", default=",".join(SECTIONS),
                   help=f"comma-separated sections to run, in order (default: {','.join(SECTIONS)})")
    p.add_argument("--steps", type=int, default=3, help="forward + backward passes compared per variant (default: 3)")
    p.add_argument("--tokens", type=int, default=16384, help="tokens per step of the 'host' section (default: 16384)")
    add_out_arg(p, "check_compile")
    args = p.parse_args(argv)
    parse_sections_and_shapes(p, args, SECTIONS)
    if args.steps < 2 or args.tokens < 512:
        p.error("--steps must be >= 2 (new SR bits are checked between steps) and --tokens >= 512")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    env = start("check_compile.py", argv)

    collected: list[dict] = []

    def run(name):
        if name == "stream":
            rows = section_stream()
        elif name == "graph":
            rows = section_graph()
        elif name == "compiled":
            rows = section_compiled(args.steps)
        else:
            rows = section_host(args.tokens)
        collected.extend(rows)
        return rows

    status = run_sections(args.sections, run, Results(args.out, "check_compile", env))
    failed = [r for r in collected if r.get("same_bits") is False or r.get("one_graph") is False
              or r.get("ok") is False]
    for r in collected:
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items() if k != "reasons"})
    print(f"check_compile: {len(collected)} rows, {len(failed)} failed checks")
    return 1 if failed or status else 0


if __name__ == "__main__":
    sys.exit(main())
