# Session 10, device run 5: block maxima of the first pass on the butterfly before its norm
# (one multiplication per block instead of per element). GPU tests, A/B of every quantize form
# against the tree before (carried as .carry/old), bits compared; the layer's profile; 1B
# training, compiled, for adahop_lv1 and mxfp4.
export PYTHONUNBUFFERED=1
TEST_TIMEOUT=150 bash benchmarks/results/hopper_h200_2026-12-01_s9/s9_run7.sh
export PYTHONPATH=$PWD/src
timeout 150 python benchmarks/bench_hopper.py --sections linear,profile --shapes 14336,4096 \
  --recipes adahop_lv2,adahop_lv1,mxfp4,tseng --no-emulation --rep 100 --out $OUT > $OUT/lin.log 2>&1
grep -E "prof |host:" $OUT/lin.log | head -12
python -c "import json,os; r=json.load(open(os.environ['OUT']+'/bench_hopper.json')); print(r['linear_speedup_vs_bf16'])"
mkdir -p runs
for r in adahop_lv1 mxfp4; do
  timeout 130 python .carry/scripts/s9_speed.py $r 1b compile fused $OUT/run5_1b.jsonl 2>&1 | grep RESULT
done
