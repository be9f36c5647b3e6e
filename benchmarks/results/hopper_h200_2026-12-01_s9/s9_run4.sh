# Session 9, device run 4: 1B compiled training speed of the other MXFP4 recipes.
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
mkdir -p runs
S=.carry/scripts/s9_speed.py
for r in adahop_lv1 mxfp4 tseng; do
  timeout 125 python $S $r 1b compile fused $OUT/run4.jsonl 2>&1 | grep RESULT
done
