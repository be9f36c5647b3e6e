"""AdaHOPLinear (adahop.linear): the three GEMMs of every recipe and every mode against a float64
reference (the SQNR tier: each GEMM is as accurate as its mode should be, and a quantized mode is
really quantized), autograd, stochastic-rounding reproducibility, saved-tensor memory, bad inputs
and calibration. That the layer computes exactly what its mode and settings say (block size,
Hadamard size, signs, OE k, scale mode, rounding) is tests/test_linear_exact.py's job: an SQNR
window cannot tell a block size of 16 from one of 32.

Reference: float64 products of the very same (float32) tensors,
    y = x w^T,   dx = g w,   dw = g^T x,
and SQNR(ref, got) = 10 log10(|ref|^2 / |ref - got|^2) in dB.

SQNR thresholds (SQNR_MIN_DB below). How they were chosen: we first measured every recipe / mode on
i.i.d. Gaussian x [T, K], w [N, K] (scaled 1/sqrt(K)) and g [T, N], seed 0, on the two shapes used
here, (T, K, N) = (256, 128, 96) and (77, 50, 33) (not multiples of 32), OE k = 8:

    measured SQNR (dB)      fprop          dgrad          wgrad
    bf16 (float32 math)     134.0 / 137.7  135.0 / 139.5  130.7 / 135.7
    mxfp4                    16.1 /  15.8   14.2 /  14.2   14.2 /  14.0
    iht (mxfp4_iht)          16.0 /  16.6   14.3 /  14.3   14.3 /  14.7
    iht+oe_left  (k=8)       16.2 /  17.3   14.5 /  14.9   (not allowed)
    iht+oe_right (k=8)       16.5 /  18.1   14.6 /  15.3   14.6 /  15.8
    tseng                    16.1 /  15.8   12.4 /  12.6   12.6 /  13.2
    bf16 under CPU autocast  50.9           50.9           50.8

then set each lower bound ~2 dB under the smallest value seen. The bounds are meaningful: a bf16
rounding anywhere in the bf16 recipe's float32 path would give ~50 dB, far below 110; MXFP4 on
Gaussian data is ~16 dB in fprop (E2M1 has 1 mantissa bit) and ~14 dB in the backward GEMMs,
whose G operand is stochastically rounded (unbiased, but with a larger error than RNE); Tseng et
al. round both backward operands with SR and rceil scales, ~2 dB less again. Quantized modes also
get an *upper* bound (SQNR_MAX_QUANT_DB = 25 dB, seen at most 18.1): a GEMM that silently ran in
high precision would fail it.

Outlier ordering (planted, seed 0, (256, 128, 96)):
    x[:, 4 columns, one per 32-block] *= 10  -> fprop  mxfp4 13.7 dB, iht 16.2 dB (over 8 seeds the
        gap is 2.25-2.71 dB; with *= 30 the outlier columns dominate y's energy and the gap shrinks
        to 1.6-2.3 dB, so *10 is the cleaner demonstration)       -> assert gap >= 1.5 dB
    g[4 token rows] *= 30                    -> dgrad  iht 14.0 dB, iht+oe_left 26.1 dB -> gap >= 8 dB
    x[:, 4 columns] *= 30                    -> wgrad  iht 14.6 dB, iht+oe_right 29.3 dB -> gap >= 8 dB
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import adahop
from adahop import AdaHOPConfig, AdaHOPLinear

FIXED_RECIPES = ("bf16", "mxfp4", "mxfp4_iht", "tseng")
ADAPTIVE_RECIPES = ("adahop_lv2", "adahop_lv1")
ALL_RECIPES = FIXED_RECIPES + ADAPTIVE_RECIPES
MODES = ("bf16", "mxfp4", "iht", "iht+oe_left", "iht+oe_right")
GEMMS = ("fprop", "dgrad", "wgrad")
SHAPES = [(256, 128, 96), (77, 50, 33)]  # (T, K, N); the second is no multiple of 32 anywhere
OE_K = 8

# Lower bounds in dB, (fprop, dgrad, wgrad); see the module doc for the measurements behind them.
SQNR_MIN_DB = {
    "bf16": (110.0, 110.0, 110.0),
    "mxfp4": (14.0, 12.0, 12.0),
    "mxfp4_iht": (14.0, 12.0, 12.0),
    "tseng": (14.0, 10.5, 10.5),
}
MODE_SQNR_MIN_DB = {  # per mode, when that GEMM runs in the mode (G is SR-rounded in dgrad/wgrad)
    "bf16": (110.0, 110.0, 110.0),
    "mxfp4": (14.0, 12.0, 12.0),
    "iht": (14.0, 12.0, 12.0),
    "iht+oe_left": (14.0, 12.5, None),
    "iht+oe_right": (14.0, 12.5, 12.5),
}
SQNR_MAX_QUANT_DB = 25.0  # any MXFP4 mode on Gaussian data stays below this (seen: <= 18.1)
AUTOCAST_BF16_MIN_DB = 45.0  # bf16 recipe under bf16 autocast: seen 50.8-50.9


# ----------------------------------------------------------------------------------- helpers


def sqnr_db(ref: torch.Tensor, got: torch.Tensor) -> float:
    ref, got = ref.double(), got.double()
    noise = (ref - got).square().sum().item()
    if noise == 0:
        return math.inf
    return 10.0 * math.log10(ref.square().sum().item() / noise)


def gaussian_data(T, K, N, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, K, generator=gen)
    w = torch.randn(N, K, generator=gen) / math.sqrt(K)
    g = torch.randn(T, N, generator=gen)
    return x.to(dtype), w.to(dtype), g.to(dtype)


def make_layer(config, w, bias=None, name="layer", modes=None):
    N, K = w.shape
    lin = nn.Linear(K, N, bias=bias is not None, dtype=w.dtype)
    with torch.no_grad():
        lin.weight.copy_(w)
        if bias is not None:
            lin.bias.copy_(bias)
    layer = AdaHOPLinear.from_float(lin, config=config, name=name)
    if modes is not None:
        layer.set_modes(modes)
    return layer


def fwd_bwd(layer, x, g):
    xr = x.detach().clone().requires_grad_(True)
    y = layer(xr)
    y.backward(g)
    return y.detach(), xr.grad, layer.weight.grad


def reference(x, w, g):
    x, w, g = x.double(), w.double(), g.double()
    return x @ w.t(), g @ w, g.t() @ x


def three_sqnrs(x, w, g, y, dx, dw):
    y_ref, dx_ref, dw_ref = reference(x, w, g)
    return sqnr_db(y_ref, y), sqnr_db(dx_ref, dx), sqnr_db(dw_ref, dw)


def adaptive_config(recipe="adahop_lv2", **kw):
    return AdaHOPConfig.from_recipe_name(recipe, **kw).with_gemm_settings(oe_k=OE_K)


def modes_with(gemm, mode):
    """``mode`` in ``gemm``, bf16 in the other two."""
    modes = {g: "bf16" for g in GEMMS}
    modes[gemm] = mode
    return modes


# ------------------------------------------------------------------ accuracy vs float64 reference


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("recipe", FIXED_RECIPES)
def test_recipe_gemms_against_float64_reference(recipe, shape):
    T, K, N = shape
    x, w, g = gaussian_data(T, K, N)
    layer = make_layer(AdaHOPConfig.from_recipe_name(recipe), w)
    y, dx, dw = fwd_bwd(layer, x, g)
    assert y.shape == (T, N) and dx.shape == (T, K) and dw.shape == (N, K)
    got = three_sqnrs(x, w, g, y, dx, dw)
    for gemm, s, lo in zip(GEMMS, got, SQNR_MIN_DB[recipe]):
        assert s >= lo, f"{recipe} {gemm}: SQNR {s:.1f} dB < {lo} dB"
        if recipe != "bf16":
            assert s <= SQNR_MAX_QUANT_DB, f"{recipe} {gemm}: SQNR {s:.1f} dB: not quantized?"


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize(
    "gemm,mode",
    [(g, m) for g in GEMMS for m in MODES if not (g == "wgrad" and m == "iht+oe_left")],
)
def test_every_allowed_mode_in_every_gemm(gemm, mode, shape):
    """The mode under test in one GEMM, bf16 in the other two: each GEMM obeys its own mode."""
    T, K, N = shape
    x, w, g = gaussian_data(T, K, N)
    layer = make_layer(adaptive_config(), w, modes=modes_with(gemm, mode))
    assert not layer.calibrating
    got = dict(zip(GEMMS, three_sqnrs(x, w, g, *fwd_bwd(layer, x, g))))
    for other in GEMMS:
        s = got[other]
        if other != gemm:
            assert s >= 110.0, f"{other} should be high precision, SQNR {s:.1f} dB"
            continue
        lo = MODE_SQNR_MIN_DB[mode][GEMMS.index(gemm)]
        assert s >= lo, f"{gemm}={mode}: SQNR {s:.1f} dB < {lo} dB"
        if mode != "bf16":
            assert s <= SQNR_MAX_QUANT_DB, f"{gemm}={mode}: SQNR {s:.1f} dB: not quantized?"


@pytest.mark.parametrize("recipe", ADAPTIVE_RECIPES)
def test_all_gemms_quantized_together(recipe):
    """All three GEMMs in MXFP4 modes at once (the usual state after calibration)."""
    T, K, N = 77, 50, 33
    x, w, g = gaussian_data(T, K, N, seed=1)
    modes = {"fprop": "iht+oe_left", "dgrad": "iht+oe_right", "wgrad": "iht+oe_right"}
    layer = make_layer(adaptive_config(recipe), w, modes=modes)
    for gemm, s in zip(GEMMS, three_sqnrs(x, w, g, *fwd_bwd(layer, x, g))):
        assert 12.0 <= s <= SQNR_MAX_QUANT_DB, f"{gemm}: {s:.1f} dB"


def test_oe_left_is_refused_in_wgrad():
    layer = make_layer(adaptive_config(), torch.randn(8, 40))
    with pytest.raises(ValueError, match="wgrad"):
        layer.set_modes({"fprop": "iht", "dgrad": "iht", "wgrad": "iht+oe_left"})
    assert layer.calibrating  # the refused modes were not half-applied
    with pytest.raises(ValueError):
        AdaHOPConfig.from_recipe_name("mxfp4_iht").with_gemm_settings(mode="iht+oe_left")


def test_fprop_inner_dim_outliers_iht_beats_mxfp4():
    T, K, N = 256, 128, 96
    x, w, g = gaussian_data(T, K, N)
    x[:, [3, 40, 77, 100]] *= 10.0  # one large input-feature column per 32-block along K
    s = {}
    for mode in ("mxfp4", "iht"):
        layer = make_layer(adaptive_config(), w, modes=modes_with("fprop", mode))
        with torch.no_grad():
            s[mode] = sqnr_db(x.double() @ w.double().t(), layer(x))
    assert s["iht"] >= s["mxfp4"] + 1.5, s  # measured 16.2 vs 13.7


def test_dgrad_token_outliers_oe_left_beats_iht():
    T, K, N = 256, 128, 96
    x, w, g = gaussian_data(T, K, N)
    g[[5, 60, 130, 200]] *= 30.0  # a few large token rows of the output gradient (row-wise G)
    s = {}
    for mode in ("iht", "iht+oe_left"):
        layer = make_layer(adaptive_config(), w, modes=modes_with("dgrad", mode))
        _, dx, _ = fwd_bwd(layer, x, g)
        s[mode] = sqnr_db(g.double() @ w.double(), dx)
    assert s["iht+oe_left"] >= s["iht"] + 8.0, s  # measured 26.1 vs 14.0


def test_wgrad_channel_outliers_oe_right_beats_iht():
    T, K, N = 256, 128, 96
    x, w, g = gaussian_data(T, K, N)
    x[:, [3, 40, 77, 100]] *= 30.0  # B = x in wgrad: large columns are outer-dim outliers
    s = {}
    for mode in ("iht", "iht+oe_right"):
        layer = make_layer(adaptive_config(), w, modes=modes_with("wgrad", mode))
        _, _, dw = fwd_bwd(layer, x, g)
        s[mode] = sqnr_db(g.double().t() @ x.double(), dw)
    assert s["iht+oe_right"] >= s["iht"] + 8.0, s  # measured 29.3 vs 14.6


# ------------------------------------------------------------------------------------ settings


def test_gemm_settings_are_independent_per_gemm():
    """Each GEMM's settings are its own (docs/method.md, 'Strategy per GEMM'): changing fprop's
    Hadamard size changes y only, dgrad's random signs dx only, wgrad's scale mode dw only."""
    T, K, N = 77, 50, 33
    x, w, g = gaussian_data(T, K, N, seed=16)
    base = AdaHOPConfig.from_recipe_name("mxfp4_iht")
    variants = {
        "fprop": base.replace(fprop=dataclasses.replace(base.fprop, hadamard_size=64)),
        "dgrad": base.replace(dgrad=dataclasses.replace(base.dgrad, random_signs=True)),
        "wgrad": base.replace(wgrad=dataclasses.replace(base.wgrad, scale_mode="floor")),
    }
    ref = fwd_bwd(make_layer(base, w), x, g)
    for changed, cfg in variants.items():
        got = fwd_bwd(make_layer(cfg, w), x, g)
        for gemm, a, b in zip(GEMMS, ref, got):
            assert torch.equal(a, b) == (gemm != changed), (changed, gemm)


SETTINGS = [
    dict(hadamard_size=16), dict(hadamard_size=64), dict(hadamard_size=256),
    dict(block_size=16), dict(block_size=64), dict(block_size=64, hadamard_size=16),
    dict(scale_mode="floor"), dict(scale_mode="ceil"), dict(scale_mode="rceil"),
    dict(random_signs=True), dict(a_rounding="sr", b_rounding="sr"),
]


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()))
@pytest.mark.parametrize("mode", ["mxfp4", "iht", "iht+oe_right"])
def test_gemm_settings_variants(settings, mode):
    """Other Hadamard sizes (alignment = max(block, Hadamard size): K=50 pads to 256), block
    sizes, scale modes, random signs and SR everywhere: all three GEMMs stay MXFP4-accurate.
    Seen (77x50x33): 11.9-20.1 dB; "ceil" is the worst (it never uses the top of the grid)."""
    T, K, N = 77, 50, 33
    x, w, g = gaussian_data(T, K, N)
    cfg = AdaHOPConfig.from_recipe_name("mxfp4_iht").with_gemm_settings(mode=mode, oe_k=4, **settings)
    for gemm, s in zip(GEMMS, three_sqnrs(x, w, g, *fwd_bwd(make_layer(cfg, w), x, g))):
        assert 10.0 <= s <= SQNR_MAX_QUANT_DB, f"{gemm}: {s:.1f} dB"


# ------------------------------------------------------------------------------------ autograd


@pytest.mark.parametrize("bias", [False, True])
def test_gradcheck_bf16_recipe_float64(bias):
    torch.manual_seed(0)
    lin = nn.Linear(7, 5, bias=bias, dtype=torch.float64)
    layer = AdaHOPLinear.from_float(lin, config=AdaHOPConfig.from_recipe_name("bf16"), name="gc")
    names = [n for n, _ in layer.named_parameters()]
    assert names == (["weight", "bias"] if bias else ["weight"])
    x = torch.randn(2, 3, 7, dtype=torch.float64, requires_grad=True)
    params = [p.detach().clone().requires_grad_(True) for _, p in layer.named_parameters()]

    def f(x, *ps):
        return torch.func.functional_call(layer, dict(zip(names, ps)), (x,))

    assert f(x, *params).dtype == torch.float64
    assert torch.autograd.gradcheck(f, (x, *params), eps=1e-6, atol=1e-8)


@pytest.mark.parametrize("recipe", ["mxfp4", "mxfp4_iht", "tseng"])
def test_stochastic_rounding_is_reproducible_and_advances(recipe):
    cfg = AdaHOPConfig.from_recipe_name(recipe)
    assert cfg.dgrad.a_rounding == "sr" and cfg.wgrad.a_rounding == "sr"  # G is SR by default
    T, K, N = 96, 64, 48
    x, w, g = gaussian_data(T, K, N, seed=5)

    def grads(layer):
        y, dx, dw = fwd_bwd(layer, x, g)
        layer.weight.grad = None
        return y, dx, dw

    y1, dx1, dw1 = grads(make_layer(cfg, w, name="blk.fc"))
    y2, dx2, dw2 = grads(make_layer(cfg, w, name="blk.fc"))  # a fresh layer, same seed and name
    assert torch.equal(dx1, dx2) and torch.equal(dw1, dw2)
    assert torch.equal(y1, y2)

    same = make_layer(cfg, w, name="blk.fc")
    grads(same)
    y3, dx3, dw3 = grads(same)  # second call on the same layer: the call counter advanced
    assert same.calls == 2
    assert torch.equal(y3, y1)  # fprop rounds with RNE: no randomness there
    assert not torch.equal(dx3, dx1) and not torch.equal(dw3, dw1)

    other_seed = make_layer(cfg.replace(seed=1), w, name="blk.fc")
    _, dx4, dw4 = grads(other_seed)
    assert not torch.equal(dx4, dx1) and not torch.equal(dw4, dw1)
    # all of them remain good estimates of the true gradient
    for dx, dw in ((dx1, dw1), (dx3, dw3), (dx4, dw4)):
        assert sqnr_db(g.double() @ w.double(), dx) >= 10.5
        assert sqnr_db(g.double().t() @ x.double(), dw) >= 10.5


def test_stochastic_rounding_is_unbiased_over_calls():
    """Averaging the SR gradient over many calls approaches the exact product much more closely
    than one call does (RNE's error would not average away)."""
    T, K, N = 64, 64, 32
    x, w, g = gaussian_data(T, K, N, seed=6)
    layer = make_layer(AdaHOPConfig.from_recipe_name("tseng"), w)
    dws = []
    for _ in range(16):
        dws.append(fwd_bwd(layer, x, g)[2].clone())
        layer.weight.grad = None
    ref = g.double().t() @ x.double()
    one = sqnr_db(ref, dws[0])
    mean = sqnr_db(ref, torch.stack(dws).mean(0))
    assert mean >= one + 6.0, (one, mean)  # ideal: +12 dB for 16 independent draws


# ------------------------------------------------------------------------------ saved tensors


def saved_tensors_of_forward(layer, x, autocast=False):
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = layer(x)
    return y, saved


def split_by_parameter(saved, param):
    ptr = param.untyped_storage().data_ptr()
    ours = [t for t in saved if t.untyped_storage().data_ptr() == ptr]
    rest = [t for t in saved if t.untyped_storage().data_ptr() != ptr]
    return ours, rest


def nbytes(ts):
    return sum(t.numel() * t.element_size() for t in ts)


@pytest.mark.parametrize("recipe", ["mxfp4", "mxfp4_iht", "tseng"])
def test_saved_activation_is_packed_mxfp4(recipe):
    T, K, N = 1024, 512, 256
    gen = torch.Generator().manual_seed(7)
    w = (torch.randn(N, K, generator=gen) / math.sqrt(K)).to(torch.bfloat16)
    x = torch.randn(T, K, generator=gen).to(torch.bfloat16).requires_grad_(True)

    base = make_layer(AdaHOPConfig.from_recipe_name("bf16"), w)
    _, saved_base = saved_tensors_of_forward(base, x)
    w_base, x_base = split_by_parameter(saved_base, base.weight)
    assert len(w_base) == 1 and nbytes(x_base) == T * K * 2  # bf16 recipe keeps x itself

    layer = make_layer(AdaHOPConfig.from_recipe_name(recipe), w)
    y, saved = saved_tensors_of_forward(layer, x)
    w_saved, x_saved = split_by_parameter(saved, layer.weight)
    assert len(w_saved) == 1  # the weight: by reference to the parameter, nothing else of it
    rng = [t for t in x_saved if t.dtype == torch.int64 and t.shape == (2,)]
    assert len(rng) == 1  # the call's SR chain state (16 bytes), which the backward's seeds read
    x_saved = [t for t in x_saved if t is not rng[0]]
    assert nbytes(x_saved) == T * K // 2 + T * K // 32  # 4-bit codes + one E8M0 byte per 32
    ratio = nbytes(x_saved) / nbytes(x_base)
    assert ratio == pytest.approx(0.53125 / 2, rel=1e-3)
    y.float().sum().backward()  # the saved tensors are enough for the backward
    assert x.grad.shape == (T, K) and layer.weight.grad.shape == (N, K)


def test_autocast_saves_no_weight_copy():
    """fp32 master weights under bf16 autocast (the demo's GPU setup). linear.py's design doc:
    "The weight is re-quantized along N in the backward from the parameter, which is alive
    anyway: saving a second quantized copy would cost memory for nothing." So an MXFP4 recipe
    should save x packed (0.53 bytes/element) and a reference to the parameter, nothing
    weight-sized besides."""
    T, K, N = 1024, 512, 256
    gen = torch.Generator().manual_seed(8)
    w = torch.randn(N, K, generator=gen) / math.sqrt(K)
    x = torch.randn(T, K, generator=gen, requires_grad=True)
    layer = make_layer(AdaHOPConfig.from_recipe_name("mxfp4"), w)
    y, saved = saved_tensors_of_forward(layer, x, autocast=True)
    assert y.dtype == torch.bfloat16
    _, rest = split_by_parameter(saved, layer.weight)
    # x's packed form, plus the call's 16-byte SR chain state
    assert nbytes(rest) <= T * K // 2 + T * K // 32 + 16, [(tuple(t.shape), t.dtype) for t in rest]


# ------------------------------------------------------------------------------- bad inputs


def test_integer_input_is_refused():
    layer = make_layer(AdaHOPConfig.from_recipe_name("mxfp4"), torch.randn(8, 40))
    with pytest.raises(ValueError, match="floating"):
        layer(torch.ones(4, 40, dtype=torch.int64))
    with pytest.raises(ValueError, match="floating"):
        layer(torch.ones(4, 40, dtype=torch.bool))


def test_wrong_last_dim_is_refused():
    layer = make_layer(AdaHOPConfig.from_recipe_name("mxfp4"), torch.randn(8, 40))
    with pytest.raises(ValueError, match="in_features"):
        layer(torch.randn(4, 41))
    with pytest.raises(ValueError, match="in_features"):
        layer(torch.randn(40, 4))
    with pytest.raises(ValueError):
        layer(torch.tensor(1.0))


EMPTY_CASES = [(r, None) for r in ALL_RECIPES] + [
    ("adahop_lv2", {"fprop": m, "dgrad": m, "wgrad": "iht" if m == "iht+oe_left" else m})
    for m in MODES
]


@pytest.mark.filterwarnings("ignore:.*OE k=.*clamped:UserWarning")  # OE over 0 tokens
@pytest.mark.parametrize(
    "recipe,modes", EMPTY_CASES, ids=[f"{r}-{m['fprop'] if m else 'default'}" for r, m in EMPTY_CASES]
)
def test_empty_batch(recipe, modes):
    K, N = 50, 33
    gen = torch.Generator().manual_seed(9)
    w, b = torch.randn(N, K, generator=gen), torch.randn(N, generator=gen)
    cfg = adaptive_config(recipe) if modes else AdaHOPConfig.from_recipe_name(recipe)
    layer = make_layer(cfg, w, bias=b, modes=modes)
    x = torch.randn(2, 0, K, requires_grad=True)
    y = layer(x)
    assert y.shape == (2, 0, N)
    y.sum().backward()
    assert x.grad.shape == (2, 0, K)
    assert layer.weight.grad.shape == (N, K) and torch.equal(layer.weight.grad, torch.zeros(N, K))
    assert torch.equal(layer.bias.grad, torch.zeros(N))


LAYOUT_CASES = [(r, None) for r in FIXED_RECIPES] + [
    ("adahop_lv1", {"fprop": "iht+oe_left", "dgrad": "iht+oe_right", "wgrad": "iht+oe_right"}),
    ("adahop_lv2", {"fprop": "iht+oe_right", "dgrad": "iht+oe_left", "wgrad": "mxfp4"}),
]


@pytest.mark.parametrize(
    "recipe,modes", LAYOUT_CASES, ids=[f"{r}-{m['fprop'] if m else 'default'}" for r, m in LAYOUT_CASES]
)
def test_3d_and_non_contiguous_inputs_match_2d(recipe, modes):
    B, S, K, N = 3, 25, 50, 33  # T = 75 tokens
    gen = torch.Generator().manual_seed(10)
    w, b = torch.randn(N, K, generator=gen) / math.sqrt(K), torch.randn(N, generator=gen)
    x2 = torch.randn(B * S, K, generator=gen)
    g2 = torch.randn(B * S, N, generator=gen)
    cfg = adaptive_config(recipe) if modes else AdaHOPConfig.from_recipe_name(recipe)

    def run(x, g):
        layer = make_layer(cfg, w, bias=b, name="same", modes=modes)  # fresh: same SR seeds
        xr = x.detach().requires_grad_(True)
        y = layer(xr)
        y.backward(g)
        return y.detach().reshape(-1, N), xr.grad.reshape(-1, K), layer.weight.grad, layer.bias.grad

    ref = run(x2, g2)
    x3 = x2.reshape(B, S, K)
    got3 = run(x3, g2.reshape(B, S, N))
    xt = x2.t().contiguous().t()  # same values, a transposed (non-contiguous) view
    assert not xt.is_contiguous()
    got_t = run(xt, g2)
    x3_nc = x2.reshape(S, B, K).transpose(0, 1).contiguous().transpose(0, 1)  # 3-D, strided
    assert not x3_nc.is_contiguous()
    got_3nc = run(x3_nc, g2.reshape(S, B, N))
    for got in (got3, got_t, got_3nc):
        for a, c in zip(ref, got):
            assert torch.equal(a, c)


@pytest.mark.parametrize("recipe", FIXED_RECIPES)
def test_float64_inputs(recipe):
    T, K, N = 77, 50, 33
    x, w, g = gaussian_data(T, K, N, seed=11, dtype=torch.float64)
    layer = make_layer(AdaHOPConfig.from_recipe_name(recipe), w)
    y, dx, dw = fwd_bwd(layer, x, g)
    assert y.dtype == dx.dtype == dw.dtype == torch.float64
    lows = (250.0,) * 3 if recipe == "bf16" else SQNR_MIN_DB[recipe]
    for gemm, s, lo in zip(GEMMS, three_sqnrs(x, w, g, y, dx, dw), lows):
        assert s >= lo, f"{recipe} {gemm}: {s:.1f} dB"


@pytest.mark.parametrize("recipe", FIXED_RECIPES + ("adahop_lv2",))
def test_bf16_autocast_on_cpu(recipe):
    T, K, N = 77, 50, 33
    x, w, g = gaussian_data(T, K, N, seed=12)
    b = torch.randn(N, generator=torch.Generator().manual_seed(13))
    cfg = adaptive_config(recipe) if recipe == "adahop_lv2" else AdaHOPConfig.from_recipe_name(recipe)
    layer = make_layer(cfg, w, bias=b)
    if recipe == "adahop_lv2":
        layer.set_modes({"fprop": "iht+oe_left", "dgrad": "iht+oe_left", "wgrad": "iht+oe_right"})
    xr = x.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(xr)
    assert y.dtype == torch.bfloat16
    y.backward(g.to(torch.bfloat16))
    assert xr.grad.dtype == torch.float32 and layer.weight.grad.dtype == torch.float32
    assert layer.bias.grad.dtype == torch.float32
    s = sqnr_db(x.double() @ w.double().t() + b.double(), y)
    assert s >= (AUTOCAST_BF16_MIN_DB if recipe == "bf16" else 14.0), s
    # An MXFP4 wgrad writes the weight's gradient in the parameter's dtype (fp32), not rounded
    # to bf16 first; a bf16 wgrad (the bf16 recipe, as nn.Linear under autocast) is bf16's.
    dw = layer.weight.grad
    rounded = torch.equal(dw, dw.to(torch.bfloat16).float())
    assert rounded == (recipe == "bf16"), recipe


NAN_CASES = [(r, None) for r in ("mxfp4", "mxfp4_iht", "tseng")] + [
    ("adahop_lv2", {"fprop": m, "dgrad": "iht", "wgrad": "iht+oe_right" if m == "iht+oe_right" else "iht"})
    for m in ("iht", "iht+oe_left", "iht+oe_right")
]


@pytest.mark.parametrize(
    "recipe,modes", NAN_CASES, ids=[f"{r}-{m['fprop'] if m else 'default'}" for r, m in NAN_CASES]
)
def test_nan_input_propagates(recipe, modes):
    T, K, N = 77, 50, 33
    x, w, g = gaussian_data(T, K, N, seed=14)
    x[3, 5] = float("nan")
    cfg = adaptive_config(recipe) if modes else AdaHOPConfig.from_recipe_name(recipe)
    layer = make_layer(cfg, w, modes=modes)
    y, dx, dw = fwd_bwd(layer, x, g)
    assert y[3].isnan().all()  # the token holding the NaN
    rows = torch.ones(T, dtype=torch.bool)
    rows[3] = False
    assert torch.isfinite(y[rows]).all()  # the other tokens are untouched
    assert torch.isfinite(dx).all()  # dgrad does not involve x
    assert dw[:, 5].isnan().all()  # the input feature holding the NaN
    cols = torch.ones(K, dtype=torch.bool)
    cols[5] = False
    assert torch.isfinite(dw[:, cols]).all()


# ------------------------------------------------------------------------------- calibration


def calibrating_layer(recipe="adahop_lv2", steps=3, bias=True, seed=20, K=64, N=48, **cfg):
    gen = torch.Generator().manual_seed(seed)
    lin = nn.Linear(K, N, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(N, K, generator=gen) / math.sqrt(K))
        if bias:
            lin.bias.copy_(torch.randn(N, generator=gen))
    config = AdaHOPConfig.from_recipe_name(recipe, calibration_steps=steps, **cfg).with_gemm_settings(oe_k=4)
    return lin, AdaHOPLinear.from_float(lin, config=config, name="cal")


def planted(T=128, K=64, N=48, seed=21):
    """x with a few large input-feature columns (col-wise), g with a few large token rows."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, K, generator=gen)
    x[:, [2, 17, 40]] *= 20.0
    g = torch.randn(T, N, generator=gen)
    g[[1, 50, 99]] *= 20.0
    return x, g


@pytest.mark.parametrize("bias", [False, True])
def test_calibrating_layer_runs_in_high_precision(bias):
    lin, layer = calibrating_layer(bias=bias)
    assert layer.calibrating and layer.modes is None
    x, g = planted()
    for _step in range(2):
        xr = x.clone().requires_grad_(True)
        y = layer(xr)
        assert torch.equal(y, lin(x))  # same as the plain nn.Linear, bit for bit
        y.backward(g)
        xl = x.clone().requires_grad_(True)
        lin.weight.grad = None
        assert torch.equal(xr.grad, torch.autograd.grad(lin(xl), xl, g)[0])
        assert layer.calibrating


@pytest.mark.parametrize("recipe,level", [("adahop_lv2", "lv2"), ("adahop_lv1", "lv1")])
def test_calibration_counts_backward_passes_and_freezes(recipe, level):
    _, layer = calibrating_layer(recipe)
    x, g = planted()
    for step in range(1, 4):
        assert layer.calibrating
        y = layer(x.clone().requires_grad_(True))
        assert layer.calibration.steps == step - 1  # a forward alone is not a step
        y.backward(g)
        assert layer.calibration.steps == step
    assert not layer.calibrating
    assert layer.patterns == {"x": "col", "w": "none", "g": "row"}  # what was planted
    assert layer.modes == adahop.modes_from_patterns(layer.patterns, level)
    expected = {
        "fprop": "iht",  # (col, flip(none))
        "dgrad": "iht+oe_left",  # (row, none)
        "wgrad": "bf16" if level == "lv2" else "iht+oe_right",  # (flip(row)=col, col)
    }
    assert layer.modes == expected
    votes = layer.calibration.tensors
    assert votes["x"].votes["col"] == 3 and votes["g"].votes["row"] == 3
    # frozen: more steps change nothing, and fprop is now quantized
    before = dict(layer.modes)
    layer(x.clone().requires_grad_(True)).backward(g)
    assert layer.modes == before and layer.calibration.steps == 3
    with torch.no_grad():
        s = sqnr_db(F.linear(x, layer.weight, layer.bias).double(), layer(x))
    assert 10.0 <= s <= SQNR_MAX_QUANT_DB


def test_eval_and_no_grad_forwards_do_not_count():
    lin, layer = calibrating_layer()
    x, g = planted()
    layer(x.clone().requires_grad_(True)).backward(g)
    assert layer.calibration.steps == 1
    votes = {r: dict(t.votes) for r, t in layer.calibration.tensors.items()}
    with torch.no_grad():
        y = layer(x)
    assert torch.equal(y, lin(x))
    layer.eval()
    y = layer(x.clone().requires_grad_(True))
    assert torch.equal(y.detach(), lin(x).detach())
    y.backward(g)  # a backward of an eval-mode forward is not a calibration step either
    layer.train()
    assert layer.calibration.steps == 1
    assert {r: dict(t.votes) for r, t in layer.calibration.tensors.items()} == votes
    assert layer.calibrating


def test_finish_calibration_early():
    _, layer = calibrating_layer(steps=30)
    with pytest.raises(ValueError):
        layer.finish_calibration()  # nothing observed yet
    x, g = planted()
    layer(x.clone().requires_grad_(True)).backward(g)
    modes = layer.finish_calibration()
    assert not layer.calibrating
    assert modes == layer.modes == adahop.modes_from_patterns(layer.patterns, "lv2")
    assert layer.patterns == {"x": "col", "w": "none", "g": "row"}

    # the model-level helper does the same for every still-calibrating layer
    model = nn.Sequential(nn.Linear(64, 48), nn.GELU(), nn.Linear(48, 16))
    cfg = AdaHOPConfig.from_recipe_name("adahop_lv2", calibration_steps=30)
    adahop.convert_to_adahop_training(model, config=cfg)
    model(torch.randn(32, 64)).square().sum().backward()
    assert not adahop.is_calibrated(model)
    out = adahop.finish_calibration(model)
    assert set(out) == {"0", "2"} and adahop.is_calibrated(model)
    assert adahop.finish_calibration(model) == {}


def test_non_adaptive_recipe_has_no_calibration():
    layer = make_layer(AdaHOPConfig.from_recipe_name("mxfp4"), torch.randn(8, 40))
    assert not layer.calibrating
    with pytest.raises(ValueError, match="not adaptive"):
        layer.finish_calibration()


def test_extra_repr_shows_patterns_and_modes():
    _, layer = calibrating_layer()
    x, g = planted()
    layer(x.clone().requires_grad_(True)).backward(g)
    text = repr(layer)
    assert "calibrating 1/3" in text and "recipe=adahop_lv2" in text
    for _ in range(2):
        layer(x.clone().requires_grad_(True)).backward(g)
    text = layer.extra_repr()
    assert "patterns: x=col, w=none, g=row" in text
    assert "modes: fprop=iht, dgrad=iht+oe_left, wgrad=bf16" in text
    assert "calibrating" not in text


def test_custom_policy_fn_is_used():
    seen = []

    def policy(summary):
        seen.append(summary)
        return {"fprop": "mxfp4", "dgrad": "iht+oe_right", "wgrad": "iht"}

    _, layer = calibrating_layer(steps=2, policy_fn=policy)
    x, g = planted()
    for _ in range(2):
        layer(x.clone().requires_grad_(True)).backward(g)
    assert len(seen) == 1
    summary = seen[0]
    assert set(summary) == {"x", "w", "g"}
    assert summary["x"]["pattern"] == "col" and summary["g"]["pattern"] == "row"
    for role in "xwg":
        assert {"cv_row", "cv_col", "row_energy_topk", "col_energy_topk"} <= set(summary[role])
        assert all(math.isfinite(summary[role][k]) for k in ("cv_row", "cv_col"))
    # g has 3 rows x20 of 128: with k=4 the top rows hold most of its energy (seen 0.90), while
    # its top-4 columns hold little (an i.i.d. share would be 4/48)
    assert summary["g"]["row_energy_topk"] > 0.8
    assert summary["g"]["col_energy_topk"] < 0.3
    assert layer.modes == {"fprop": "mxfp4", "dgrad": "iht+oe_right", "wgrad": "iht"}
    assert layer.patterns == {"x": "col", "w": "none", "g": "row"}


def test_custom_policy_returning_invalid_modes_is_refused():
    _, layer = calibrating_layer(steps=1, policy_fn=lambda s: {"fprop": "iht", "dgrad": "iht", "wgrad": "iht+oe_left"})
    x, g = planted()
    with pytest.raises(ValueError, match="wgrad"):
        layer(x.clone().requires_grad_(True)).backward(g)


@pytest.mark.parametrize("recipe", ["mxfp4", "adahop_lv2"])
def test_no_grad_forward_saves_nothing_for_wgrad(recipe, monkeypatch):
    """Under no_grad (evaluation) the forward gives the same output and skips the wgrad
    quantization of x (nothing will use it)."""
    from adahop.ops.backends import ReferenceBackend

    x, w, _ = gaussian_data(64, 64, 32)
    modes = {"fprop": "iht", "dgrad": "iht+oe_left", "wgrad": "iht+oe_right"} if recipe == "adahop_lv2" else None
    config = AdaHOPConfig.from_recipe_name(recipe, backend="reference").with_gemm_settings(oe_k=8)
    layer = make_layer(config, w, modes=modes)
    calls = []
    original = ReferenceBackend.quantize_packed
    monkeypatch.setattr(
        ReferenceBackend, "quantize_packed", lambda self, *a, **k: calls.append(1) or original(self, *a, **k))
    y_grad = layer(x.clone().requires_grad_(True))
    assert len(calls) == 1  # x along T for wgrad
    with torch.no_grad():
        y_eval = layer(x)
    assert len(calls) == 1
    assert torch.equal(y_grad.detach(), y_eval)


def test_evaluation_between_steps_does_not_change_training():
    """Forwards without a backward do not advance the SR seeds: a training run with an
    evaluation between its steps gives the same gradients as one without."""
    x, w, g = gaussian_data(64, 64, 32)
    cfg = AdaHOPConfig.from_recipe_name("tseng", backend="reference")  # SR in the backward
    grads = []
    for evaluate in (False, True):
        layer = make_layer(cfg, w)
        fwd_bwd(layer, x, g)
        if evaluate:
            with torch.no_grad():
                layer(x)
        layer.weight.grad = None
        grads.append(fwd_bwd(layer, x, g)[2].clone())
    assert torch.equal(grads[0], grads[1])
    assert layer.calls == 2


def test_a_policys_own_oe_k_reaches_the_gemms_and_the_state(tmp_path):
    """A layer whose policy chose an OE k per GEMM runs it (the plan's k), keeps it in its extra
    state and in modes.json, and a bad k is refused in one line."""
    from adahop.modes_io import load_modes, save_modes

    def layer():
        return AdaHOPLinear.from_float(torch.nn.Linear(64, 96, bias=False),
                                       config=AdaHOPConfig.from_recipe_name("adahop_lv2"), name="l")

    a = layer()
    modes = {"fprop": "iht", "dgrad": "iht+oe_left", "wgrad": "iht+oe_right"}
    a.set_modes(modes, oe_ks={"dgrad": 16, "wgrad": 8})
    plan = a._plan(torch.device("cpu"))
    assert (plan.fprop.oe_k, plan.dgrad.oe_k, plan.wgrad.oe_k) == (a.config.fprop.oe_k, 16, 8)
    b = layer()
    b.load_state_dict(a.state_dict())
    assert b.oe_ks == {"dgrad": 16, "wgrad": 8} and b._plan(torch.device("cpu")).wgrad.oe_k == 8
    holder = torch.nn.Sequential(a)
    save_modes(holder, tmp_path / "modes.json")
    c = torch.nn.Sequential(layer())
    load_modes(c, tmp_path / "modes.json")
    assert c[0].oe_ks == {"dgrad": 16, "wgrad": 8} and c[0].modes == modes
    with pytest.raises(ValueError, match="oe_k must map GEMMs"):
        a.set_modes(modes, oe_ks={"dgrad": 0})


def test_calibration_in_iht_saves_packed_x_and_observes_the_same():
    """calibration_gemms="iht": the calibration steps run IHT + MXFP4 (x saved packed, as the
    fixed recipes save it) and observe x, w and g as BF16 calibration does: one layer given the
    same inputs and output gradients records the same statistics and freezes the same modes."""
    T, K, N = 256, 128, 96
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(N, K, generator=gen) / math.sqrt(K)
    xs = [torch.randn(T, K, generator=gen) for _ in range(2)]
    gs = [torch.randn(T, N, generator=gen) for _ in range(2)]
    layers = {}
    for gemms in ("bf16", "iht"):
        cfg = AdaHOPConfig.from_recipe_name("adahop_lv2", calibration_steps=2, calibration_gemms=gemms)
        layer = make_layer(cfg, w)
        for i, (x, g) in enumerate(zip(xs, gs)):
            x = x.clone().requires_grad_()
            y, saved = saved_tensors_of_forward(layer, x)
            _, x_saved = split_by_parameter(saved, layer.weight)
            if i == 0:
                x_bytes = nbytes([t for t in x_saved if not (t.dtype == torch.int64 and t.shape == (2,))])
                assert x_bytes == (T * K * 4 if gemms == "bf16" else T * K // 2 + T * K // 32)
            assert layer.calibrating
            y.backward(g)
        layers[gemms] = layer
    bf16, iht = layers["bf16"], layers["iht"]
    assert not iht.calibrating and iht.modes == bf16.modes and iht.patterns == bf16.patterns
    for role in ("x", "w", "g"):
        assert iht.calibration.tensors[role].sums == bf16.calibration.tensors[role].sums
    assert iht.calls == bf16.calls == 2
    with pytest.raises(ValueError, match="calibration_gemms must be one of"):
        AdaHOPConfig.from_recipe_name("adahop_lv2", calibration_gemms="mxfp4")
