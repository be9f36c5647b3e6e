"""Session 11 micro-benchmarks, one source tree (PYTHONPATH): the float32 weight quantized with
the bf16 cast in the kernel's loads vs cast + quantize (bits compared), the partial-maximum
reduction vs torch.amax, top-k. python s11_micro.py TAG OUTDIR"""
import json, os, sys, torch
from triton.testing import do_bench
from adahop.kernels.quantize import quantize_operand_triton
from adahop.kernels.topk import topk_indices
tag, out = sys.argv[1], sys.argv[2]
res = {"tag": tag}
torch.manual_seed(0)
if tag == "new":
    from adahop.kernels.quantize_both import _row_maxima
    for N, K in ((14336, 4096), (4096, 14336), (4096, 4096)):
        w = torch.randn(N, K, device="cuda") * 0.02
        for dim, spec in ((1, dict(hadamard_size=32)), (0, dict(hadamard_size=32))):
            cast = lambda: quantize_operand_triton(w.to(torch.bfloat16), dim, e4m3=True, packed=False, **spec)
            fold = lambda: quantize_operand_triton(w, dim, e4m3=True, packed=False, round_to_bf16=True, **spec)
            a, b = cast(), fold()
            same = torch.equal(a["e4m3"].view(torch.uint8), b["e4m3"].view(torch.uint8)) and torch.equal(a["row_scale"], b["row_scale"])
            wb = w.to(torch.bfloat16)
            row = dict(shape=(N, K), dim=dim, bits_identical=same, cast_ms=do_bench(lambda: w.to(torch.bfloat16), rep=100),
                       quant_bf16_ms=do_bench(lambda: quantize_operand_triton(wb, dim, e4m3=True, packed=False, **spec), rep=100),
                       cast_plus_quant_ms=do_bench(cast, rep=100), fold_ms=do_bench(fold, rep=100))
            res.setdefault("fold", []).append(row); print("fold", row, flush=True)
    for nparts, R in ((224, 16384), (256, 14336), (64, 16384)):
        p = torch.randint(0, 256, (nparts, R, 16), dtype=torch.uint8, device="cuda")
        o = torch.empty(R, dtype=torch.uint8, device="cuda")
        _row_maxima(p, o)
        row = dict(parts=(nparts, R), same=bool(torch.equal(o, p[:, :, 0].amax(0))),
                   torch_amax_ms=do_bench(lambda: torch.amax(p[:, :, 0], dim=0, out=o), rep=100),
                   kernel_ms=do_bench(lambda: _row_maxima(p, o), rep=100))
        res.setdefault("rowmax", []).append(row); print("rowmax", row, flush=True)
for n in (4096, 14336, 16384, 32768):
    v = torch.randn(n, device="cuda")
    row = dict(n=n, us=do_bench(lambda: topk_indices(v, 16), warmup=25, rep=200) * 1e3, idx_head=topk_indices(v, 16)[:4].tolist())
    res.setdefault("topk", []).append(row); print("topk", tag, row, flush=True)
json.dump(res, open(os.path.join(out, f"micro_{tag}.json"), "w"), indent=1)
