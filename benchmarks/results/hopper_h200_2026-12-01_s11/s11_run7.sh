# Session 11, device run 7: the final code (HEAD), the layer at the four shapes, 5 alternating
# BF16 / recipe timings per ratio.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src
git log --oneline -1 2>/dev/null
timeout 300 python benchmarks/bench_hopper.py --sections linear --recipes adahop_lv2,adahop_lv1,mxfp4,tseng \
  --no-emulation --rep 100 --pairs 5 --out $OUT > $OUT/lin.log 2>&1
grep -E "  linear|Error" $OUT/lin.log
