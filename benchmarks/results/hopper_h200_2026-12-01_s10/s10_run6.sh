# Session 10, device run 6: (a) the weight gradient written by the MXFP4 wgrad GEMM in the
# parameter's dtype (float32, row-wise scaled _scaled_mm with a float32 output: no autograd
# cast); (b) e4m3 emit: NaN blocks by a per-block factor (one select per block, not per element).
# GPU tests, A/B of the quantize forms against the tree before (.carry/old), the layer + profile.
export PYTHONUNBUFFERED=1
TEST_TIMEOUT=170 bash benchmarks/results/hopper_h200_2026-12-01_s9/s9_run7.sh 2>&1 | grep -E "passed|failed|Error|BITS|e4m3|both"
export PYTHONPATH=$PWD/src
timeout 40 python -m pytest -q -x tests/test_linear.py -k "autocast or parameter_dtype or hopper or gpu" -p no:cacheprovider 2>&1 | tail -1
timeout 150 python benchmarks/bench_hopper.py --sections check,linear,profile --shapes 14336,4096 \
  --recipes adahop_lv2,adahop_lv1,mxfp4,tseng --no-emulation --rep 100 --out $OUT > $OUT/lin.log 2>&1
grep -E "prof |host:" $OUT/lin.log | head -10
python -c "
import json,os; r=json.load(open(os.environ['OUT']+'/bench_hopper.json')); print(r['linear_speedup_vs_bf16']); print(r['check_linear_rel_diff_hopper_vs_reference'])
from adahop.ops.kernel_backends import HopperFP8Backend; import torch
b = HopperFP8Backend(); from adahop.ops.operand import OperandSpec
a = torch.randn(256, 128, device='cuda').bfloat16(); s = OperandSpec(hadamard_size=32)
c = b.mm_nt(b.quantize(a, 1, s), b.quantize(a, 1, s), torch.float32)
print('rowwise fp32 out:', HopperFP8Backend.rowwise_fp32_out, c.dtype)"
