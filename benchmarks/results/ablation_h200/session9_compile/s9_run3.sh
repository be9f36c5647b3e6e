# Session 9, device run 3: the 125M quality runs of session 8 (h200_125m, seed 0) again, compiled,
# one after the other on the GPU (so their speed is comparable too).
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
mkdir -p runs/abl
for v in bf16 lv2; do
  timeout 280 python benchmarks/ablation.py --corpus .carry/corpus --out runs/abl --preset h200_125m --threads 0 \
    --variants $v --seeds 0 --compile > $OUT/abl_$v.log 2>&1
  tail -3 $OUT/abl_$v.log
done
python benchmarks/ablation.py --out runs/abl --report 2>&1 | tail -6
cd runs/abl && for d in */; do cp $d/ablation.json $OUT/${d%/}_ablation.json; gzip -c $d/log.jsonl > $OUT/${d%/}_log.jsonl.gz; done; cp ablation.md $OUT/
