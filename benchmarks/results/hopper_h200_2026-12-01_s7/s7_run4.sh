# Session 7, device run 4: the layer at (14336, 4096) in a fresh process (lv2 vs lv1, whose modes
# are the same here), then 125M training speed probes (100 steps each, one at a time).
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
timeout 100 python benchmarks/bench_hopper.py --sections linear --shapes 14336,4096 --recipes adahop_lv1,adahop_lv2,mxfp4 \
  --no-emulation --rep 100 --out $OUT > $OUT/lin.log 2>&1
mv $OUT/bench_hopper.json $OUT/linear_14336x4096.json; grep "linear" $OUT/lin.log | tail -2
mkdir -p runs
probe() {  # recipe steps out
  python -m adahop.cli train --preset h200_125m --steps $2 --recipe $1 --corpus .carry/corpus \
    --out $3 --no-progress --threads 0 > $3.log 2>&1
  python - $3 <<'PY'
import json, sys, statistics, pathlib
d = pathlib.Path(sys.argv[1]); s = json.loads((d / "summary.json").read_text())
recs = [json.loads(l) for l in open(d / "log.jsonl")]
tps = [r["tok_per_s"] for r in recs if r.get("tok_per_s") and r["step"] > 45]
print(f"{d.name}: steady {statistics.median(tps):,.0f} tok/s, summary {s['tokens_per_s']:,.0f}, peak {s['peak_memory_bytes']/2**30:.2f} GiB, loss {s['losses'][-1] if s.get('losses') else 'n/a'}")
PY
}
for r in bf16 adahop_lv2 mxfp4; do t0=$SECONDS; timeout 130 bash -c "$(declare -f probe); probe $r 100 runs/probe_$r"; echo "  wall $((SECONDS-t0)) s"; done
cd runs && tar czf $OUT/probes.tgz *.log */log.jsonl */summary.json */config.json 2>/dev/null; ls $OUT
