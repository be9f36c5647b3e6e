# Session 7, device run 5: adahop_lv2 at 125M with OE k = 64 (the paper's and the library's
# default; the h200 presets use 16), seed 0, same corpus (corpus_id 0952065c...) as session 5's
# bf16 run (held-out 2.7844). Trainer's final held-out eval.
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
mkdir -p runs
timeout 520 python -m adahop.cli train --preset h200_125m --recipe adahop_lv2 --oe-k 64 --corpus .carry/corpus \
  --out runs/lv2_k64 --no-progress --threads 0 > $OUT/lv2_k64.log 2>&1; echo rc=$?
python - <<'PY'
import json, statistics
s = json.load(open("runs/lv2_k64/summary.json"))
recs = [json.loads(l) for l in open("runs/lv2_k64/log.jsonl")]
tps = [r["tok_per_s"] for r in recs if r.get("tok_per_s") and r["step"] > 45]
print("final_eval", json.dumps(s.get("final_eval"))[:600])
print(f"steady {statistics.median(tps):,.0f} tok/s, summary {s['tokens_per_s']:,.0f}, peak {s['peak_memory_bytes']/2**30:.2f} GiB")
PY
cd runs/lv2_k64 && cp summary.json config.json modes.json $OUT/ 2>/dev/null; gzip -c log.jsonl > $OUT/log.jsonl.gz
