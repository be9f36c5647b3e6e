"""Top-k selection for outlier extraction: the indices of the k largest of n float32 values, in
ascending index order, in one launch.

Outlier extraction ranks a GEMM operand's outer slices by L2 norm and sends the k largest to a
high-precision GEMM. ``torch.topk`` followed by a sort of the indices takes two launches plus
small ones: 0.089 ms for n = 16384 on the H200 (a single-block radix select and a sort); this
kernel takes one launch, 0.031 ms (0.014 ms for n = 4096; docs/kernels.md, 'Outlier selection
(top-k)').

Selection rule (``ops.outliers.largest_k``, the reference): the k largest values, NaN
above +inf, ties at the k-th value broken by the lower index. One program, no atomics, so the
result is deterministic:

1. each value becomes a uint32 key whose unsigned order is the float order (negative floats:
   all bits flipped; others: the sign bit set; NaN: 0xFFFFFFFF);
2. the k-th largest key, bit by bit from the top: keep bit b of the threshold if at least k keys
   are >= (the bits kept so far | bit b) (32 counting passes);
3. the keys above the threshold, and the first (k - their count) keys equal to it, are written
   at their rank among the selected (a prefix sum), so the indices come out sorted.

Values up to ``BLOCK`` stay in registers across the 32 passes; longer inputs are re-read per
pass (from L2 at the sizes OE sees: one value per token or feature).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from adahop.kernels.launch import FastLauncher, next_power_of_2


@triton.jit
def _order_key(v):
    bits = v.to(tl.uint32, bitcast=True)
    key = tl.where((bits >> 31) != 0, bits ^ 0xFFFFFFFF, bits | 0x80000000)
    return tl.where(v != v, 0xFFFFFFFF, key)


@triton.jit
def _load_keys(v_ptr, start, n, BLOCK: tl.constexpr):
    """The order keys of values [start, start + BLOCK); 0 past n. Every value's key is at least 1
    (a key of 0 would be the bits 0xFFFFFFFF, a NaN, whose key is 0xFFFFFFFF), and every
    candidate threshold is at least 1, so no mask has to be carried along: padding never counts,
    never ties and is never taken (fewer live registers: the keys alone)."""
    offs = start + tl.arange(0, BLOCK)
    v = tl.load(v_ptr + offs, mask=offs < n, other=0.0)
    return tl.where(offs < n, _order_key(v), 0)


@triton.jit
def _topk_kernel(v_ptr, out_ptr, n, k, BLOCK: tl.constexpr, ONE_BLOCK: tl.constexpr):
    if ONE_BLOCK:
        key = _load_keys(v_ptr, 0, n, BLOCK)
    thr = tl.full((), 0, tl.uint32)
    bit = tl.full((), 0x80000000, tl.uint32)
    for _ in range(32):
        cand = thr | bit
        bit = bit >> 1
        if ONE_BLOCK:
            count = tl.sum((key >= cand).to(tl.int32), axis=0)
        else:
            count = 0
            for start in range(0, n, BLOCK):
                key = _load_keys(v_ptr, start, n, BLOCK)
                count += tl.sum((key >= cand).to(tl.int32), axis=0)
        thr = tl.where(count >= k, cand, thr)
    # thr is the k-th largest key (>= 1, as k <= n): take every key above it and the first ties.
    if ONE_BLOCK:
        n_above = tl.sum((key > thr).to(tl.int32), axis=0)
    else:
        n_above = 0
        for start in range(0, n, BLOCK):
            key = _load_keys(v_ptr, start, n, BLOCK)
            n_above += tl.sum((key > thr).to(tl.int32), axis=0)
    ties_wanted = k - n_above
    written = 0
    ties_seen = 0
    for start in range(0, n, BLOCK):
        if not ONE_BLOCK:
            key = _load_keys(v_ptr, start, n, BLOCK)
        tie = key == thr
        tie_rank = tl.cumsum(tie.to(tl.int32), axis=0) + ties_seen  # 1-based among all ties
        sel = (key > thr) | (tie & (tie_rank <= ties_wanted))
        pos = written + tl.cumsum(sel.to(tl.int32), axis=0) - 1
        offs = start + tl.arange(0, BLOCK)
        tl.store(out_ptr + pos, offs.to(tl.int64), mask=sel)
        written += tl.sum(sel.to(tl.int32), axis=0)
        ties_seen += tl.sum(tie.to(tl.int32), axis=0)


_TOPK = FastLauncher(_topk_kernel)
# Values held in registers: up to 64 per thread, with 4, 8 or 16 warps. 32,768 covers OE's
# selection over the tokens of a 64 x 512 batch in one read; the re-read path for it takes 0.122
# to 0.143 ms on the H200, against 0.031 ms for 16,384 values held.
MAX_BLOCK = 32768


def _warps(block: int) -> int:
    return 16 if block >= 32768 else 8 if block >= 4096 else 4


def topk_indices(values: torch.Tensor, k: int) -> torch.Tensor:
    """Sorted int64 indices of the ``min(k, n)`` largest entries of 1-D float32 ``values`` (NaN
    largest; ties: the lower index first)."""
    if values.dim() != 1 or values.dtype != torch.float32:
        raise ValueError(f"topk_indices takes a 1-D float32 tensor, got {values.dtype} of shape {tuple(values.shape)}")
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"k must be a non-negative int, got {k!r}")
    n = values.numel()
    k = min(k, n)
    out = torch.empty((k,), dtype=torch.int64, device=values.device)
    if k == 0:
        return out
    if n >= 2**31:
        raise ValueError(f"topk_indices takes fewer than 2**31 values, got {n}")
    block = min(MAX_BLOCK, max(128, next_power_of_2(n)))
    _TOPK[(1,)](values.contiguous(), out, n, k, BLOCK=block, ONE_BLOCK=n <= block, num_warps=_warps(block))
    return out
