# Session 7, device run 3: FastLauncher engaged (run 2 had it off: the hook chain is never None), single chunk up to 2048.
# GPU tests first, then the layer at every shape, the profiles, one-chunk timings at (2048, 2048).
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python -c "import torch, triton; print(torch.__version__, triton.__version__)"
timeout 240 python -m pytest -q -x tests/test_launch.py tests/test_topk.py tests/test_kernels.py tests/test_quantize_both.py 2>&1 | tail -4
timeout 200 python benchmarks/bench_hopper.py --sections check,linear --shapes 2048,768/8192,2048/4096,4096/6144,4096/14336,4096/4096,14336 \
  --recipes adahop_lv2,adahop_lv1,mxfp4 --no-emulation --rep 100 --out $OUT > $OUT/bench.log 2>&1
mv $OUT/bench_hopper.json $OUT/linear.json
timeout 90 python benchmarks/bench_hopper.py --sections profile --shapes 2048,768/4096,4096 --out $OUT > $OUT/bench2.log 2>&1
mv $OUT/bench_hopper.json $OUT/profile.json
timeout 90 python benchmarks/bench_hopper.py --sections single --shapes 2048,2048 --out $OUT > $OUT/bench3.log 2>&1
grep -v "^ \|^{\|^}" $OUT/bench.log $OUT/bench2.log $OUT/bench3.log | tail -8
python - <<'PY'
import json, os
d = json.load(open(os.path.join(os.environ["OUT"], "linear.json")))
for f in ("profile.json", "bench_hopper.json"):
    if os.path.exists(os.path.join(os.environ["OUT"], f)):
        d.update(json.load(open(os.path.join(os.environ["OUT"], f))))
print("check", d.get("check_linear_rel_diff_hopper_vs_reference"))
for r in d.get("linear_speedup_vs_bf16", []):
    print("LIN", r)
for r in d.get("single_chunk", []):
    print("SINGLE", {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()})
for k, v in d.items():
    if k.startswith("profile_"):
        print(k, "enqueue %.2f total %.2f" % (v["host_enqueue_ms"], v["host_total_ms"]))
        for n, ms, c in v["per_iteration_ms"][:8]:
            print("   %.3f x%d %s" % (ms, c, n[:70]))
for k in d:
    if k.endswith("_error"): print(k, d[k][-600:])
PY
