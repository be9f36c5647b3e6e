# Session 11, device run 5: the 125M quality runs (h200_125m, seed 0), compiled, with this session's code
# (fp32 weight gradients from the wgrad GEMM since session 10; same runs as session 9 run 3).
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
mkdir -p runs/abl
for v in bf16 lv2; do
  timeout 280 python benchmarks/ablation.py --corpus .carry/corpus --out runs/abl --preset h200_125m --threads 0 \
    --variants $v --seeds 0 --compile > $OUT/abl_$v.log 2>&1
  tail -3 $OUT/abl_$v.log
done
python benchmarks/ablation.py --out runs/abl --report 2>&1 | tail -6
cd runs/abl && for d in */; do cp $d/ablation.json $OUT/${d%/}_ablation.json; gzip -c $d/log.jsonl > $OUT/${d%/}_log.jsonl.gz; done; cp ablation.md $OUT/
