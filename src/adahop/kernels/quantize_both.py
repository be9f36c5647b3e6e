"""Both orientations of one operand from the same reads: ``x`` [R, C] quantized along C (rows = R,
the Hopper e4m3 form) and along R (rows = C, the e4m3 form or the packed MXFP4 form), as two
``quantize_operand_triton`` calls would give them, bit for bit.

The gradient g [T, N] of a linear layer is quantized twice in the backward: along N for dgrad and
along T for wgrad. Each call reads g twice (the e4m3 form needs each row's largest block exponent
before it writes: ``kernels.quantize``), so g is read four times. Here a program owns one
``[BLOCK_R, BLOCK_C]`` tile of x and does both orientations on it: the tile, transformed along its
rows, gives blocks along C; its transpose, transformed along the tile's columns, gives blocks along
R. Two launches, as the one-orientation form:

* PHASE 1 writes, for every tile, each row's largest block exponent of either orientation
  (``[tiles along C, R, 16]`` and ``[tiles along R, C, 16]`` uint8, the 16-byte store of
  ``kernels.quantize``: 16 bytes per row and tile, a quarter of a byte per element with 64-wide
  tiles, which is a quarter more traffic than g's reads in this pass); one small launch
  (``_partial_max_kernel``) reduces those of both orientations to each row's maximum;
* PHASE 2 reads the tile again and emits both e4m3 forms and row scales.

(An atomic max into one int32 per row, in place of the partial maxima and their reductions, makes
PHASE 1 slower: Triton gives atomics a layout of one element per thread, which pulls the tile and
its butterfly into it; 1,280 SASS instructions for g's PHASE 1 instead of 856.)

Optionally (``row_norms`` / ``col_norms``) PHASE 1 also sums the squares of x's rows and/or
columns (the values as given, in float32): each tile writes its partial sums, torch adds them and
takes the square root. These are the L2 norms by which outlier extraction ranks the slices
(``ops.outliers``), from reads this kernel makes anyway, where ``torch.linalg.vector_norm`` reads
x once more (0.18 ms for g [16384, 14336] on the H200). They differ from it only in the order of
the float additions.

Given bounds on the magnitudes of x's rows and columns (``bounds``, from the producers of x), the
row exponents come from them (``formats.e4m3_rows``) and one launch (PHASE 0) emits both
orientations: x is read once.

g is read twice instead of four times. The blocks, counters (SR) and signs of each orientation are
those of the one-orientation kernel, so the outputs are identical (tested).

The forward's activation x [T, K] is the other operand quantized twice: along K in the e4m3 form
(fprop) and along T in the packed form (saved for wgrad). One-orientation calls read it three
times (two passes for e4m3, one for packed), the packed one through a transposed view (columns of
x: short contiguous runs). With ``rows_form="packed"`` orientation B needs no row maximum, so
PHASE 1 emits it (codes and scale bytes) next to A's row maxima and PHASE 2 does A alone: x is
read twice, both times in tiles.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from adahop.formats.e4m3_rows import bound_row_exponent as bound_row_exponent_ref
from adahop.formats.e4m3_rows import row_scale
from adahop.formats.mxfp4 import MXFP4Tensor
from adahop.kernels.launch import INTERPRETED, FastLauncher, cdiv, dummy_pointer, nan_bytes_view
from adahop.kernels.mxfp4_math import SCALE_MODE_IDS, pow2
from adahop.kernels.quantize import (
    _blocks,
    _emit_chunk,
    _sr_key_from_state,
    _store_row_exponent,
    _transform,
    bound_row_exponent,
    check_row_bound,
    check_spec,
    sign_key,
    sr_args,
)
from adahop.transforms.operand_spec import OperandSpec


@triton.jit(do_not_specialize=["sr_key_a", "sr_key_b", "sign_key_a", "sign_key_b"])
def _quantize_both_kernel(
    x_ptr, stride_r, stride_c, R, C, RP, CP,
    e4a_ptr, e4a_bits_ptr, rsa_ptr, parta_ptr, emaxa_ptr, ssa_ptr,
    e4b_ptr, e4b_bits_ptr, rsb_ptr, partb_ptr, emaxb_ptr, ssb_ptr, codes_b_ptr, scales_b_ptr,
    bound_a_ptr, bound_b_ptr,
    sr_key_a, sr_key_b, sr_state_a_ptr, sr_state_b_ptr, sign_key_a, sign_key_b, norm_a, norm_b,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    LOG2_HA: tl.constexpr, LOG2_HB: tl.constexpr, HAS_SIGNS_A: tl.constexpr, HAS_SIGNS_B: tl.constexpr,
    SCALE_MODE_A: tl.constexpr, SCALE_MODE_B: tl.constexpr, SR_A: tl.constexpr, SR_B: tl.constexpr,
    SR_FROM_STATE_A: tl.constexpr, SR_FROM_STATE_B: tl.constexpr,
    NAN_BY_CAST: tl.constexpr, PHASE: tl.constexpr, B_PACKED: tl.constexpr,
    SUMSQ_A: tl.constexpr, SUMSQ_B: tl.constexpr,
):
    """Program (i, j) owns rows [i * BLOCK_R, ...) and columns [j * BLOCK_C, ...) of x. Orientation
    A: rows of x, quantized along C (K = CP); orientation B: columns of x, quantized along R
    (K = RP), in the e4m3 form or, with ``B_PACKED``, the packed form (emitted in PHASE 1).
    ``SUMSQ_A`` / ``SUMSQ_B`` (PHASE 1, or 0): this tile's sums of squares of x's rows / columns.
    PHASE 0: one launch, each e4m3 orientation's row exponents from its bound (``bound_a_ptr``:
    float32 [R], ``bound_b_ptr``: [C]; ``kernels.quantize.bound_row_exponent``).
    ``SR_FROM_STATE_*``: that orientation's SR key comes from its device-side state, as in
    ``kernels.quantize``."""
    if SR_FROM_STATE_A:
        sr_key_a = _sr_key_from_state(sr_state_a_ptr, sr_key_a)
    if SR_FROM_STATE_B:
        sr_key_b = _sr_key_from_state(sr_state_b_ptr, sr_key_b)
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows[:, None] < R) & (cols[None, :] < C)
    ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_r + cols[None, :].to(tl.int64) * stride_c
    x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    if PHASE != 2:
        if SUMSQ_A:
            tl.store(ssa_ptr + pid_c * R + rows, tl.sum(x * x, axis=1), mask=rows < R)
        if SUMSQ_B:
            tl.store(ssb_ptr + pid_r * C + cols, tl.sum(x * x, axis=0), mask=cols < C)
    # PHASE 1 needs A's block exponents only: the butterfly without its norm (_blocks applies it)
    xa = _transform(x, cols, sign_key_a, norm_a, BLOCK_R, BLOCK_C, LOG2_HA, HAS_SIGNS_A, PHASE != 1)
    ea, fina = _blocks(xa, BLOCK_R, BLOCK_C, SCALE_MODE_A, norm_a if PHASE == 1 else 1.0)
    rows_a_ok = rows < R
    rows_b_ok = cols < C
    if PHASE == 0:  # the row exponents from the bounds: everything in this launch
        emax_a = bound_row_exponent(bound_a_ptr, rows, rows_a_ok, LOG2_HA, SCALE_MODE_A)
        tl.store(rsa_ptr + rows, pow2(emax_a - 6), mask=rows_a_ok & (pid_c == 0))
        _emit_chunk(xa, ea, fina, emax_a, rows, rows_a_ok, pid_c * BLOCK_C, CP, sr_key_a,
                    e4a_ptr, e4a_ptr, e4a_ptr, e4a_bits_ptr, BLOCK_R, BLOCK_C, SR_A, False, True, NAN_BY_CAST)
        xb = _transform(tl.trans(x), rows, sign_key_b, norm_b, BLOCK_C, BLOCK_R, LOG2_HB, HAS_SIGNS_B)
        eb, finb = _blocks(xb, BLOCK_C, BLOCK_R, SCALE_MODE_B)
        if B_PACKED:
            _emit_chunk(xb, eb, finb, tl.zeros((BLOCK_C,), tl.int32), cols, rows_b_ok, pid_r * BLOCK_R, RP,
                        sr_key_b, codes_b_ptr, scales_b_ptr, e4b_ptr, e4b_bits_ptr,
                        BLOCK_C, BLOCK_R, SR_B, True, False, NAN_BY_CAST)
        else:
            emax_b = bound_row_exponent(bound_b_ptr, cols, rows_b_ok, LOG2_HB, SCALE_MODE_B)
            tl.store(rsb_ptr + cols, pow2(emax_b - 6), mask=rows_b_ok & (pid_r == 0))
            _emit_chunk(xb, eb, finb, emax_b, cols, rows_b_ok, pid_r * BLOCK_R, RP, sr_key_b,
                        e4b_ptr, e4b_ptr, e4b_ptr, e4b_bits_ptr, BLOCK_C, BLOCK_R, SR_B, False, True, NAN_BY_CAST)
    elif B_PACKED:
        if PHASE == 1:
            ma = tl.max(tl.where(fina, ea, -127), axis=1)
            _store_row_exponent(parta_ptr + pid_c * R * 16, ma, ea, rows, rows_a_ok, True, BLOCK_R, BLOCK_C)
            xb = _transform(tl.trans(x), rows, sign_key_b, norm_b, BLOCK_C, BLOCK_R, LOG2_HB, HAS_SIGNS_B)
            eb, finb = _blocks(xb, BLOCK_C, BLOCK_R, SCALE_MODE_B)
            _emit_chunk(xb, eb, finb, tl.zeros((BLOCK_C,), tl.int32), cols, rows_b_ok, pid_r * BLOCK_R, RP, sr_key_b,
                        codes_b_ptr, scales_b_ptr, e4b_ptr, e4b_bits_ptr,
                        BLOCK_C, BLOCK_R, SR_B, True, False, NAN_BY_CAST)
        else:
            emax_a = tl.load(emaxa_ptr + rows, mask=rows_a_ok, other=0).to(tl.int32) - 127
            tl.store(rsa_ptr + rows, pow2(emax_a - 6), mask=rows_a_ok & (pid_c == 0))
            _emit_chunk(xa, ea, fina, emax_a, rows, rows_a_ok, pid_c * BLOCK_C, CP, sr_key_a,
                        e4a_ptr, e4a_ptr, e4a_ptr, e4a_bits_ptr, BLOCK_R, BLOCK_C, SR_A, False, True, NAN_BY_CAST)
    else:
        xb = _transform(tl.trans(x), rows, sign_key_b, norm_b, BLOCK_C, BLOCK_R, LOG2_HB, HAS_SIGNS_B, PHASE == 2)
        eb, finb = _blocks(xb, BLOCK_C, BLOCK_R, SCALE_MODE_B, 1.0 if PHASE == 2 else norm_b)
        if PHASE == 1:
            ma = tl.max(tl.where(fina, ea, -127), axis=1)
            mb = tl.max(tl.where(finb, eb, -127), axis=1)
            _store_row_exponent(parta_ptr + pid_c * R * 16, ma, ea, rows, rows_a_ok, True, BLOCK_R, BLOCK_C)
            _store_row_exponent(partb_ptr + pid_r * C * 16, mb, eb, cols, rows_b_ok, True, BLOCK_C, BLOCK_R)
        else:
            emax_a = tl.load(emaxa_ptr + rows, mask=rows_a_ok, other=0).to(tl.int32) - 127
            emax_b = tl.load(emaxb_ptr + cols, mask=rows_b_ok, other=0).to(tl.int32) - 127
            tl.store(rsa_ptr + rows, pow2(emax_a - 6), mask=rows_a_ok & (pid_c == 0))
            tl.store(rsb_ptr + cols, pow2(emax_b - 6), mask=rows_b_ok & (pid_r == 0))
            _emit_chunk(xa, ea, fina, emax_a, rows, rows_a_ok, pid_c * BLOCK_C, CP, sr_key_a,
                        e4a_ptr, e4a_ptr, e4a_ptr, e4a_bits_ptr, BLOCK_R, BLOCK_C, SR_A, False, True, NAN_BY_CAST)
            _emit_chunk(xb, eb, finb, emax_b, cols, rows_b_ok, pid_r * BLOCK_R, RP, sr_key_b,
                        e4b_ptr, e4b_ptr, e4b_ptr, e4b_bits_ptr, BLOCK_C, BLOCK_R, SR_B, False, True, NAN_BY_CAST)


_QUANTIZE_BOTH = FastLauncher(_quantize_both_kernel)


@triton.jit
def _partial_max(part_ptr, out_ptr, n_parts, R, pid, BLOCK: tl.constexpr, PARTS: tl.constexpr):
    """out[r] = max over p of part[p, r, 0] for this program's BLOCK rows (uint8, biased
    exponents: the maximum of the biased bytes is the biased maximum)."""
    rows = pid * BLOCK + tl.arange(0, BLOCK)
    ok = rows < R
    m = tl.zeros((BLOCK,), tl.int32)
    for p0 in range(0, n_parts, PARTS):
        p = p0 + tl.arange(0, PARTS)
        offs = (p[:, None].to(tl.int64) * R + rows[None, :]) * 16
        v = tl.load(part_ptr + offs, mask=(p[:, None] < n_parts) & ok[None, :], other=0)
        m = tl.maximum(m, tl.max(v.to(tl.int32), axis=0))
    tl.store(out_ptr + rows, m.to(tl.uint8), mask=ok)


@triton.jit
def _partial_max_kernel(pa_ptr, oa_ptr, na, Ra, pb_ptr, ob_ptr, nb, Rb, programs_a,
                        BLOCK: tl.constexpr, PARTS: tl.constexpr, HAS_B: tl.constexpr):
    """Each row's largest exponent from PHASE 1's partials, for orientation A (programs below
    ``programs_a``) and, with ``HAS_B``, orientation B (the others): one launch for both, in
    place of a ``torch.amax`` per orientation over a byte-strided view (which read these bytes at
    about half the bandwidth: 0.067 ms for the three reductions of a (14336, 4096) layer's x
    and g at T = 16384 on the H200)."""
    pid = tl.program_id(0)
    if HAS_B and pid >= programs_a:
        _partial_max(pb_ptr, ob_ptr, nb, Rb, pid - programs_a, BLOCK, PARTS)
    else:
        _partial_max(pa_ptr, oa_ptr, na, Ra, pid, BLOCK, PARTS)


_PARTIAL_MAX = FastLauncher(_partial_max_kernel)
PARTIAL_MAX_ROWS = 128  # rows per program of the reduction
PARTIAL_MAX_PARTS = 16  # partials loaded per step


def _row_maxima(parta, emaxa, partb=None, emaxb=None) -> None:
    """``emaxa[r] = parta[:, r, 0].max()`` (and the same for B when given), in one launch."""
    n_a, R_a = parta.shape[0], parta.shape[1]
    programs_a = cdiv(R_a, PARTIAL_MAX_ROWS)
    has_b = partb is not None
    n_b, R_b = (partb.shape[0], partb.shape[1]) if has_b else (0, 0)
    grid = (programs_a + cdiv(R_b, PARTIAL_MAX_ROWS),)
    _PARTIAL_MAX[grid](parta, emaxa, n_a, R_a, partb if has_b else parta, emaxb if has_b else emaxa,
                       n_b, R_b, programs_a, BLOCK=PARTIAL_MAX_ROWS, PARTS=PARTIAL_MAX_PARTS,
                       HAS_B=has_b, num_warps=4)


def quantize_both(x: torch.Tensor, spec_cols: OperandSpec, spec_rows: OperandSpec, *, rows_form: str = "e4m3",
                  row_norms: bool = False, col_norms: bool = False, bounds: tuple | None = None,
                  block_r: int | None = None, block_c: int | None = None, num_warps: int | None = None):
    """Quantize 2-D ``x`` [R, C] along C as ``spec_cols`` says and along R as ``spec_rows`` says.
    Returns two dicts, equal to ``quantize_operand_triton(x, 1, spec_cols, e4m3=True,
    packed=False)`` (``"e4m3"``, ``"row_scale"``) and, by ``rows_form``, to
    ``quantize_operand_triton(x, 0, spec_rows, e4m3=True, packed=False)`` (``"e4m3"``) or
    ``quantize_operand_triton(x, 0, spec_rows)`` (``"packed"``: ``"mx"``, an MXFP4Tensor).

    ``row_norms`` / ``col_norms``: the first / second dict also holds ``"norms"``, the float32 L2
    norms of x's rows / columns (that orientation's outer slices), by which outlier extraction
    ranks them (``ops.outliers.outer_norms``, up to the order of the additions).

    ``bounds``: ``(row_bound, col_bound)``, float32 [R] and [C] (None where B is packed), bounds on
    the magnitudes of x's rows and columns: the e4m3 forms take their row exponents from them
    (``formats.e4m3_rows.bound_row_exponent``) and x is read once, in one launch. Without them, each
    e4m3 row's largest block exponent (two passes).

    ``block_r`` / ``block_c``: the tile, powers of two, each a multiple of 32 and of the
    Hadamard size of the orientation that transforms along it (default: 64, or that size if
    larger); ``num_warps`` (default: 32 elements per thread, 4 to 8 warps)."""
    if x.dim() != 2:
        raise ValueError(f"quantize_both takes a 2-D operand, got shape {tuple(x.shape)}")
    if rows_form not in ("e4m3", "packed"):
        raise ValueError(f"rows_form must be 'e4m3' or 'packed', got {rows_form!r}")
    check_spec(spec_cols)
    check_spec(spec_rows)
    packed = rows_form == "packed"
    R, C = x.shape
    block_c = max(64, spec_cols.alignment) if block_c is None else block_c
    block_r = max(64, spec_rows.alignment) if block_r is None else block_r
    for name, size, align in (("block_c", block_c, spec_cols.alignment), ("block_r", block_r, spec_rows.alignment)):
        if isinstance(size, bool) or not isinstance(size, int) or size < align or size & (size - 1) or size % align:
            raise ValueError(f"{name} must be a power of two and a multiple of {align}, got {size!r}")
    if num_warps is None:
        num_warps = min(8, max(4, block_r * block_c // 1024))
    if bounds is not None:
        if not (isinstance(bounds, tuple) and len(bounds) == 2):
            raise ValueError(f"bounds must be (row_bound, col_bound), got {type(bounds).__name__}")
        check_row_bound(bounds[0], R, x.device)
        if not packed:
            check_row_bound(bounds[1], C, x.device)
    CP, RP = spec_cols.padded(C), spec_rows.padded(R)
    if R * CP >= 2**32 or C * RP >= 2**32:
        raise ValueError(f"operand too large for 32-bit SR counters: {R} x {C}")
    dev = x.device
    dummy = dummy_pointer(dev)
    e4a = torch.empty((R, CP), dtype=torch.float8_e4m3fn, device=dev)
    rsa = torch.empty((R,), dtype=torch.float32, device=dev)
    out_a = {"e4m3": e4a, "row_scale": rsa}
    if packed:
        codes_b = torch.empty((C, RP // 2), dtype=torch.uint8, device=dev)
        scales_b = torch.empty((C, RP // 32), dtype=torch.uint8, device=dev)
        out_b = {"mx": MXFP4Tensor(codes_b, scales_b, x.shape, 0, 32)}
        e4b = rsb = dummy
    else:
        codes_b = scales_b = dummy
        e4b = torch.empty((C, RP), dtype=torch.float8_e4m3fn, device=dev)
        rsb = torch.empty((C,), dtype=torch.float32, device=dev)
        out_b = {"e4m3": e4b, "row_scale": rsb}
    if R == 0 or C == 0:  # an empty dim: rows with no blocks get the smallest row scale
        rsa.fill_(2.0**-133)
        if not packed:
            rsb.fill_(2.0**-133)
        if bounds is not None:  # the row scales of the bounds' exponents, as the kernel would write them
            rsa.copy_(row_scale(bound_row_exponent_ref(bounds[0], spec_cols.log2_hadamard, spec_cols.scale_mode)))
            if not packed:
                rsb.copy_(row_scale(bound_row_exponent_ref(bounds[1], spec_rows.log2_hadamard, spec_rows.scale_mode)))
        if row_norms:
            out_a["norms"] = torch.zeros((R,), dtype=torch.float32, device=dev)
        if col_norms:
            out_b["norms"] = torch.zeros((C,), dtype=torch.float32, device=dev)
        return out_a, out_b
    grid = (cdiv(RP, block_r), cdiv(CP, block_c))  # covers the padding of both
    given = bounds is not None
    parta = dummy if given else torch.empty((grid[1], R, 16), dtype=torch.uint8, device=dev)
    emaxa = dummy if given else torch.empty((R,), dtype=torch.uint8, device=dev)
    partb = dummy if packed or given else torch.empty((grid[0], C, 16), dtype=torch.uint8, device=dev)
    emaxb = dummy if packed or given else torch.empty((C,), dtype=torch.uint8, device=dev)
    ssa = torch.empty((grid[1], R), dtype=torch.float32, device=dev) if row_norms else dummy
    ssb = torch.empty((grid[0], C), dtype=torch.float32, device=dev) if col_norms else dummy
    (key_a, state_a), (key_b, state_b) = sr_args(spec_cols), sr_args(spec_rows)
    args = (
        x, x.stride(0), x.stride(1), R, C, RP, CP,
        e4a, nan_bytes_view(e4a), rsa, parta, emaxa, ssa,
        e4b, dummy if packed else nan_bytes_view(e4b), rsb, partb, emaxb, ssb, codes_b, scales_b,
        bounds[0] if given else dummy, bounds[1] if given and not packed else dummy,
        key_a, key_b, dummy if state_a is None else state_a, dummy if state_b is None else state_b,
        sign_key(spec_cols), sign_key(spec_rows), spec_cols.hadamard_norm, spec_rows.hadamard_norm,
    )
    meta = dict(
        BLOCK_R=block_r, BLOCK_C=block_c, LOG2_HA=spec_cols.log2_hadamard, LOG2_HB=spec_rows.log2_hadamard,
        HAS_SIGNS_A=spec_cols.signs_seed is not None, HAS_SIGNS_B=spec_rows.signs_seed is not None,
        SCALE_MODE_A=SCALE_MODE_IDS[spec_cols.scale_mode], SCALE_MODE_B=SCALE_MODE_IDS[spec_rows.scale_mode],
        SR_A=spec_cols.stochastic, SR_B=spec_rows.stochastic,
        SR_FROM_STATE_A=state_a is not None, SR_FROM_STATE_B=state_b is not None,
        NAN_BY_CAST=not INTERPRETED, B_PACKED=packed, num_warps=num_warps,
    )
    if given:
        _QUANTIZE_BOTH[grid](*args, PHASE=0, SUMSQ_A=row_norms, SUMSQ_B=col_norms, **meta)
    else:
        _QUANTIZE_BOTH[grid](*args, PHASE=1, SUMSQ_A=row_norms, SUMSQ_B=col_norms, **meta)
        _row_maxima(parta, emaxa, None if packed else partb, None if packed else emaxb)
        _QUANTIZE_BOTH[grid](*args, PHASE=2, SUMSQ_A=False, SUMSQ_B=False, **meta)
    if row_norms:
        out_a["norms"] = ssa.sum(0).sqrt_()
    if col_norms:
        out_b["norms"] = ssb.sum(0).sqrt_()
    return out_a, out_b
