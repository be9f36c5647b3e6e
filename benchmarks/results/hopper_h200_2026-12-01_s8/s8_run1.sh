# Session 8, device run 1: the per-block scale-byte store. GPU tests of the kernels, A/B of every
# quantize form (old tree = 93c17f4, new = this tree), bit comparison old vs new, then the layer.
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
PYTHONPATH=$PWD/src timeout 200 python -m pytest -q -x tests/test_kernels.py tests/test_quantize_both.py tests/test_launch.py 2>&1 | tail -3
PYTHONPATH=$PWD/.carry/old/src timeout 100 python .carry/scripts/ab_quant.py old $OUT 2>&1 | grep -v Warn
PYTHONPATH=$PWD/src timeout 100 python .carry/scripts/ab_quant.py new $OUT 2>&1 | grep -v Warn
python - <<'PY'
import torch
a, b = torch.load("/tmp/ab_old.pt"), torch.load("/tmp/ab_new.pt")
for k in a:
    same = len(a[k]) == len(b[k]) and all(torch.equal(x, y) for x, y in zip(a[k], b[k]))
    print("BITS", "identical" if same else "DIFFER", k)
PY
export PYTHONPATH=$PWD/src
timeout 200 python benchmarks/bench_hopper.py --sections check,linear --shapes 4096,4096/14336,4096/4096,14336 \
  --recipes adahop_lv2,adahop_lv1,mxfp4 --no-emulation --rep 100 --out $OUT > $OUT/lin.log 2>&1
python - <<'PY'
import json, os
d = json.load(open(os.path.join(os.environ["OUT"], "bench_hopper.json")))
print("check", d.get("check_linear_rel_diff_hopper_vs_reference"))
for r in d.get("linear_speedup_vs_bf16", []): print("LIN", {k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()})
for k in d:
    if k.endswith("_error"): print(k, d[k][-800:])
PY
