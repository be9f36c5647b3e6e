# Session 7, device run 8: CUDA-graph timing probe (what removing the host's share would give).
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
timeout 240 python benchmarks/bench_hopper.py --sections graph --shapes 2048,768/8192,2048/4096,4096 \
  --recipes adahop_lv2,mxfp4 --rep 100 --out $OUT > $OUT/graph.log 2>&1
grep -v "^ \|^{\|^}" $OUT/graph.log | tail -5
python - <<'PY'
import json, os
d = json.load(open(os.path.join(os.environ["OUT"], "bench_hopper.json")))
for r in d.get("graph", []):
    print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()})
for k in d:
    if k.endswith("_error"): print(k, d[k][-800:])
PY
