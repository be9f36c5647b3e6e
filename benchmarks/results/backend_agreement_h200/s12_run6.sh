# Session 12, device run 6: adahop_lv2 trained on the reference backend (dequantize + float32
# matmul) and on hopper_fp8, side by side on the one GPU, same model (20m), data, seed and steps;
# then the step-by-step comparison (benchmarks/backend_agreement.py --report-only).
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
mkdir -p runs/agree
for b in reference hopper_fp8; do
  timeout 330 python -m adahop.cli train --preset h200 --recipe adahop_lv2 --corpus .carry/corpus --out runs/agree/$b \
    --backend $b --steps 300 --no-progress --threads 0 --no-resume > $OUT/train_$b.log 2>&1 &
done
wait
tail -n 2 $OUT/train_*.log
python benchmarks/backend_agreement.py --corpus .carry/corpus --out runs/agree --preset h200 --steps 300 \
  --backends reference hopper_fp8 --report-only > $OUT/agreement.log 2>&1
cat $OUT/agreement.log | tail -25
cp runs/agree/agreement.md runs/agree/agreement.json runs/agree/loss_curves.png $OUT/
cd runs/agree && tar czf $OUT/runs.tgz */config.json */log.jsonl */modes.json */summary.json 2>/dev/null
