# Session 11, device run 3: tests of the changed kernels; top-k at 32,768 (held in registers with
# 16 warps, spilling, vs re-read); the layer at the four shapes (paired BF16 timings), torchao,
# saved memory.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src
timeout 90 python -m pytest -q -x tests/test_topk.py tests/test_kernels.py -k "topk or round_to_bf16 or linear_on_triton or selection" -p no:cacheprovider 2>&1 | tail -1
timeout 60 python - <<'PY'
import torch, adahop.kernels.topk as tk
from triton.testing import do_bench
from adahop.ops.outliers import largest_k
for n in (4096, 16384, 32768, 65536):
    v = torch.randn(n, device="cuda")
    row = {}
    for mb in (16384, 32768):
        tk.MAX_BLOCK = mb
        assert torch.equal(tk.topk_indices(v, 16).cpu(), largest_k(v.cpu(), 16)), (n, mb)
        row[mb] = round(do_bench(lambda: tk.topk_indices(v, 16), warmup=25, rep=200) * 1e3, 1)
    print("topk n", n, "us by MAX_BLOCK", row, flush=True)
PY
python -m pip install --no-deps -q .carry/whl/torchao-0.18.0-*.whl 2>&1 | grep -v -i "warn" | tail -1
timeout 400 python benchmarks/bench_hopper.py --sections linear,torchao,memory --recipes adahop_lv2,adahop_lv1,mxfp4,tseng \
  --no-emulation --rep 100 --pairs 3 --out $OUT > $OUT/lin.log 2>&1
grep -E "Error|error" $OUT/lin.log | head -5
python - <<'PY'
import json, os
r = json.load(open(os.environ["OUT"] + "/bench_hopper.json"))
for k in ("linear_speedup_vs_bf16", "torchao_speedup_vs_bf16"):
    for row in r.get(k, []):
        print(k[:8], json.dumps({a: (round(b, 3) if isinstance(b, float) else b) for a, b in row.items() if a != "times_ms"})[:400])
print({k: round(v["ratio_vs_bf16"], 2) for k, v in r.get("saved_bytes", {}).items() if v["ratio_vs_bf16"]})
PY
