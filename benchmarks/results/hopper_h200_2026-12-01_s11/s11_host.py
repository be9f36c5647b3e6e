"""Session 11: host (CPU) time per call of what one AdaHOP linear enqueues, with the GPU kept busy
(torch.cuda._sleep) so that no call waits for it. Also the partial-maximum reduction's launch
shapes. python s11_host.py OUTDIR"""
import json, os, sys, time, torch
import torch.nn.functional as F
from triton.testing import do_bench
import adahop
from adahop.ops.kernel_backends import HopperFP8Backend
from adahop.ops.operand import OperandSpec
from adahop.kernels.topk import topk_indices
out = sys.argv[1]
res = {}
T, N, K = 16384, 14336, 4096
dev = "cuda"
x = torch.randn(T, K, device=dev).bfloat16()
g = torch.randn(T, N, device=dev).bfloat16()
w = torch.randn(N, K, device=dev) * 0.02
wb = w.bfloat16()
be = HopperFP8Backend()
s = OperandSpec(hadamard_size=32)
sr = OperandSpec(hadamard_size=32, rounding="sr", sr_seed=5)
a_op = be.quantize(x, 1, s); b_op = be.quantize(wb, 1, s)
v = torch.randn(N, device=dev)

def host_us(fn, n=30):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000 // 1000 * 200)  # keep the GPU busy: nothing below waits
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return t

cases = {
    "torch.empty [16384,4096] bf16": lambda: torch.empty((T, K), dtype=torch.bfloat16, device=dev),
    "_scaled_mm rowwise bf16 out": lambda: torch._scaled_mm(a_op.e4m3, b_op.e4m3.t(), scale_a=a_op.row_scale[:, None], scale_b=b_op.row_scale[None, :], out_dtype=torch.bfloat16),
    "backend.mm_nt bf16": lambda: be.mm_nt(a_op, b_op, torch.bfloat16),
    "F.linear bf16 (cuBLAS)": lambda: F.linear(x, wb),
    "w.to(bf16)": lambda: w.to(torch.bfloat16),
    "quantize_both g (SR, row norms)": lambda: be.quantize_both(g, sr, sr, row_norms=True),
    "quantize_and_pack x (col norms)": lambda: be.quantize_and_pack(x, s, s, col_norms=True),
    "quantize w along K (fp32, cast in kernel)": lambda: be.quantize(w, 1, s, cast_to=torch.bfloat16),
    "topk 14336": lambda: topk_indices(v, 16),
    "vector add_ bf16": lambda: x.add_(0.0),
}
for name, fn in cases.items():
    res[name] = host_us(fn)
    print(f"host {res[name]:8.1f} us  {name}", flush=True)
# the layer: forward only, backward only (host)
lin = torch.nn.Linear(K, N, bias=False, device=dev)
cfg = adahop.AdaHOPConfig.from_recipe_name("adahop_lv2", backend="hopper_fp8")
layer = adahop.AdaHOPLinear.from_float(lin, config=cfg, name="bench")
layer.set_modes({"fprop": "iht", "dgrad": "iht+oe_left", "wgrad": "iht+oe_right"})
xr = x.clone().requires_grad_()
def fwd():
    with torch.autocast("cuda", dtype=torch.bfloat16):
        return layer(xr)
for _ in range(3):
    fwd().backward(g)
torch.cuda.synchronize()
torch.cuda._sleep(200_000_000)
tf = tb = 0.0
for _ in range(10):
    t0 = time.perf_counter(); y = fwd(); t1 = time.perf_counter(); y.backward(g); t2 = time.perf_counter()
    tf += t1 - t0; tb += t2 - t1
torch.cuda.synchronize()
res["layer_forward_host_us"] = tf / 10 * 1e6; res["layer_backward_host_us"] = tb / 10 * 1e6
print(f"host layer forward {tf/10*1e6:.0f} us, backward {tb/10*1e6:.0f} us", flush=True)
# bf16 nn.Linear for comparison
lin2 = torch.nn.Linear(K, N, bias=False, device=dev)
def fwd2():
    with torch.autocast("cuda", dtype=torch.bfloat16):
        return lin2(xr)
for _ in range(3):
    fwd2().backward(g)
torch.cuda.synchronize(); torch.cuda._sleep(200_000_000)
tf = tb = 0.0
for _ in range(10):
    t0 = time.perf_counter(); y = fwd2(); t1 = time.perf_counter(); y.backward(g); t2 = time.perf_counter()
    tf += t1 - t0; tb += t2 - t1
torch.cuda.synchronize()
res["bf16_forward_host_us"] = tf / 10 * 1e6; res["bf16_backward_host_us"] = tb / 10 * 1e6
print(f"host bf16 forward {tf/10*1e6:.0f} us, backward {tb/10*1e6:.0f} us", flush=True)
# partial-maximum reduction launch shapes
import adahop.kernels.quantize_both as qb
for rows_per, parts in ((128, 16), (64, 16), (32, 32), (32, 64), (16, 64)):
    qb.PARTIAL_MAX_ROWS, qb.PARTIAL_MAX_PARTS = rows_per, parts
    r = {}
    for nparts, R in ((224, 16384), (256, 14336), (64, 16384)):
        p = torch.randint(0, 256, (nparts, R, 16), dtype=torch.uint8, device=dev)
        o = torch.empty(R, dtype=torch.uint8, device=dev)
        qb._row_maxima(p, o)
        assert torch.equal(o, p[:, :, 0].amax(0))
        r[f"{nparts}x{R}"] = do_bench(lambda: qb._row_maxima(p, o), rep=50) * 1e3
    pa = torch.randint(0, 256, (224, 16384, 16), dtype=torch.uint8, device=dev); pb = torch.randint(0, 256, (256, 14336, 16), dtype=torch.uint8, device=dev)
    oa = torch.empty(16384, dtype=torch.uint8, device=dev); ob = torch.empty(14336, dtype=torch.uint8, device=dev)
    r["g_both_one_launch"] = do_bench(lambda: qb._row_maxima(pa, oa, pb, ob), rep=50) * 1e3
    res[f"rowmax_{rows_per}x{parts}"] = r
    print("rowmax", rows_per, parts, {k: round(t, 1) for k, t in r.items()}, "us", flush=True)
json.dump(res, open(os.path.join(out, "host.json"), "w"), indent=1)
