# For the next session's first device call (not run yet): validate and time the pending packed
# store layout patch against main, then the layer with it. Prepare, in the repository root:
#   rm -rf .carry/old && mkdir -p .carry/old && git archive HEAD src | tar -x -C .carry/old
#   git apply benchmarks/results/hopper_h200_2026-12-01_s9/pending_packed_store_layout.patch
#   cp benchmarks/results/hopper_h200_2026-12-01_s8/ab_quant.py .carry/scripts/
# then carry .carry/scripts and .carry/old and run this file.
# GPU kernel tests (given the time they need), A/B of every quantize form, bits old vs new:
TEST_TIMEOUT=200 bash benchmarks/results/hopper_h200_2026-12-01_s9/s9_run7.sh
# the layer, forward + backward, against BF16 nn.Linear (JSON in $OUT/bench_hopper.json)
PYTHONPATH=$PWD/src timeout 200 python benchmarks/bench_hopper.py --sections check,linear \
  --shapes 4096,4096/14336,4096/4096,14336 --recipes adahop_lv2,adahop_lv1,mxfp4 --no-emulation --rep 100 \
  --out $OUT > $OUT/lin.log 2>&1
tail -5 $OUT/lin.log
