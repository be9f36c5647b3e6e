# Session 12, device run 3: training speed of every recipe at SIZE (125m or 1b), compiled per block,
# one run at a time on the GPU: steady tokens/s over steps 30-60 of 64 x 512 tokens (calibration
# 10 steps for the adaptive recipes), peak memory, CUDA kernel time per step (s9_speed.py).
# bf16 first and last (its drift across the call). bash s12_run3.sh SIZE PER_RUN_TIMEOUT
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src
git log --oneline -1 2>/dev/null
mkdir -p runs
for r in bf16 adahop_lv2 adahop_lv1 mxfp4 mxfp4_iht tseng bf16; do
  t0=$SECONDS
  timeout $2 python .carry/scripts/s9_speed.py $r $1 compile fused $OUT/speed_$1.jsonl > $OUT/last.log 2>&1
  echo "rc $? wall $((SECONDS-t0)) s $(grep RESULT $OUT/last.log)"
done
