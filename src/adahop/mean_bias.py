"""The activation's mean over tokens taken out of the forward GEMM's MXFP4 operand and added back as
a rank-one high-precision term (``AdaHOPConfig.fprop_mean_bias``; "The Curse and Blessing of Mean
Bias in FP4-quantized LLM training", arXiv 2603.10444).

A pretrained model's activations share a large mean over tokens (on SmolLM2-135M's block linears
it holds 37% of X's energy on average: benchmarks/results/fprop_bias_smollm2_cpu_2026-12-07). In
MXFP4 that common part sets the blocks' scales and takes its share of the rounding, token by
token. Split x_TK = 1 mu_K + r_TK (mu the mean over the call's T rows); fprop is then

    y_TN = Q(r) Q(W)^T + 1 (mu W^T)

where the first term is the layer's fprop GEMM in its mode (its Hadamard, rounding, OE) with r in
place of x, and mu W^T is one GEMV in x's dtype (BF16 under autocast) added to every row.

Numerics (what the option means): mu is the float32 mean of x's rows, rounded to x's dtype;
r = x - mu in x's dtype; the GEMV multiplies mu by the weight fprop's B is made from, cast to x's
dtype; its result, in x's dtype, is added to the GEMM's output in the output's dtype. The split
and the GEMV are PyTorch ops in ``layer.gemms``, above the backends, whose GEMM quantizes r as it
would x: every backend runs the option. The mean is the call's: every row of one call shares it
(a call's tokens are the batch's sequences flattened), so a token's rounding depends on the
other tokens of its call, as a per-tensor scale's would.

The backward is unchanged: dgrad (dx = g W) and wgrad (dW = g^T x, x quantized along T, its
mean kept) are the layer's GEMMs as without the option. They are the exact derivatives of
x W^T, which the split leaves as it is (1 mu W^T + r W^T = x W^T: the term is linear in the
mean); the quantization is passed straight through, as everywhere in the layer.
"""

from __future__ import annotations

import torch


def split_mean(x_TK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mu_1K, r_TK)``: the mean of ``x_TK``'s rows (computed in float32, rounded to x's dtype)
    and x with it taken out, ``x - mu`` in x's dtype."""
    mu_1K = x_TK.float().mean(0, keepdim=True).to(x_TK.dtype)
    return mu_1K, x_TK - mu_1K


def add_mean_term(y_TN: torch.Tensor, mu_1K: torch.Tensor, w_NK: torch.Tensor) -> torch.Tensor:
    """``y_TN + mu W^T`` on every row: the GEMV in ``mu``'s dtype (``w_NK`` cast to it), added in
    y's dtype."""
    return y_TN + (mu_1K @ w_NK.to(mu_1K.dtype).t()).to(y_TN.dtype)
