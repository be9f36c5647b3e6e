# Session 8, device run 4: adahop_lv2 with fprop forced to OE-right (the k = 16 largest-norm rows of
# w in BF16) at 125M, next to adahop_lv2 itself, seed 0, two processes sharing the GPU (quality
# only). benchmarks/ablation.py also evaluates each run's weights with every GEMM in BF16.
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
mkdir -p runs/abl
for v in lv2_fprop_oe_right lv2; do
  timeout 560 python benchmarks/ablation.py --corpus .carry/corpus --out runs/abl --preset h200_125m --threads 0 \
    --variants $v --seeds 0 > $OUT/abl_$v.log 2>&1 &
done
wait
python benchmarks/ablation.py --out runs/abl --report 2>&1 | tail -12
cd runs/abl && for d in */; do cp $d/ablation.json $OUT/${d%/}_ablation.json; gzip -c $d/log.jsonl > $OUT/${d%/}_log.jsonl.gz; done; cp ablation.md $OUT/
