# For a later session's device call (not run yet): validate and time the pending top-k patch
# (pending_topk_keys_only.patch: keys only in registers, no valid/offset arrays). Offline it
# takes the 16,384-value kernel from 255 registers + 128 bytes of stack (spills) to 237 and none;
# bit-identical on the CPU (tests/test_topk.py). Prepare in the repository root:
#   rm -rf .carry/old && mkdir -p .carry/old && git archive HEAD src | tar -x -C .carry/old
#   git apply benchmarks/results/hopper_h200_2026-12-01_s10/pending_topk_keys_only.patch
# then carry .carry/old and run this file.
export PYTHONUNBUFFERED=1
PYTHONPATH=$PWD/src timeout 60 python -m pytest -q tests/test_topk.py -p no:cacheprovider 2>&1 | tail -1
for tree in .carry/old/src src; do
PYTHONPATH=$PWD/$tree python - <<'PY'
import torch
from triton.testing import do_bench
from adahop.kernels.topk import topk_indices
for n in (4096, 16384, 32768):
    v = torch.randn(n, device="cuda")
    print(n, f"{do_bench(lambda: topk_indices(v, 64), warmup=25, rep=200) * 1e3:.1f} us", topk_indices(v, 64)[:4].tolist())
PY
done
