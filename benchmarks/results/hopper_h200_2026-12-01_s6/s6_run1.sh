# Session 6, device run 1: block-scaled GEMM bench, pending GPU tests, layer timings, 125m speed probes.
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python -c "import torch, triton; print(torch.__version__, triton.__version__)"
mkdir -p runs
timeout 170 python benchmarks/bench_hopper.py --sections block --recipes adahop_lv2,mxfp4 --out $OUT 2>&1 | grep -v "^ \|^{\|^}" | tail -30
cp $OUT/bench_hopper.json $OUT/block.json
timeout 150 python -m pytest -q tests/test_block_scaled.py tests/test_kernels.py tests/test_trainer.py -k "compile or gpu or block or group" 2>&1 | tail -4
timeout 150 python benchmarks/bench_hopper.py --sections quant,linear --recipes adahop_lv2,adahop_lv1,mxfp4 --shapes 14336,4096 --no-emulation --out $OUT 2>&1 | grep -v "^ \|^{\|^}" | tail -12
cp $OUT/bench_hopper.json $OUT/linear.json
probe() {  # recipe steps out
  python -m adahop.cli train --preset h200 --model-size 125m --steps $2 --recipe $1 --corpus .carry/corpus \
    --out $3 --no-progress --threads 0 > $3.log 2>&1
  python - $3 <<'PY'
import json, sys, gzip, statistics, pathlib
d = pathlib.Path(sys.argv[1]); s = json.loads((d / "summary.json").read_text())
recs = [json.loads(l) for l in open(d / "log.jsonl")] if (d / "log.jsonl").exists() else [json.loads(l) for l in gzip.open(d / "log.jsonl.gz", "rt")]
tps = [r["tok_per_s"] for r in recs if "tok_per_s" in r and r["step"] > 45]
med = statistics.median(tps); win = sorted(set(round(r["tok_per_s"]) for r in recs if r.get("tok_per_s") and r["step"] > 40))
print(f"{d.name}: steady {statistics.median(tps):,.0f} tok/s, summary {s['tokens_per_s']:,.0f}, peak {s['peak_memory_bytes']/2**30:.2f} GiB, loss {s['losses'][-1]:.3f}, windows after step 40 {win}")
PY
}
for r in bf16 adahop_lv2 mxfp4; do t0=$SECONDS; timeout 120 bash -c "$(declare -f probe); probe $r 100 runs/alone_$r"; echo "  wall $((SECONDS-t0)) s"; done
cd runs && tar czf $OUT/probes.tgz *.log */log.jsonl* */summary.json */config.json 2>/dev/null; ls $OUT
