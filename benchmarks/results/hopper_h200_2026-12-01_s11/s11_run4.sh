# Session 11, device run 4: 1B training, compiled per block, bf16 vs adahop_lv2 (steady steps
# 30-60 of 64 x 512 tokens), with this session's kernels.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src
mkdir -p runs
for r in bf16 adahop_lv2 bf16; do
  timeout 135 python .carry/scripts/s9_speed.py $r 1b compile fused $OUT/run4_1b.jsonl 2>&1 | grep RESULT
done
