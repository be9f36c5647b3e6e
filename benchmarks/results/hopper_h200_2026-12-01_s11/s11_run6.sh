# Session 11, device run 6: wgrad's OE GEMM g^T x[:, idx] summed in g's quantize_both first pass.
# GPU tests; the kernel with and without the product vs cuBLAS's GEMM; the layer, old tree (HEAD
# before) and new, paired against BF16.
export PYTHONUNBUFFERED=1
PYTHONPATH=$PWD/src timeout 120 python -m pytest -q -x tests/test_quantize_both.py tests/test_offline_compile.py -p no:cacheprovider 2>&1 | tail -1
PYTHONPATH=$PWD/src timeout 60 python -m pytest -q -x tests/test_linear.py -k "autocast or parameter_dtype or hopper or gpu" -p no:cacheprovider 2>&1 | tail -1
PYTHONPATH=$PWD/src timeout 90 python - <<'PY'
import torch
from triton.testing import do_bench
from adahop.kernels.quantize_both import quantize_both
T, N = 16384, 14336
g = torch.randn(T, N, device="cuda").bfloat16()
xc = (torch.randn(T, 16, device="cuda") * 5).bfloat16()
sr = dict(hadamard_size=32, rounding="sr", sr_seed=3)
a0, b0 = quantize_both(g, sr, dict(sr, sr_seed=4), row_norms=True)
a1, b1 = quantize_both(g, sr, dict(sr, sr_seed=4), row_norms=True, times=xc)
same = all(torch.equal(d0[k].view(torch.uint8) if d0[k].dtype == torch.float8_e4m3fn else d0[k], d1[k].view(torch.uint8) if d1[k].dtype == torch.float8_e4m3fn else d1[k]) for d0, d1 in ((a0, a1), (b0, b1)) for k in d0)
ref = g.t() @ xc
exact = g.double().t() @ xc.double()
print("bits same:", same, "| product vs cuBLAS bf16: max |diff| / max |ref|", ((b1["xt_times"].float() - ref.float()).abs().max() / ref.float().abs().max()).item(),
      "| error vs exact, ours / cuBLAS:", (b1["xt_times"].double() - exact).abs().max().item(), (ref.double() - exact).abs().max().item())
t0 = do_bench(lambda: quantize_both(g, sr, dict(sr, sr_seed=4), row_norms=True), rep=200)
t1 = do_bench(lambda: quantize_both(g, sr, dict(sr, sr_seed=4), row_norms=True, times=xc), rep=200)
tg = do_bench(lambda: g.t() @ xc, rep=200)
print(f"g both ways: {t0:.3f} ms; with the product: {t1:.3f} ms (+{t1 - t0:.3f}); cuBLAS g^T x_cols: {tg:.3f} ms")
PY
for i in 1 2; do for t in old new; do
  [ $t = old ] && P=$PWD/.carry/old/src || P=$PWD/src
  PYTHONPATH=$P timeout 100 python benchmarks/bench_hopper.py --sections linear --shapes 14336,4096 \
    --recipes adahop_lv2,adahop_lv1 --no-emulation --rep 100 --pairs 3 --out $OUT 2>&1 | grep -E "  linear|Error" | sed "s/^/$t$i /"
  cp $OUT/bench_hopper.json $OUT/linear_${t}$i.json
done; done
