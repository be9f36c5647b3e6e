# Session 8, device run 2: end-to-end training speed, one run at a time: 125M (100 steps,
# calibration 30) and 1B (Llama-3.2-1B's shape with our 8192 vocab; 50 steps, calibration 15),
# bf16 / adahop_lv2 / mxfp4, preset h200_125m (64 x 512 tokens per step), no evaluation.
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
mkdir -p runs
probe() {  # recipe size steps calib out
  python -m adahop.cli train --preset h200_125m --model-size $2 --steps $3 --calibration-steps $4 --recipe $1 \
    --corpus .carry/corpus --out $5 --no-progress --threads 0 > $5.log 2>&1
  python - $5 $4 <<'PY'
import json, sys, statistics, pathlib
d = pathlib.Path(sys.argv[1]); calib = int(sys.argv[2]); s = json.loads((d / "summary.json").read_text())
recs = [json.loads(l) for l in open(d / "log.jsonl")]
tps = [r["tok_per_s"] for r in recs if r.get("tok_per_s") and r["step"] > calib + 15]
print(f"PROBE {d.name}: steady {statistics.median(tps):,.0f} tok/s (n={len(tps)}), summary {s['tokens_per_s']:,.0f}, peak {s['peak_memory_bytes']/2**30:.2f} GiB, loss {s['losses'][-1]:.4f}")
PY
}
export -f probe
for r in bf16 adahop_lv2 mxfp4; do t0=$SECONDS; timeout 100 bash -c "probe $r 125m 100 30 runs/p125_$r"; echo "  wall $((SECONDS-t0)) s"; done
for r in bf16 adahop_lv2 mxfp4; do t0=$SECONDS; timeout 130 bash -c "probe $r 1b 50 15 runs/p1b_$r"; echo "  wall $((SECONDS-t0)) s"; tail -2 runs/p1b_$r.log; done
cd runs && tar czf $OUT/probes.tgz *.log */log.jsonl */summary.json */config.json */modes.json 2>/dev/null; ls $OUT
