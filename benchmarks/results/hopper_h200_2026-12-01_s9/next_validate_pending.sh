# For the next session's first device call (not run yet): validate and time the pending packed
# store layout patch against main, then the layer with both. Needs .carry/scripts/ab_quant.py
# (a copy is beside this file) and main's src copied to .carry/old/src beforehand:
#   rm -rf .carry/old && mkdir -p .carry/old && git archive HEAD src | tar -x -C .carry/old
#   git apply benchmarks/results/hopper_h200_2026-12-01_s9/pending_packed_store_layout.patch
#   cp benchmarks/results/hopper_h200_2026-12-01_s9/ab_quant.py .carry/scripts/
# then carry .carry/scripts and .carry/old and run this file.
export PYTHONUNBUFFERED=1
PYTHONPATH=$PWD/src timeout 200 python -m pytest -q -x tests/test_kernels.py tests/test_quantize_both.py -p no:cacheprovider 2>&1 | tail -2
PYTHONPATH=$PWD/.carry/old/src timeout 60 python .carry/scripts/ab_quant.py old $OUT 2>&1 | grep -v Warn | tail -14
PYTHONPATH=$PWD/src timeout 60 python .carry/scripts/ab_quant.py new $OUT 2>&1 | grep -v Warn | tail -14
python - <<'PY'
import torch
a, b = torch.load("/tmp/ab_old.pt"), torch.load("/tmp/ab_new.pt")
for k in a:
    same = len(a[k]) == len(b[k]) and all(torch.equal(x, y) for x, y in zip(a[k], b[k]))
    print("BITS", "identical" if same else "DIFFER", k)
PY
PYTHONPATH=$PWD/src timeout 200 python benchmarks/bench_hopper.py --sections check,linear --shapes 4096,4096/14336,4096/4096,14336 \
  --recipes adahop_lv2,adahop_lv1,mxfp4 --no-emulation --rep 100 --out $OUT > $OUT/lin.log 2>&1; grep -A3 "speedup\|check" $OUT/lin.log | tail -20
