# Session 7, device run 9: the forward's x quantized both ways from one kernel (e4m3 along K,
# packed along T). GPU tests first, then the kernel against two calls, then the layer.
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
timeout 150 python -m pytest -q -x tests/test_quantize_both.py tests/test_launch.py 2>&1 | tail -3
timeout 60 python benchmarks/bench_hopper.py --sections bothx --out $OUT > $OUT/bothx.log 2>&1
mv $OUT/bench_hopper.json $OUT/bothx.json; grep "both x" $OUT/bothx.log
timeout 150 python benchmarks/bench_hopper.py --sections check,linear --shapes 2048,768/8192,2048/4096,4096/6144,4096/14336,4096/4096,14336 \
  --recipes adahop_lv2,mxfp4 --no-emulation --rep 100 --out $OUT > $OUT/lin.log 2>&1
python - <<'PY'
import json, os
d = json.load(open(os.path.join(os.environ["OUT"], "bench_hopper.json")))
print("check", d.get("check_linear_rel_diff_hopper_vs_reference"))
for r in d.get("linear_speedup_vs_bf16", []): print("LIN", {k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()})
for k in d:
    if k.endswith("_error"): print(k, d[k][-800:])
PY
