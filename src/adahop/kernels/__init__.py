"""Triton kernels (imported only where triton is installed; defined whatever the GPU, so they
run on the CPU under ``TRITON_INTERPRET=1``; the hardware is chosen in ``ops.backends``).

* ``quantize``: fused [random signs +] block Hadamard + MXFP4 quantization of a GEMM operand,
  writing the packed form and/or the e4m3 + row-scale form of the Hopper FP8 GEMM;
* ``quantize_both``: both orientations of one operand from the same reads (the backward's
  gradient, the forward's activation);
* ``unpack``: packed MXFP4 (what the forward saves) -> e4m3 + row scale;
* ``magnitude``: each row's and column's largest magnitude from one read (the gradient's bounds);
* ``topk``: outlier extraction's selection of the k largest slice norms in one launch;
* ``mx_gemm``: the GEMM of two packed MXFP4 operands through ``tl.dot_scaled`` (MX tensor cores);
* ``mxfp4_math``: the device functions they share, mirroring the reference numerics;
* ``launch``: the host side (``FastLauncher``: less host time per launch) and launch helpers.
"""
