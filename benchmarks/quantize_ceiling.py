"""The ceiling of each design for quantizing at the memory limit on Hopper: how much of a
device-to-device copy's bandwidth every candidate reaches at the 1B and 8B shapes, before any of
them goes into the layer.

    python benchmarks/quantize_ceiling.py [--sections roof,now,rows,single,parts,producer,weight] [--out FILE]

The GEMM operands' e4m3 form (MXFP4 folded into e4m3 with one float32 scale per row, what
``torch._scaled_mm`` takes) needs each row's largest block exponent before it writes its first
element, so the library's kernel reads a long row twice, in two launches. Candidates:

  now:      the library's kernels for every form the trained modes use (x: e4m3 along K + packed
            along T, its unpack; g: both e4m3 orientations with SR; W from float32 both ways).
  rows:     one launch in which each program owns whole rows and walks them twice: the second read
            hits L2. Row exponent from the transformed blocks (``exact``: the library's bits), from
            an upper bound on the raw row (``bound``: |H x|_i <= sqrt(H) max|x| for the
            orthonormal Hadamard, no butterfly in the first pass), or given (``given``: a bound
            the producer computed, so one pass; the ceiling of every producer-side bound). With the
            Hadamard as a butterfly or on the tensor cores (``tc``: one bf16 dot with the 32 x 32
            matrix; a different addition order than the reference's butterfly, so the share of
            bits that differ is reported).
  single:   the whole row in one chunk (one read), the library's kernel with rows up to 16384.
  parts:    the same kernel with SR or RNE, with and without the Hadamard: the ceiling of cheaper
            random bits (SR at RNE's cost) and of a free Hadamard.
  producer: quantization fused into its producer by Inductor: RMSNorm (x of q/k/v and w1/w3) and
            the SwiGLU product (x of w2) with the e4m3 form in PyTorch ops in one compiled
            function, against the producer compiled alone plus the library's kernel after it.
  weight:   a weight from float32 both ways (fprop along K, dgrad along N): two calls against a
            cast plus the both-ways kernel, the ceiling of quantizing W once per optimizer step.

Every variant is checked against the library's bits first (``exact`` and ``given`` equal them;
``bound`` and ``tc`` report how many e4m3 bytes differ and the largest difference of the
dequantized values relative to the row maximum). Bytes counted are the fewest a form must move:
its input read once, its outputs written once. Rows go to --out (JSONL), each with the
environment; the last lines are a table of the share of copy bandwidth per variant.
"""

from __future__ import annotations

import math
import sys

import common
import torch
import triton
import triton.language as tl
from common import Results, add_out_arg, bench, parse_sections_and_shapes, run_sections, same_bits, script_parser, start

from adahop.kernels.launch import INTERPRETED, cdiv, dummy_pointer, nan_bytes_view
from adahop.kernels.mxfp4_math import SCALE_MODE_IDS, block_exponent, fwht, lowbias32, pow2
from adahop.kernels.quantize import (
    _blocks,
    _emit_chunk,
    quantize_operand_triton,
    sign_key,
    sr_args,
)
from adahop.kernels.quantize_both import quantize_both
from adahop.kernels.unpack import unpack_to_e4m3
from adahop.ops import OperandSpec

INTERPRETED_JIT: tl.constexpr = tl.constexpr(INTERPRETED)
SECTIONS = ("roof", "now", "rows", "single", "parts", "producer", "weight")
COPY_BYTES = 2**30
# Llama 3.2 1B (dim 2048, ffn 8192, kv 512) at 64 x 512 tokens a step; Llama 3.1 8B (4096, 14336,
# 1024) at 16384 tokens: the operands' [T, features] and the weights' [N, K].
MODELS = {
    "1b": dict(T=32768, x=(2048, 8192), g=(512, 2048, 8192), w=((8192, 2048), (2048, 8192))),
    "8b": dict(T=16384, x=(4096, 14336), g=(1024, 4096, 14336), w=((14336, 4096), (4096, 14336))),
}
IHT = OperandSpec(hadamard_size=32)
IHT_SR = OperandSpec(hadamard_size=32, rounding="sr", sr_seed=7)
E4M3_BYTES = 1 + 4 / 2**30  # per element (the row scale is negligible)
PACKED_BYTES = 0.5 + 1 / 32  # codes + scale bytes per element
ROWS_CONFIGS = ((16, 256, 4), (8, 256, 4), (4, 512, 4), (32, 256, 8))  # (rows per program, chunk, warps)
SINGLE_CONFIGS = ((1, 4), (1, 8), (2, 8), (4, 8))  # (rows per program, warps) of one chunk per row


