"""AdaHOPLinear on the reference backend against an independent recomputation, bit for bit: every
GEMM mode (adahop.policy.GEMM_MODES) in every GEMM, under default and non-default settings (block
size, Hadamard size, random signs, OE k, scale mode, rounding of each operand), float32 and bf16
autocast. This is the exact tier of the layer's tests; tests/test_linear.py holds the SQNR tier.

The expected y, dx, dw are built here from the public building blocks only (``quantize_mxfp4``,
``dequantize_mxfp4``, ``block_hadamard``, ``random_signs``, ``mix_seeds``, torch matmuls), following
docs/method.md ('The three GEMMs of a linear layer', 'The Hadamard transform (IHT)', 'Outlier
extraction (OE)'). Each GEMM is C = A B with A [M, Kc], B [Kc, N]:

    fprop  y  = x   w^T    A = x,    B = w^T    Kc = K (in features)
    dgrad  dx = g   w      A = g,    B = w      Kc = N (out features)
    wgrad  dw = g^T x      A = g^T,  B = x      Kc = T (tokens)

A quantized mode pads Kc with zeros to a multiple of max(block, Hadamard size) (block alone for
``mxfp4``), applies [random signs and] the block Hadamard along Kc (IHT modes), quantizes A's rows
and B's columns along Kc and multiplies the dequantized float32 operands. OE-left takes A's k rows
of largest L2 norm (over Kc), OE-right B's k columns: those slices are zeroed before quantizing and
their part of C is the high-precision product, ``C[idx, :] = A[idx, :] B``, ``C[:, idx] = A B[:,
idx]``. The selection is made here from float64 norms with ``argsort``, and each test first checks
that the k-th and (k+1)-th norms are far apart, so that float32 and float64 norms pick the same set.

Seeds (the layer's documented contract, adahop/linear.py ``_plan``): stochastic rounding of operand
j (0 = A, 1 = B) of GEMM i (fprop 0, dgrad 1, wgrad 2) at the layer's n-th training call uses
``mix_seeds(config.seed, crc32(name), n, i, j)``; random signs use ``mix_seeds(config.seed,
crc32(name), i, 2)``.

Why bit-exact is possible: the reference backend computes the same float32 products of the same
dequantized operands in the same layout (M x Kp times (N x Kp)^T) with one thread (conftest), and
the OE slices with the same slicing as the formulas above, so any difference is a bug. Shapes: T =
88, K = 80, N = 48, none a multiple of 32, so every contraction dim is padded.

Which bugs these tests catch (checked by mutating the source, one change at a time): a layer that
ignores the configured block size, Hadamard size, random signs, scale mode or OE k; OE-left and
OE-right selecting along the wrong dim (rows vs columns) or picking the smallest norms; A's and B's
rounding swapped; stochastic rounding drawing the wrong seed.
"""

from __future__ import annotations

import dataclasses
import math
import zlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from adahop import AdaHOPConfig, AdaHOPLinear, block_hadamard, dequantize_mxfp4, quantize_mxfp4
from adahop.formats.rng import mix_seeds
from adahop.transforms.hadamard import random_signs

T, K, N = 88, 80, 48
GEMMS = ("fprop", "dgrad", "wgrad")
NAME = "blocks.3.mlp.up"
OE_K = 4
SEED = 11

# One case per mode, the same mode in every GEMM (OE-left is not allowed in wgrad: iht there).
UNIFORM_MODES = {
    m: {"fprop": m, "dgrad": m, "wgrad": "iht" if m == "iht+oe_left" else m}
    for m in ("bf16", "mxfp4", "iht", "iht+oe_left", "iht+oe_right")
}
MIXED_MODES = {
    "left-right-right": {"fprop": "iht+oe_left", "dgrad": "iht+oe_right", "wgrad": "iht+oe_right"},
    "right-left-mxfp4": {"fprop": "iht+oe_right", "dgrad": "iht+oe_left", "wgrad": "mxfp4"},
    "mxfp4-bf16-iht": {"fprop": "mxfp4", "dgrad": "bf16", "wgrad": "iht"},
    "bf16-iht-right": {"fprop": "bf16", "dgrad": "iht", "wgrad": "iht+oe_right"},
    "left-mxfp4-bf16": {"fprop": "iht+oe_left", "dgrad": "mxfp4", "wgrad": "bf16"},
}

# GemmConfig changes applied to all three GEMMs (the recipe's default: RNE for x and w, SR for g).
SETTINGS = {
    "default": {},
    "block16": dict(block_size=16),
    "block64": dict(block_size=64),
    "hadamard16": dict(hadamard_size=16),
    "hadamard64": dict(hadamard_size=64),
    "hadamard128-block16": dict(hadamard_size=128, block_size=16),
    "signs": dict(random_signs=True),
    "oe_k7": dict(oe_k=7),
    "floor": dict(scale_mode="floor"),
    "ceil": dict(scale_mode="ceil"),
    "rceil": dict(scale_mode="rceil"),
    "a_rne-b_sr": dict(a_rounding="rne", b_rounding="sr"),
    "all_sr": dict(a_rounding="sr", b_rounding="sr"),
}
# Each GEMM with settings of its own: a GEMM that read another GEMM's config would fail.
PER_GEMM = {
    "fprop": dict(block_size=16, hadamard_size=64, oe_k=6),
    "dgrad": dict(random_signs=True, scale_mode="rceil", oe_k=3, b_rounding="sr"),
    "wgrad": dict(block_size=64, scale_mode="floor", oe_k=5, a_rounding="rne"),
}


