"""hopper_fp8 on the CPU: the backend's operands and kernels (Triton, interpreted there) with its FP8
GEMM replaced by a float32 matmul of the e4m3 values times their row scales (exact products). The
tests of the layer's hopper_fp8 paths run on it."""

from adahop.ops.backends.hopper_fp8 import HopperFP8Backend


class EmulatedHopper(HopperFP8Backend):
    def mm_nt(self, a, b, out_dtype):
        a, b = self.as_e4m3(a), self.as_e4m3(b)
        return ((a.e4m3.float() * a.row_scale[:, None]) @ (b.e4m3.float() * b.row_scale[:, None]).t()).to(out_dtype)
