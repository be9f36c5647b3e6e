# Session 9, device run 1: 1B training speed, eager vs per-block torch.compile, fused vs foreach AdamW.
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
mkdir -p runs
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python -c "import torch, triton; print(torch.__version__, triton.__version__)"
S=.carry/scripts/s9_speed.py
for spec in "bf16 eager foreach" "bf16 eager fused" "bf16 compile fused" "adahop_lv2 eager fused" "adahop_lv2 compile fused"; do
  set -- $spec
  timeout 150 python $S $1 1b $2 $3 $OUT/run1.jsonl 2>&1 | grep -v -i warn | tail -16
done
grep -h RESULT -r $OUT || true
