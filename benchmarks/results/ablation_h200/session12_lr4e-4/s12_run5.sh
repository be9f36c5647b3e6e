# Session 12, device run 5: the 125M quality pair at the paper's peak lr (4e-4, the library's
# default; the h200_125m preset uses 1e-3), compiled, seed 0, bf16 and adahop_lv2 side by side on
# the one GPU (quality only: their tokens/s are shared).
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
git log --oneline -1 2>/dev/null
mkdir -p runs/abl
for v in bf16 lv2; do
  timeout 470 python benchmarks/ablation.py --corpus .carry/corpus --out runs/abl --preset h200_125m --threads 0 \
    --variants $v --seeds 0 --compile --lr 4e-4 > $OUT/abl_$v.log 2>&1 &
done
wait
tail -2 $OUT/abl_*.log
python benchmarks/ablation.py --out runs/abl --report 2>&1 | tail -6
cd runs/abl && for d in */; do cp $d/ablation.json $OUT/${d%/}_ablation.json; gzip -c $d/log.jsonl > $OUT/${d%/}_log.jsonl.gz; done; cp ablation.md $OUT/
