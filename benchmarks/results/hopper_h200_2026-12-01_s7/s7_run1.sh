# Session 7, device run 1: GPU tests of the new top-k kernel and quantize_both sumsq, then the OE
# parts, the layer and the profile at the 8B shape (14336, 4096) and a 125M shape (2048, 768).
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python -c "import torch, triton; print(torch.__version__, triton.__version__)"
timeout 200 python -m pytest -q -x tests/test_topk.py tests/test_quantize_both.py tests/test_kernels.py -k "topk or sumsq or sums_of_squares or linear or select or compile or both" 2>&1 | tail -4
timeout 330 python benchmarks/bench_hopper.py --sections check,oe,linear,profile --shapes 14336,4096/2048,768 \
  --recipes adahop_lv2,adahop_lv1 --no-emulation --rep 100 --out $OUT > $OUT/bench.log 2>&1
grep -v "^ \|^{\|^}" $OUT/bench.log | tail -20
python - <<'PY'
import json, os
d = json.load(open(os.path.join(os.environ["OUT"], "bench_hopper.json")))
for r in d.get("oe", []):
    print("OE", r["shape"], {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items() if k != "shape"})
for r in d.get("linear_speedup_vs_bf16", []):
    print("LIN", r)
for k, v in d.items():
    if k.startswith("profile_"):
        print(k, "enqueue %.2f total %.2f" % (v["host_enqueue_ms"], v["host_total_ms"]))
        for n, ms, c in v["per_iteration_ms"][:14]:
            print("   %.3f x%d %s" % (ms, c, n[:70]))
for k in d:
    if k.endswith("_error"): print(k, d[k][-600:])
PY
