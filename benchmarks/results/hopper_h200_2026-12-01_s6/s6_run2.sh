# Session 6, device run 2: adahop_lv1 at 125M (seed 0, with zero-shot), adahop_lv2 and mxfp4 at seed 1 (held-out only).
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
mkdir -p runs/c125 runs/c125s1
tc="python benchmarks/train_compare.py --corpus .carry/corpus --preset h200_125m --no-report"
t0=$SECONDS
timeout 540 $tc --out runs/c125 --recipes adahop_lv1 --tasks-dir .carry/tasks > runs/c125/lv1.log 2>&1 &
timeout 540 $tc --out runs/c125s1 --seed 1 --recipes adahop_lv2 --tasks > runs/c125s1/lv2.log 2>&1 &
timeout 540 $tc --out runs/c125s1 --seed 1 --recipes mxfp4 --tasks > runs/c125s1/mxfp4.log 2>&1 &
wait
echo "wall $((SECONDS-t0)) s"; tail -n 3 runs/c125/*.log runs/c125s1/*.log
cd runs && tar czf $OUT/c125.tgz --exclude='*/checkpoints*' --exclude='*.pt' c125 c125s1; ls -la $OUT; du -sh c125/adahop_lv1/* | head
