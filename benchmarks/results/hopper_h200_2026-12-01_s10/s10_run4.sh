# Session 10, device run 4: the layer at the four Llama shapes and torchao float8 (compiled) in
# the same rows; then 1B training, compiled per block, bf16 vs adahop_lv2.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src
python -m pip install --no-deps -q .carry/whl/torchao-0.18.0-*.whl 2>&1 | grep -v -i "warn" | tail -1
python -c "import torchao; print('torchao', torchao.__version__)"
timeout 240 python benchmarks/bench_hopper.py --sections linear,torchao,memory --recipes adahop_lv2,adahop_lv1,mxfp4,tseng \
  --no-emulation --rep 100 --out $OUT > $OUT/lin.log 2>&1
python - <<'PY'
import json, os
r = json.load(open(os.environ["OUT"] + "/bench_hopper.json"))
for k in ("linear_speedup_vs_bf16", "torchao_speedup_vs_bf16"):
    for row in r.get(k, []):
        print(k[:8], json.dumps({a: (round(b, 3) if isinstance(b, float) else b) for a, b in row.items()})[:400])
PY
mkdir -p runs
for r in bf16 adahop_lv2; do
  timeout 140 python .carry/scripts/s9_speed.py $r 1b compile fused $OUT/run4_1b.jsonl 2>&1 | grep RESULT
done
