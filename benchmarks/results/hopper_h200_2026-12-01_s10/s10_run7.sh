# Session 10, device run 7: 1B training, compiled per block, bf16 vs adahop_lv2, with the final
# code of the session (fp32 weight gradients from the MXFP4 wgrad GEMM).
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src
mkdir -p runs
for r in bf16 adahop_lv2; do
  timeout 135 python .carry/scripts/s9_speed.py $r 1b compile fused $OUT/run7_1b.jsonl 2>&1 | grep RESULT
done
