"""A/B of the quantize kernels between two source trees (PYTHONPATH decides which adahop is
imported): times every kernel form the layer uses and saves outputs for a bit comparison.
    python ab_quant.py TAG OUTDIR"""
import json, os, sys, torch, triton
from triton.testing import do_bench
from adahop.kernels.quantize import quantize_operand_triton
from adahop.kernels.quantize_both import quantize_both

tag, out = sys.argv[1], sys.argv[2]
T = int(os.environ.get("AB_T", 16384)); DEV = os.environ.get("AB_DEV", "cuda")
def act(shape, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(shape, device=DEV, generator=g).to(torch.bfloat16)
    x[:, :8] *= 30
    return x
res, outs = {}, {}
src = torch.randint(0, 256, (2**30 if DEV == "cuda" else 2**20,), dtype=torch.uint8, device=DEV); dst = torch.empty_like(src)
res["copy_GBps"] = 2 * src.numel() / do_bench(lambda: dst.copy_(src), rep=100) / 1e6
del src, dst
cases = []
for K in ((4096, 14336) if DEV == "cuda" else (64,)):
    x = act((T, K), K)
    h = dict(hadamard_size=32)
    sr = dict(hadamard_size=32, rounding="sr", sr_seed=3)
    cases += [
        (f"[{T},{K}] along T packed RNE", lambda x=x: quantize_operand_triton(x, 0, **h), T*K*2 + T*K*17//32),
        (f"[{T},{K}] along T packed SR", lambda x=x: quantize_operand_triton(x, 0, **sr), T*K*2 + T*K*17//32),
        (f"[{T},{K}] along K packed RNE", lambda x=x: quantize_operand_triton(x, 1, **h), T*K*2 + T*K*17//32),
        (f"[{T},{K}] along K e4m3 RNE", lambda x=x: quantize_operand_triton(x, 1, e4m3=True, packed=False, **h), T*K*3),
        (f"[{T},{K}] along K e4m3 SR", lambda x=x: quantize_operand_triton(x, 1, e4m3=True, packed=False, **sr), T*K*3),
        (f"[{T},{K}] both: e4m3 K + packed T (x)", lambda x=x: quantize_both(x, h, h, rows_form="packed"), T*K*2 + T*K + T*K*17//32),
        (f"[{T},{K}] both: e4m3 both SR (g)", lambda x=x: quantize_both(x, sr, dict(sr, sr_seed=4)), T*K*4),
    ]
rows = []
for name, fn, nbytes in cases:
    o = fn()
    flat = []
    for d in (o if isinstance(o, tuple) else (o,)):
        for k, v in sorted(d.items()):
            if hasattr(v, "codes"):
                flat += [v.codes, v.scale_e8m0]
            else:
                flat.append(v.view(torch.uint8) if v.dtype == torch.float8_e4m3fn else v)
    outs[name] = [t.cpu() for t in flat]
    t = do_bench(fn, rep=100)
    rows.append(dict(case=name, ms=t, GBps=nbytes / t / 1e6, frac_of_copy=nbytes / t / 1e6 / res["copy_GBps"]))
    print(tag, rows[-1], flush=True)
res["rows"] = rows
res["device"] = (torch.cuda.get_device_name() if DEV == "cuda" else "cpu"); res["torch"] = torch.__version__; res["triton"] = triton.__version__
json.dump(res, open(os.path.join(out, f"ab_{tag}.json"), "w"), indent=1)
torch.save(outs, f"/tmp/ab_{tag}.pt")
