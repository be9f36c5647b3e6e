# Session 8, device run 3: where a 1B training step's time goes (bf16, adahop_lv2): three steps
# after calibration under torch.profiler.
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
mkdir -p runs
for r in bf16 adahop_lv2; do timeout 200 python .carry/scripts/prof_train.py $r 1b $OUT 2>&1 | grep -v Warn | tail -28; done
