# Session 10, device run 1: validate the pending packed-store layout (tests, A/B bits + times),
# then the layer at (14336, 4096) and its profile.
export PYTHONUNBUFFERED=1
TEST_TIMEOUT=150 bash benchmarks/results/hopper_h200_2026-12-01_s9/s9_run7.sh
PYTHONPATH=$PWD/src timeout 240 python benchmarks/bench_hopper.py --sections check,linear,profile \
  --shapes 14336,4096 --recipes adahop_lv2,adahop_lv1,mxfp4,tseng --no-emulation --rep 100 \
  --out $OUT > $OUT/lin.log 2>&1
grep -v "^ *[0-9]* *[0-9.]* *[0-9.]* *[0-9.]* *[0-9.]* " $OUT/lin.log | grep -E "x |prof|host|speed|lv|mxfp4|tseng" | tail -45
