# Session 9, device run 2: after compute_copies + SwiGLU order; 1B compiled (lv2 with an op-by-shape
# profile), 125M eager and compiled.
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
mkdir -p runs
S=.carry/scripts/s9_speed.py
PROF_SHAPES=1 timeout 150 python $S adahop_lv2 1b compile fused $OUT/run2.jsonl 2>&1 | grep -v -i warn | tail -40
timeout 120 python $S bf16 1b compile fused $OUT/run2.jsonl 2>&1 | grep RESULT
for spec in "bf16 eager" "bf16 compile" "adahop_lv2 eager" "adahop_lv2 compile"; do
  set -- $spec
  timeout 90 python $S $1 125m $2 fused $OUT/run2.jsonl 2>&1 | grep -v -i warn | tail -5
done
grep -h RESULT -r $OUT || true
