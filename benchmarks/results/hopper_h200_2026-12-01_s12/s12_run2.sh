# Session 12, device run 2: fresh gradients (as after zero_grad). torchao float8 rowwise and
# tensorwise (compiled) in the rows of adahop_lv2/lv1 (5 pairs each, one BF16 baseline);
# the layer at (14336, 4096) with 11 pairs; the saved-tensor memory.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/src
git log --oneline -1 2>/dev/null
python -m pip install --no-deps -q .carry/whl/torchao-0.18.0-*.whl 2>&1 | grep -v -i "warn" | tail -1
mkdir -p $OUT/ao $OUT/lin11
timeout 250 python benchmarks/bench_hopper.py --sections torchao,memory --recipes adahop_lv2,adahop_lv1 \
  --no-emulation --rep 100 --pairs 5 --grads fresh --out $OUT/ao > $OUT/ao.log 2>&1
timeout 200 python benchmarks/bench_hopper.py --sections linear --shapes 14336,4096 --recipes adahop_lv2,adahop_lv1,mxfp4,tseng \
  --no-emulation --rep 100 --pairs 11 --grads fresh --out $OUT/lin11 > $OUT/lin11.log 2>&1
grep -E "Error|error" $OUT/*.log | head -5
python - <<'PY'
import json, os
for d in ("ao", "lin11"):
    r = json.load(open(os.environ["OUT"] + f"/{d}/bench_hopper.json"))
    for k in ("linear_speedup_vs_bf16", "torchao_speedup_vs_bf16"):
        for row in r.get(k, []):
            print(d, json.dumps({a: (round(b, 3) if isinstance(b, float) else b) for a, b in row.items() if a != "times_ms"})[:400])
    if "saved_bytes" in r:
        print({k: round(v["ratio_vs_bf16"], 2) for k, v in r["saved_bytes"].items() if v["ratio_vs_bf16"]})
PY