# ---- the candidate kernel: rows owned by one program --------------------------------------------------
@triton.jit
def _hadamard32_matrix(dtype: tl.constexpr):
    """The unnormalised 32 x 32 Sylvester Hadamard matrix, H[i, j] = (-1)**popcount(i & j)."""
    i = tl.arange(0, 32)[:, None]
    j = tl.arange(0, 32)[None, :]
    b = i & j
    b = b ^ (b >> 4)
    b = b ^ (b >> 2)
    b = b ^ (b >> 1)
    return (1.0 - 2.0 * (b & 1).to(tl.float32)).to(dtype)


@triton.jit
def _transform_any(x, cols, skey, norm, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, LOG2_H: tl.constexpr,
                   HAS_SIGNS: tl.constexpr, NORMED: tl.constexpr, TC: tl.constexpr):
    """``kernels.quantize._transform``, or with ``TC`` the 32-point Hadamard as one dot on the
    tensor cores: x (bf16 values, exact in bf16, times +-1 signs) against the +-1 matrix with
    float32 accumulation."""
    if HAS_SIGNS:
        bit = lowbias32(cols.to(tl.uint32) ^ skey.to(tl.uint32)) >> 31
        x = x * (1.0 - 2.0 * bit.to(tl.float32))[None, :]
    if LOG2_H > 0:
        if TC:
            xr = tl.reshape(x, (BLOCK_R * BLOCK_K // 32, 32))
            if INTERPRETED_JIT:  # the interpreter's bf16 dot misreads its operands: float32 there
                y = tl.dot(xr, _hadamard32_matrix(tl.float32), input_precision="ieee")
            else:
                y = tl.dot(xr.to(tl.bfloat16), _hadamard32_matrix(tl.bfloat16), out_dtype=tl.float32)
            x = tl.reshape(y, (BLOCK_R, BLOCK_K))
        else:
            x = fwht(x, BLOCK_R, BLOCK_K, LOG2_H)
        if NORMED:
            x = x * norm
    return x


@triton.jit(do_not_specialize=["sr_key", "skey"])
def _owned_rows_kernel(
    x_ptr, stride_r, stride_k, e4m3_ptr, e4m3_bits_ptr, rowscale_ptr, rowexp_ptr,
    R, K, KP, sr_key, skey, norm, bound_factor,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, LOG2_H: tl.constexpr, HAS_SIGNS: tl.constexpr,
    SCALE_MODE: tl.constexpr, SR: tl.constexpr, NAN_BY_CAST: tl.constexpr, ROW_EXP: tl.constexpr,
    TC: tl.constexpr,
):
    """One program owns BLOCK_R whole rows. ``ROW_EXP``: 0 exact (first pass transforms and takes
    the block exponents, as the library's PHASE 1), 1 bound (first pass: the raw rows' largest
    |x| times ``bound_factor``, no transform), 2 given (``rowexp`` [R] int32 holds it: one pass).
    Second pass: the library's emit (``_emit_chunk``), e4m3 form only."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < R
    if ROW_EXP == 2:
        e_rowmax = tl.load(rowexp_ptr + rows, mask=row_ok, other=-127)
    elif ROW_EXP == 1:
        amax = tl.zeros((BLOCK_R,), tl.float32)
        for k0 in range(0, KP, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            mask = row_ok[:, None] & (cols[None, :] < K)
            ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_r + cols[None, :].to(tl.int64) * stride_k
            amax = tl.maximum(amax, tl.max(tl.abs(tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)), 1))
        e_rowmax = block_exponent(amax * bound_factor, SCALE_MODE)
    else:
        e_rowmax = tl.full((BLOCK_R,), -127, tl.int32)
        for k0 in range(0, KP, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            mask = row_ok[:, None] & (cols[None, :] < K)
            ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_r + cols[None, :].to(tl.int64) * stride_k
            x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
            x = _transform_any(x, cols, skey, norm, BLOCK_R, BLOCK_K, LOG2_H, HAS_SIGNS, False, TC)
            e, finite = _blocks(x, BLOCK_R, BLOCK_K, SCALE_MODE, norm)
            e_rowmax = tl.maximum(e_rowmax, tl.max(tl.where(finite, e, -127), axis=1))
    tl.store(rowscale_ptr + rows, pow2(e_rowmax - 6), mask=row_ok)
    for k0 in range(0, KP, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        mask = row_ok[:, None] & (cols[None, :] < K)
        ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_r + cols[None, :].to(tl.int64) * stride_k
        x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        x = _transform_any(x, cols, skey, norm, BLOCK_R, BLOCK_K, LOG2_H, HAS_SIGNS, True, TC)
        e, finite = _blocks(x, BLOCK_R, BLOCK_K, SCALE_MODE)
        _emit_chunk(x, e, finite, e_rowmax, rows, row_ok, k0, KP, sr_key,
                    e4m3_ptr, e4m3_ptr, e4m3_ptr, e4m3_bits_ptr,
                    BLOCK_R, BLOCK_K, SR, False, True, NAN_BY_CAST)


def owned_rows(x, dim, spec, row_exp="exact", rowexp=None, tc=False, block_r=16, block_k=256, num_warps=4):
    """The e4m3 form of ``x`` along ``dim`` by ``_owned_rows_kernel``: {"e4m3", "row_scale"}."""
    view = x if dim % 2 == 1 else x.t()
    R, K = view.shape
    KP = spec.padded(K)
    block_k = min(block_k, max(triton.next_power_of_2(KP), 32))
    e4 = torch.empty((R, KP), dtype=torch.float8_e4m3fn, device=x.device)
    rs = torch.empty((R,), dtype=torch.float32, device=x.device)
    key, state = sr_args(spec)
    assert state is None, "the prototype takes int SR seeds"
    bound = math.sqrt(spec.hadamard_size or 1) * 1.0001  # float32 rounding of the butterfly's sums
    _owned_rows_kernel[(cdiv(R, block_r),)](
        view, view.stride(0), view.stride(1), e4, nan_bytes_view(e4), rs,
        rowexp if rowexp is not None else dummy_pointer(x.device),
        R, K, KP, key, sign_key(spec), spec.hadamard_norm, bound,
        BLOCK_R=block_r, BLOCK_K=block_k, LOG2_H=spec.log2_hadamard, HAS_SIGNS=spec.signs_seed is not None,
        SCALE_MODE=SCALE_MODE_IDS[spec.scale_mode], SR=spec.stochastic, NAN_BY_CAST=not INTERPRETED,
        ROW_EXP={"exact": 0, "bound": 1, "given": 2}[row_exp], TC=tc, num_warps=num_warps,
    )
    return {"e4m3": e4, "row_scale": rs}


def row_exponents(out: dict) -> torch.Tensor:
    """The row exponents (int32) behind a form's row scales: scale = 2**(e - 6)."""
    return (torch.log2(out["row_scale"]).round().to(torch.int32) + 6).contiguous()


def compare(a: dict, ref: dict) -> dict:
    """How far form ``a`` is from the library's ``ref``: e4m3 bytes that differ (share) and the
    largest difference of the dequantized values relative to their row's largest |value|."""
    da = a["e4m3"].float() * a["row_scale"][:, None]
    dr = ref["e4m3"].float() * ref["row_scale"][:, None]
    row_max = dr.abs().amax(1, keepdim=True).clamp_min(1e-30)
    differ = (a["e4m3"].view(torch.uint8) != ref["e4m3"].view(torch.uint8)).float().mean().item()
    return dict(bytes_differ=differ, max_rel_to_row_max=((da - dr).abs() / row_max).max().item())


# ---- the PyTorch form for Inductor ------------------------------------------------------------------
def hadamard32_torch(v: torch.Tensor) -> torch.Tensor:
    """The reference's butterfly on the last dim (32): stage h = 16, .., 1 pairs x[i] and x[i + h]."""
    shape = v.shape
    for h in (16, 8, 4, 2, 1):
        w = v.reshape(*shape[:-1], 32 // (2 * h), 2, h)
        v = torch.stack((w[..., 0, :] + w[..., 1, :], w[..., 0, :] - w[..., 1, :]), dim=-2).reshape(shape)
    return v


def e4m3_form_torch(y: torch.Tensor, hadamard: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``y`` [R, K] (bf16, K a multiple of 32, finite) quantized along K to MXFP4 RNE, 'even'
    scales, in the e4m3 form: the library's bits, in PyTorch ops that Inductor can fuse."""
    R, K = y.shape
    v = y.float().reshape(R, K // 32, 32)
    if hadamard:
        v = hadamard32_torch(v) * (1 / math.sqrt(32))
    amax = v.abs().amax(-1)
    bits = amax.view(torch.int32)
    e = ((((bits + 2097152) & 0x7F800000) >> 23) - 129).clamp(-127, 127)
    vs = v * ((127 - e) << 23).view(torch.float32)[..., None]  # v * 2**-e, e <= 126 for finite bf16
    a = vs.abs().clamp(max=6.0)
    cbits = torch.maximum(a.view(torch.int32) & 0x7F800000, torch.full_like(e[..., None], 127 << 23)) + (22 << 23)
    c = cbits.view(torch.float32)
    mag = (a + c) - c
    e_row = e.amax(-1, keepdim=True)
    shift = (e - e_row + 6).clamp(min=-126)
    val = torch.copysign(mag, vs) * ((shift + 127) << 23).view(torch.float32)[..., None]
    row_scale = ((e_row[:, 0] - 6 + 127) << 23).view(torch.float32)
    return val.reshape(R, K).to(torch.float8_e4m3fn), row_scale


def rmsnorm(x, w, eps=1e-5):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(torch.bfloat16)


def swiglu(a, b):
    return (torch.nn.functional.silu(a.float()) * b.float()).to(torch.bfloat16)


# ---- sections -------------------------------------------------------------------------------------------
class Ceiling:
    def __init__(self, models):
        self.models = models
        self.copy_gbs = None
        self.table = []

    def row(self, section, model, variant, ms, nbytes, **extra):
        gbs = nbytes / ms / 1e6
        r = dict(model=model, variant=variant, ms=ms, GBps=gbs, copy_GBps=self.copy_gbs,
                 frac_of_copy=gbs / self.copy_gbs, **extra)
        self.table.append((section, model, variant, ms, gbs / self.copy_gbs))
        print(f"  {section} {r}", flush=True)
        return r

    def roof(self):
        n = COPY_BYTES if common.DEVICE == "cuda" else 2**16
        src = torch.randint(0, 256, (n,), dtype=torch.uint8, device=common.DEVICE)
        dst = torch.empty_like(src)
        t = bench(lambda: dst.copy_(src))
        self.copy_gbs = 2 * n / t / 1e6
        return [dict(variant="device-to-device copy", ms=t, GBps=self.copy_gbs)]

    def now(self):
        rows = []
        for name in self.models:
            m = MODELS[name]
            T = m["T"]
            for K in m["x"]:
                x = common.activation((T, K))
                n = T * K
                be = quantize_both(x, IHT, IHT, rows_form="packed") if K >= 4096 else None
                t = bench(lambda: quantize_both(x, IHT, IHT, rows_form="packed"))  # noqa: B023
                rows.append(self.row("now", name, f"x [T,{K}]: e4m3 along K + packed along T, one kernel", t,
                                     n * (2 + E4M3_BYTES + PACKED_BYTES)))
                t = bench(lambda: (quantize_operand_triton(x, 1, IHT, packed=False, e4m3=True),  # noqa: B023
                                   quantize_operand_triton(x, 0, IHT)))  # noqa: B023
                rows.append(self.row("now", name, f"x [T,{K}]: e4m3 along K + packed along T, two calls", t,
                                     n * (2 + E4M3_BYTES + PACKED_BYTES)))
                t = bench(lambda: quantize_operand_triton(x, 1, IHT, packed=False, e4m3=True))  # noqa: B023
                rows.append(self.row("now", name, f"x [T,{K}]: e4m3 along K, IHT", t, n * (2 + E4M3_BYTES)))
                q = quantize_operand_triton(x, 0, IHT)["mx"] if be is None else be[1]["mx"]
                t = bench(lambda: unpack_to_e4m3(q))  # noqa: B023
                rows.append(self.row("now", name, f"x [T,{K}]: unpack packed -> e4m3 (wgrad)", t,
                                     n * (PACKED_BYTES + E4M3_BYTES)))
            for N in m["g"]:
                g = common.activation((T, N), seed=1)
                n = T * N
                t = bench(lambda: quantize_both(g, IHT_SR, IHT_SR))  # noqa: B023
                rows.append(self.row("now", name, f"g [T,{N}]: e4m3 both ways, IHT, SR", t, n * (2 + 2 * E4M3_BYTES)))
                t = bench(lambda: quantize_operand_triton(g, 1, IHT_SR, packed=False, e4m3=True))  # noqa: B023
                rows.append(self.row("now", name, f"g [T,{N}]: e4m3 along N, IHT, SR", t, n * (2 + E4M3_BYTES)))
        return rows

    def rows(self):
        out = []
        for name in self.models:
            m = MODELS[name]
            T = m["T"]
            cases = [(f"x [T,{K}] along K, IHT, RNE", (T, K), 1, IHT) for K in m["x"]]
            cases += [(f"g [T,{N}] along N, IHT, SR", (T, N), 1, IHT_SR) for N in m["g"][1:]]
            cases += [(f"g [T,{m['g'][1]}] along T, IHT, SR", (T, m["g"][1]), 0, IHT_SR)]
            for label, shape, dim, spec in cases:
                x = common.activation(shape, seed=2)
                n = shape[0] * shape[1]
                nbytes = n * (2 + E4M3_BYTES)
                ref = quantize_operand_triton(x, dim, spec, packed=False, e4m3=True)
                t = bench(lambda: quantize_operand_triton(x, dim, spec, packed=False, e4m3=True))  # noqa: B023
                out.append(self.row("rows", name, f"{label}: library (two launches)", t, nbytes))
                given = row_exponents(ref)
                for row_exp in ("exact", "bound", "given"):
                    for tc in (False, True):
                        best = None
                        for br, bk, nw in ROWS_CONFIGS:
                            kw = dict(row_exp=row_exp, rowexp=given, tc=tc, block_r=br, block_k=bk, num_warps=nw)
                            try:
                                got = owned_rows(x, dim, spec, **kw)
                            except Exception as e:  # a config that does not compile is said and skipped
                                print(f"  rows {label} {kw}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                                continue
                            cmp = compare(got, ref)
                            if row_exp in ("exact", "given") and not tc and not same_bits(got, ref):
                                raise AssertionError(f"{label} {row_exp}: not the library's bits ({cmp})")
                            t = bench(lambda: owned_rows(x, dim, spec, **kw))  # noqa: B023
                            if best is None or t < best[0]:
                                best = (t, (br, bk, nw), cmp)
                        if best is None:
                            continue
                        t, cfg, cmp = best
                        v = f"{label}: owned rows, row exponent {row_exp}{', Hadamard on tensor cores' if tc else ''}"
                        out.append(self.row("rows", name, v, t, nbytes, config=cfg, **cmp))
        return out

    def single(self):
        out = []
        for name in self.models:
            m = MODELS[name]
            T = m["T"]
            for label, shape, dim, spec in [(f"x [T,{K}] along K, IHT", (T, K), 1, IHT) for K in m["x"]] + \
                    [(f"g [T,{N}] along N, IHT, SR", (T, N), 1, IHT_SR) for N in m["g"][1:]]:
                x = common.activation(shape, seed=3)
                nbytes = shape[0] * shape[1] * (2 + E4M3_BYTES)
                ref = quantize_operand_triton(x, dim, spec, packed=False, e4m3=True)
                for br, nw in SINGLE_CONFIGS:
                    kw = dict(packed=False, e4m3=True, single_chunk_max=1 << 15, block_r=br, num_warps=nw)
                    try:
                        got = quantize_operand_triton(x, dim, spec, **kw)
                    except Exception as e:
                        print(f"  single {label} {br}x{nw}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                        continue
                    assert same_bits(got, ref), label
                    t = bench(lambda: quantize_operand_triton(x, dim, spec, **kw))  # noqa: B023
                    out.append(self.row("single", name, f"{label}: one chunk per row, {br} rows, {nw} warps", t,
                                        nbytes))
        return out

    def parts(self):
        out = []
        specs = [("IHT, RNE", IHT), ("IHT, SR", IHT_SR), ("no Hadamard, RNE", OperandSpec()),
                 ("no Hadamard, SR", OperandSpec(rounding="sr", sr_seed=7))]
        for name in self.models:
            m = MODELS[name]
            T = m["T"]
            for K in m["x"]:
                x = common.activation((T, K), seed=4)
                for label, spec in specs:
                    t = bench(lambda: quantize_operand_triton(x, 1, spec, packed=False, e4m3=True))  # noqa: B023
                    out.append(self.row("parts", name, f"x [T,{K}] along K -> e4m3, {label}", t,
                                        T * K * (2 + E4M3_BYTES)))
                    t = bench(lambda: quantize_operand_triton(x, 0, spec))  # noqa: B023
                    out.append(self.row("parts", name, f"x [T,{K}] along T -> packed, {label}", t,
                                        T * K * (2 + PACKED_BYTES)))
        return out

    def producer(self):
        # Inductor keeps a fused bf16 round trip in float32 unless told to emulate the cast; the
        # library quantizes the bf16 tensor, so without this the fused form is not its bits.
        torch._inductor.config.emulate_precision_casts = True
        out = []
        for name in self.models:
            m = MODELS[name]
            T = m["T"]
            D, F = m["x"]
            h = common.activation((T, D), seed=5)
            w = (1 + 0.1 * torch.randn(D, device=common.DEVICE)).to(torch.bfloat16)
            a = common.activation((T, F), seed=6)
            b = common.activation((T, F), seed=7)
            for hadamard in (False, True):
                spec = IHT if hadamard else OperandSpec()
                tag = "IHT" if hadamard else "no Hadamard"
                cases = [("RMSNorm", rmsnorm, (h, w), T * D * 2, T * D), ("SwiGLU product", swiglu, (a, b),
                                                                            T * F * 4, T * F)]
                for label, producer, args, in_bytes, n in cases:
                    fused = torch.compile(lambda *z, p=producer, hd=hadamard: e4m3_form_torch(p(*z), hd))
                    alone = torch.compile(producer)
                    y = alone(*args)
                    ref = quantize_operand_triton(y, 1, spec, packed=False, e4m3=True)
                    e4, rs = fused(*args)
                    got = {"e4m3": e4, "row_scale": rs}
                    exact = same_bits(got, ref)
                    cmp = compare(got, ref)
                    t_fused = bench(lambda: fused(*args))  # noqa: B023
                    t_alone = bench(lambda: alone(*args))  # noqa: B023
                    t_q = bench(lambda: quantize_operand_triton(y, 1, spec, packed=False, e4m3=True))  # noqa: B023
                    out.append(self.row("producer", name, f"{label} -> e4m3 ({tag}): one compiled function", t_fused,
                                        in_bytes + n * E4M3_BYTES, exact=exact, **cmp))
                    out.append(self.row("producer", name, f"{label} -> bf16, compiled alone", t_alone,
                                        in_bytes + n * 2))
                    out.append(self.row("producer", name, f"{label} -> bf16 -> e4m3 ({tag}): compiled + library kernel",
                                        t_alone + t_q, in_bytes + n * E4M3_BYTES, ms_quantize=t_q))
        return out

    def weight(self):
        out = []
        for name in self.models:
            for N, K in MODELS[name]["w"]:
                w32 = common.activation((N, K), dtype=torch.float32, seed=8) * 0.02
                n = N * K
                t = bench(lambda: (quantize_operand_triton(w32, 1, IHT, packed=False, e4m3=True,  # noqa: B023
                                                           round_to_bf16=True),
                                   quantize_operand_triton(w32, 0, IHT, packed=False, e4m3=True,  # noqa: B023
                                                           round_to_bf16=True)))
                out.append(self.row("weight", name, f"W [{N},{K}] fp32 -> e4m3 along K and along N: two calls", t,
                                    n * (4 + 2 * E4M3_BYTES)))
                ref_k = quantize_operand_triton(w32, 1, IHT, packed=False, e4m3=True, round_to_bf16=True)
                a_, b_ = quantize_both(w32.to(torch.bfloat16), IHT, IHT)
                assert same_bits(a_, ref_k)
                t = bench(lambda: quantize_both(w32.to(torch.bfloat16), IHT, IHT))  # noqa: B023
                out.append(self.row("weight", name, f"W [{N},{K}] fp32 -> bf16 -> e4m3 both ways: one kernel", t,
                                    n * (4 + 2 * E4M3_BYTES)))
        return out


def main(argv=None) -> int:
    p = script_parser(__doc__)
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    p.add_argument("--models", default="1b,8b", help="comma-separated subset of 1b,8b (the shapes)")
    add_out_arg(p, "quantize_ceiling")
    args = p.parse_args(argv)
    parse_sections_and_shapes(p, args, SECTIONS)
    models = [m for m in args.models.split(",") if m]
    if not models or any(m not in MODELS for m in models):
        p.error(f"--models takes a comma-separated subset of 1b,8b, got {args.models!r}")
    env = start("quantize_ceiling.py", argv)
    ceiling = Ceiling(models)
    results = Results(args.out, "quantize_ceiling", env)
    sections = args.sections if "roof" in args.sections else ["roof", *args.sections]
    rc = run_sections(sections, lambda s: getattr(ceiling, s)(), results)
    print(f"\n{'section':9} {'model':5} {'ms':>8} {'copy':>6}  variant")
    for section, model, variant, ms, frac in ceiling.table:
        print(f"{section:9} {model:5} {ms:8.3f} {frac:6.1%}  {variant}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
