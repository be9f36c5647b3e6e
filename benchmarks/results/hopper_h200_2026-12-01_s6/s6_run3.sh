# Session 6, device run 3: bf16 and mxfp4_iht at seed 1 (held-out only), then the layer at 125M shapes.
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
mkdir -p runs/c125s1
tc="python benchmarks/train_compare.py --corpus .carry/corpus --preset h200_125m --no-report --out runs/c125s1 --seed 1 --tasks"
t0=$SECONDS
timeout 470 $tc --recipes bf16 > runs/c125s1/bf16.log 2>&1 &
timeout 470 $tc --recipes mxfp4_iht > runs/c125s1/mxfp4_iht.log 2>&1 &
wait
echo "wall $((SECONDS-t0)) s"; tail -n 2 runs/c125s1/*.log
(cd runs && tar czf $OUT/c125s1.tgz --exclude='*/checkpoints*' c125s1)
for s in 2048,768 768,2048 768,768; do
  timeout 40 python benchmarks/bench_hopper.py --sections linear --recipes adahop_lv2,mxfp4 --shapes $s --no-emulation --out $OUT 2>&1 | grep "  linear"
done
