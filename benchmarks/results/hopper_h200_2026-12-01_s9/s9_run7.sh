# Session 9, device run 7: the E2M1 encoders by exponent bits (no compare predicates, no F2I).
# GPU tests of the kernels, A/B of every quantize form (old tree = the commit before, new = this
# tree), then a byte-for-byte comparison of their outputs.
export PYTHONUNBUFFERED=1
TEST_TIMEOUT=${TEST_TIMEOUT:-80}  # run 7 used 80 s, which cut the tests at ~85%
PYTHONPATH=$PWD/src timeout $TEST_TIMEOUT python -m pytest -q -x tests/test_kernels.py tests/test_quantize_both.py -p no:cacheprovider 2>&1 | tail -2
PYTHONPATH=$PWD/.carry/old/src timeout 60 python .carry/scripts/ab_quant.py old $OUT 2>&1 | grep -v Warn | tail -16
PYTHONPATH=$PWD/src timeout 60 python .carry/scripts/ab_quant.py new $OUT 2>&1 | grep -v Warn | tail -16
python - <<'PY'
import torch
a, b = torch.load("/tmp/ab_old.pt"), torch.load("/tmp/ab_new.pt")
for k in a:
    same = len(a[k]) == len(b[k]) and all(torch.equal(x, y) for x, y in zip(a[k], b[k]))
    print("BITS", "identical" if same else "DIFFER", k)
PY
