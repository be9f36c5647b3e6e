# Session 7, device run 10: A/B on one machine: the code of run 3 (commit 2047d90, in .carry/old)
# against this commit, the layer at (4096, 4096) and (2048, 768), then this commit's profile.
export PYTHONUNBUFFERED=1
for side in old new; do
  if [ $side = old ]; then export PYTHONPATH=$PWD/.carry/old/src; B=.carry/old/benchmarks/bench_hopper.py; else export PYTHONPATH=$PWD/src; B=benchmarks/bench_hopper.py; fi
  timeout 80 python $B --sections linear --shapes 4096,4096/2048,768 --recipes adahop_lv2 --no-emulation --rep 100 --out $OUT > $OUT/$side.log 2>&1
  mv $OUT/bench_hopper.json $OUT/ab_$side.json
  python -c "import json; [print('$side', r) for r in json.load(open('$OUT/ab_$side.json'))['linear_speedup_vs_bf16']]"
done
timeout 60 python benchmarks/bench_hopper.py --sections profile --shapes 4096,4096 --out $OUT > $OUT/prof.log 2>&1
python -c "
import json; d=json.load(open('$OUT/bench_hopper.json'))['profile_4096x4096']; print('enqueue', d['host_enqueue_ms'], 'total', d['host_total_ms'], 'gpu', sum(r[1] for r in d['per_iteration_ms']))"