# ----------------------------------------------------------------------------------- data


def data(seed=0):
    """x, w, g, bias with a few planted large rows and columns (OE has something to find)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, K, generator=gen)
    x[[5, 40, 71]] *= torch.tensor([[6.0], [9.0], [4.0]])  # token rows (fprop OE-left)
    x[:, [2, 33, 60]] *= torch.tensor([5.0, 8.0, 3.0])  # input-feature columns (wgrad OE-right)
    w = torch.randn(N, K, generator=gen) / math.sqrt(K)
    w[[7, 30]] *= torch.tensor([[7.0], [4.0]])  # output-feature rows (fprop OE-right)
    w[:, [11, 50]] *= torch.tensor([6.0, 3.5])  # input-feature columns (dgrad OE-right)
    g = torch.randn(T, N, generator=gen)
    g[[3, 64]] *= torch.tensor([[10.0], [5.0]])  # token rows (dgrad OE-left)
    b = torch.randn(N, generator=gen)
    return x, w, g, b


def config(settings=None, per_gemm=None) -> AdaHOPConfig:
    cfg = AdaHOPConfig.from_recipe_name("adahop_lv2", backend="reference", seed=SEED).with_gemm_settings(oe_k=OE_K)
    if settings:
        cfg = cfg.with_gemm_settings(**settings)
    if per_gemm:
        cfg = cfg.replace(**{gm: dataclasses.replace(cfg.gemm(gm), **per_gemm[gm]) for gm in GEMMS})
    return cfg


def run_layer(cfg, modes, x, w, b, g, calls=1, autocast=False):
    """(y, dx, dw, db) of each of ``calls`` forward + backward passes of one layer."""
    lin = nn.Linear(K, N)
    with torch.no_grad():
        lin.weight.copy_(w)
        lin.bias.copy_(b)
    layer = AdaHOPLinear.from_float(lin, config=cfg, name=NAME)
    if cfg.adaptive:
        layer.set_modes(modes)
    assert layer.modes == modes
    out = []
    for _ in range(calls):
        layer.zero_grad(set_to_none=True)
        xr = x.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = layer(xr)
        y.backward(g.to(y.dtype))
        out.append((y.detach(), xr.grad, layer.weight.grad, layer.bias.grad))
    return out


# ------------------------------------------------------------------------------ reference


def top_k(norms: torch.Tensor, k: int) -> torch.Tensor:
    """Sorted indices of the k largest of float64 ``norms``, with a clear gap at the k-th."""
    k = min(k, norms.numel())
    order = torch.argsort(norms, descending=True)
    if k < norms.numel():
        kth, nxt = norms[order[k - 1]].item(), norms[order[k]].item()
        assert kth - nxt > 1e-4 * kth, f"near-tie at the k-th norm ({kth} vs {nxt}): pick other data"
    return order[:k].sort().values


def operand(t: torch.Tensor, cfg, iht: bool, rounding: str, sr_seed, signs_seed) -> torch.Tensor:
    """Rows of 2-D ``t`` (contraction dim last) padded, [signs +] Hadamard, quantized, dequantized:
    float32 [rows, padded]."""
    align = max(cfg.block_size, cfg.hadamard_size) if iht else cfg.block_size
    t = F.pad(t.to(torch.float32), (0, -t.shape[-1] % align))
    if iht:
        signs = random_signs(t.shape[-1], signs_seed) if cfg.random_signs else None
        t = block_hadamard(t, dim=-1, size=cfg.hadamard_size, signs=signs)
    q = quantize_mxfp4(
        t, dim=-1, block_size=cfg.block_size, scale_mode=cfg.scale_mode, rounding=rounding,
        seed=sr_seed if rounding == "sr" else None,
    )
    return dequantize_mxfp4(q)


def ref_gemm(gi: int, mode: str, cfg, A: torch.Tensor, B: torch.Tensor, call: int, seed: int, out_dtype):
    """C = A B in ``mode`` (the module doc's recipe), C in ``out_dtype``."""
    if mode == "bf16":
        return (A @ B).to(out_dtype)
    layer_id = zlib.crc32(NAME.encode())
    sr = [mix_seeds(seed, layer_id, call, gi, j) for j in (0, 1)]
    signs_seed = mix_seeds(seed, layer_id, gi, 2)
    rows = cols = None
    A_q, B_q = A, B
    if mode == "iht+oe_left":  # A's rows, L2 norm over Kc
        rows = top_k(A.double().square().sum(1).sqrt(), cfg.oe_k)
        A_q = A.clone()
        A_q[rows] = 0
    if mode == "iht+oe_right":  # B's columns, L2 norm over Kc
        cols = top_k(B.double().square().sum(0).sqrt(), cfg.oe_k)
        B_q = B.clone()
        B_q[:, cols] = 0
    iht = mode != "mxfp4"
    a = operand(A_q, cfg, iht, cfg.a_rounding, sr[0], signs_seed)
    bt = operand(B_q.t(), cfg, iht, cfg.b_rounding, sr[1], signs_seed)
    C = (a @ bt.t()).to(out_dtype)
    if rows is not None:
        C[rows] = (A[rows] @ B).to(out_dtype)
    if cols is not None:
        C[:, cols] = (A @ B[:, cols]).to(out_dtype)
    return C


def reference(cfg, modes, x, w, b, g, call=0, autocast=False):
    """Expected (y, dx, dw, db) of the layer's ``call``-th training call."""
    dt = torch.bfloat16 if autocast else x.dtype
    x_c, w_c, g_c = x.to(dt), w.to(dt), g.to(dt)
    y = ref_gemm(0, modes["fprop"], cfg.fprop, x_c, w_c.t(), call, cfg.seed, dt) + b.to(dt)
    dx = ref_gemm(1, modes["dgrad"], cfg.dgrad, g_c, w_c, call, cfg.seed, dt)
    dw_dtype = w.dtype if modes["wgrad"] != "bf16" else dt  # an MXFP4 wgrad keeps its fp32 result
    dw = ref_gemm(2, modes["wgrad"], cfg.wgrad, g_c.t(), x_c, call, cfg.seed, dw_dtype)
    db = g_c.sum(0)
    return y, dx.to(x.dtype), dw.to(w.dtype), db.to(b.dtype)


def assert_matches(got, want, what):
    for name, a, e in zip(("y", "dx", "dw", "db"), got, want):
        assert a.dtype == e.dtype and a.shape == e.shape, (what, name, a.dtype, e.dtype)
        if not torch.equal(a, e):
            diff = (a.double() - e.double()).abs()
            bad = int((diff > 0).sum())
            pytest.fail(f"{what}: {name} differs from the reference in {bad} of {a.numel()} entries "
                        f"(max |diff| {diff.max().item():.3g}, max |ref| {e.abs().max().item():.3g})")


def check(cfg, modes, calls=2, autocast=False, seed=0):
    x, w, g, b = data(seed)
    for call, got in enumerate(run_layer(cfg, modes, x, w, b, g, calls=calls, autocast=autocast)):
        assert_matches(got, reference(cfg, modes, x, w, b, g, call=call, autocast=autocast), f"call {call}")


# ---------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("settings", list(SETTINGS))
@pytest.mark.parametrize("mode", list(UNIFORM_MODES))
def test_every_mode_and_setting_bit_exact(mode, settings):
    """Two training calls (the second draws new SR seeds) of one layer, one mode in every GEMM."""
    check(config(SETTINGS[settings]), UNIFORM_MODES[mode])


@pytest.mark.parametrize("modes", list(MIXED_MODES))
def test_mixed_modes_bit_exact(modes):
    """Different modes per GEMM, including a quantized fprop with a bf16 wgrad (x saved as it
    is) and a bf16 fprop with a quantized wgrad (x quantized only for the backward)."""
    check(config(), MIXED_MODES[modes])


@pytest.mark.parametrize("modes", list(MIXED_MODES) + ["iht+oe_left", "iht+oe_right", "mxfp4"])
def test_each_gemm_reads_its_own_settings(modes):
    check(config(per_gemm=PER_GEMM), MIXED_MODES.get(modes) or UNIFORM_MODES[modes])


@pytest.mark.parametrize("recipe", ["mxfp4", "mxfp4_iht", "tseng"])
def test_fixed_recipes_bit_exact(recipe):
    """The recipes as built by ``from_recipe_name`` (tseng: random signs, SR on both backward
    operands, rceil scales), on their own seed and modes."""
    cfg = AdaHOPConfig.from_recipe_name(recipe, backend="reference", seed=SEED)
    check(cfg, cfg.fixed_modes())


@pytest.mark.parametrize("mode", list(UNIFORM_MODES))
def test_bf16_autocast_bit_exact(mode):
    """Under bf16 autocast: bf16 operands (the float32 weight cast), bf16 y and dx, OE slices as
    bf16 GEMMs, the MXFP4 wgrad kept in float32 (the parameter's dtype)."""
    check(config(), UNIFORM_MODES[mode], autocast=True)


def test_reference_is_not_trivially_the_float32_product():
    """The reference and the layer really quantize: far from x w^T, but within MXFP4's error."""
    x, w, g, b = data()
    cfg = config()
    y, dx, dw, _ = reference(cfg, UNIFORM_MODES["iht"], x, w, b, g)
    for got, exact in ((y, x @ w.t() + b), (dx, g @ w), (dw, g.t() @ x)):
        rel = ((got - exact).norm() / exact.norm()).item()
        assert 0.05 < rel < 0.3, rel  # MXFP4 on this data: ~0.1-0.2
