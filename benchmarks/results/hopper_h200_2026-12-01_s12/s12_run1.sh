# Session 12, device run 1: the layer with fresh gradients (x.grad and weight.grad dropped before
# each timed backward, as after zero_grad), at the four shapes, 5 alternating BF16 / recipe
# timings per ratio; then the form of the earlier runs (accumulate) at (14336, 4096) in the same call.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src
git log --oneline -1 2>/dev/null
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv
mkdir -p $OUT/fresh $OUT/acc
timeout 330 python benchmarks/bench_hopper.py --sections linear --recipes adahop_lv2,adahop_lv1,mxfp4,tseng \
  --no-emulation --rep 100 --pairs 5 --grads fresh --out $OUT/fresh > $OUT/lin_fresh.log 2>&1
grep -E "  linear|Error|\[linear\]" $OUT/lin_fresh.log
timeout 170 python benchmarks/bench_hopper.py --sections linear --recipes adahop_lv2,adahop_lv1 --shapes 14336,4096 \
  --no-emulation --rep 100 --pairs 5 --grads accumulate --out $OUT/acc > $OUT/lin_acc.log 2>&1
grep -E "  linear|Error|\[linear\]" $OUT/lin_acc.log
