# Session 10, device run 3: GPU tests; OE norms from the quantize pass (cost, agreement); the
# layer and its profile at (14336, 4096); torchao float8 in the same rows.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src
pip install --no-deps -q .carry/whl/torchao-0.18.0-*.whl 2>&1 | tail -1
timeout 170 python -m pytest -q -x tests/test_kernels.py tests/test_quantize_both.py tests/test_topk.py tests/test_linear.py -p no:cacheprovider 2>&1 | tail -2
timeout 60 python .carry/scripts/s10_norms.py $OUT 2>&1 | grep -v Warn
timeout 300 python benchmarks/bench_hopper.py --sections check,linear,profile,torchao \
  --shapes 14336,4096 --recipes adahop_lv2,adahop_lv1,mxfp4,tseng --no-emulation --rep 100 \
  --out $OUT > $OUT/lin.log 2>&1
grep -E "prof |host:" $OUT/lin.log | head -24
python - <<'PY'
import json, os
r = json.load(open(os.environ["OUT"] + "/bench_hopper.json"))
for k in ("linear_speedup_vs_bf16", "torchao_speedup_vs_bf16", "check_linear_rel_diff_hopper_vs_reference"):
    print(k, json.dumps(r.get(k))[:700])
PY
