# Session 8, device run 5: lv2_fprop_oe_right at 125M with seed 1 (lv2 s1: 2.7980, bf16 s1: 2.7707,
# session 6) and bf16 seed 0 again (session 5: 2.7844), two processes sharing the GPU.
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
mkdir -p runs/abl
timeout 500 python benchmarks/ablation.py --corpus .carry/corpus --out runs/abl --preset h200_125m --threads 0 \
    --variants lv2_fprop_oe_right --seeds 1 > $OUT/abl_oer_s1.log 2>&1 &
timeout 500 python benchmarks/ablation.py --corpus .carry/corpus --out runs/abl --preset h200_125m --threads 0 \
    --variants bf16 --seeds 0 > $OUT/abl_bf16_s0.log 2>&1 &
wait
python benchmarks/ablation.py --out runs/abl --report 2>&1 | tail -12
cd runs/abl && for d in */; do cp $d/ablation.json $OUT/${d%/}_ablation.json; gzip -c $d/log.jsonl > $OUT/${d%/}_log.jsonl.gz; done
