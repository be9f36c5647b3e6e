# Session 11, device run 1: top-k keys only in registers; one launch for PHASE 1's row maxima;
# float32 weight rounded to bf16 in the quantize kernel's loads (plain fprop/dgrad modes).
# GPU tests, A/B of the quantize forms (old tree = HEAD before), micro-benchmarks, the layer.
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
PYTHONPATH=$PWD/src timeout 200 python -m pytest -q -x tests/test_kernels.py tests/test_quantize_both.py tests/test_topk.py -p no:cacheprovider 2>&1 | tail -2
PYTHONPATH=$PWD/src timeout 60 python -m pytest -q -x tests/test_linear.py -k "autocast or parameter_dtype or hopper or gpu" -p no:cacheprovider 2>&1 | tail -1
PYTHONPATH=$PWD/.carry/old/src timeout 60 python .carry/scripts/ab_quant.py old $OUT 2>&1 | grep -v Warn | tail -16 > /dev/null
PYTHONPATH=$PWD/src timeout 60 python .carry/scripts/ab_quant.py new $OUT 2>&1 | grep -v Warn | tail -16 > /dev/null
python - <<'PY'
import torch, json, os
a, b = torch.load("/tmp/ab_old.pt"), torch.load("/tmp/ab_new.pt")
for k in a:
    same = len(a[k]) == len(b[k]) and all(torch.equal(x, y) for x, y in zip(a[k], b[k]))
    print("BITS", "identical" if same else "DIFFER", k)
o, n = (json.load(open(os.environ["OUT"] + f"/ab_{t}.json")) for t in ("old", "new"))
for r0, r1 in zip(o["rows"], n["rows"]):
    print(f"{r0['case']:45s} {r0['ms']:.3f} -> {r1['ms']:.3f} ms")
PY
PYTHONPATH=$PWD/.carry/old/src timeout 60 python .carry/scripts/s11_micro.py old $OUT 2>&1 | grep topk
PYTHONPATH=$PWD/src timeout 90 python .carry/scripts/s11_micro.py new $OUT 2>&1 | grep -v Warn
export PYTHONPATH=$PWD/src
timeout 200 python benchmarks/bench_hopper.py --sections check,linear,profile --shapes 14336,4096 \
  --recipes adahop_lv2,adahop_lv1,mxfp4,tseng --no-emulation --rep 100 --out $OUT > $OUT/lin.log 2>&1
grep -E "prof |host:" $OUT/lin.log | head -14
python -c "
import json,os; r=json.load(open(os.environ['OUT']+'/bench_hopper.json')); print(r['linear_speedup_vs_bf16']); print(r.get('check_linear_rel_diff_hopper_vs_reference'))"
