"""The e4m3 GEMM form with its row exponent from a bound on the row's magnitudes
(``formats.e4m3_rows``): the reference's guarantees, the kernels against it bit for bit (one
orientation, both orientations, e4m3 + packed; CPU through TRITON_INTERPRET=1), and the layer, whose
outputs and gradients the bounds leave unchanged where no block falls out of the exact window."""

import copy

import pytest
import torch
from torch import nn

triton = pytest.importorskip("triton")

from emulated_hopper import EmulatedHopper  # noqa: E402

import adahop  # noqa: E402
import adahop.kernels.quantize_both as kqb  # noqa: E402
import adahop.layer.plan  # noqa: E402
from adahop.formats.e4m3_rows import bound_row_exponent, exact_row_exponent, fold_e4m3  # noqa: E402
from adahop.formats.mxfp4 import dequantize_mxfp4  # noqa: E402
from adahop.kernels.quantize import quantize_operand_triton  # noqa: E402
from adahop.kernels.quantize_both import quantize_both  # noqa: E402
from adahop.layer.bounds import magnitude_bound  # noqa: E402
from adahop.ops.operand import OperandSpec, quantize_operand  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make(shape, seed=0, spread=2.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp(torch.randn(shape[0], 1, generator=g) * spread)
    x[torch.rand(shape, generator=g) < 0.01] *= 40
    return x.to(torch.bfloat16).to(DEVICE)


def assert_fold(got, q, e_row):
    e4, rs = fold_e4m3(q, e_row)
    assert torch.equal(got["e4m3"].view(torch.uint8), e4.view(torch.uint8))
    assert torch.equal(got["row_scale"], rs)


SPECS = [
    OperandSpec(),
    OperandSpec(hadamard_size=32, scale_mode="even"),
    OperandSpec(hadamard_size=16, scale_mode="rceil", rounding="sr", sr_seed=3),
    OperandSpec(hadamard_size=64, scale_mode="ceil", signs_seed=5),
    OperandSpec(hadamard_size=128, scale_mode="floor", rounding="sr", sr_seed=8),
]


@pytest.mark.parametrize("single_chunk_max", [0, 4096])
@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("spec", SPECS)
def test_kernel_equals_the_fold_of_the_reference(spec, dim, single_chunk_max):
    """With a bound, the kernel's e4m3 form is ``fold_e4m3`` of the reference's MXFP4 values at the
    bound's exponent (one pass over several chunks, or one chunk); without, at the exact row
    maximum. The packed form is the reference's either way."""
    x = make((24, 300), seed=dim)
    view = x if dim == 1 else x.t()
    bound = magnitude_bound(view, 1)
    ref = quantize_operand(x, dim, spec)
    got = quantize_operand_triton(x, dim, spec, e4m3=True, row_bound=bound, single_chunk_max=single_chunk_max)
    assert torch.equal(got["mx"].codes, ref.codes) and torch.equal(got["mx"].scale_e8m0, ref.scale_e8m0)
    e_row = bound_row_exponent(bound, spec.log2_hadamard, spec.scale_mode)
    assert_fold(got, ref, e_row)
    exact = quantize_operand_triton(x, dim, spec, e4m3=True, single_chunk_max=single_chunk_max)
    assert_fold(exact, ref, exact_row_exponent(ref))


def test_k_split_with_a_bound():
    x = make((8, 1024), seed=4)
    spec = OperandSpec(hadamard_size=32, rounding="sr", sr_seed=1)
    bound = magnitude_bound(x, 1)
    one = quantize_operand_triton(x, 1, spec, e4m3=True, packed=False, row_bound=bound, k_splits=1,
                                  single_chunk_max=0)
    split = quantize_operand_triton(x, 1, spec, e4m3=True, packed=False, row_bound=bound, k_splits=3,
                                    single_chunk_max=0)
    assert torch.equal(one["e4m3"].view(torch.uint8), split["e4m3"].view(torch.uint8))
    assert torch.equal(one["row_scale"], split["row_scale"])


@pytest.mark.parametrize("log2_h", [0, 4, 5, 6, 7, 8])
def test_the_bound_is_at_or_above_every_block(log2_h):
    """Rows built to reach the transform's largest growth: constant rows (each group's first output
    is sqrt(H) times the value), rows of +-max in a Hadamard row's signs, and random rows; with the
    bound taken exactly and taken as the maximum before the bfloat16 rounding (smaller by up to
    2**-9), in every scale mode."""
    h = 1 << log2_h
    n = max(h, 32) * 4
    g = torch.Generator().manual_seed(log2_h)
    # a row of the (Sylvester) Hadamard matrix in each group: (-1)**popcount((H - 1) & j)
    j = torch.arange(n) % h
    parity = torch.zeros(n, dtype=torch.int64)
    for bit in range(log2_h):
        parity ^= (j >> bit) & 1
    signs = (1 - 2 * parity).float()[None, :]
    rows = torch.cat([
        torch.full((4, n), 1.0) * torch.tensor([[1.0], [1.99], [3.0], [2.0**-100]]),
        signs.expand(3, n) * torch.tensor([[1.0], [2.5], [7.0]]),
        torch.randn(8, n, generator=g) * 10.0 ** torch.randint(-5, 5, (8, 1), generator=g),
    ])
    x32 = rows * (1 + 2.0**-9)  # rounds down to bfloat16 in some rows: the raw maximum is larger
    x = x32.to(torch.bfloat16)
    for mode in ("floor", "even", "ceil", "rceil"):
        spec = OperandSpec(hadamard_size=h if h > 1 else None, scale_mode=mode)
        q = quantize_operand(x, 1, spec)
        exact = exact_row_exponent(q)
        for bound in (magnitude_bound(x, 1), x32.abs().amax(1) * (1 - 2.0**-8)):
            e_row = bound_row_exponent(bound, spec.log2_hadamard, mode)
            assert (e_row >= exact).all(), (h, mode)
            assert (e_row - exact).max() <= log2_h // 2 + 3  # the slack: the factor and the raw-to-block gap


def test_the_fold_is_exact_within_14_binades_of_the_row_exponent():
    x = make((32, 256), seed=7, spread=0.5)
    spec = OperandSpec(hadamard_size=32)
    q = quantize_operand(x, 1, spec)
    e_row = bound_row_exponent(magnitude_bound(x, 1), 5, spec.scale_mode)
    e4, rs = fold_e4m3(q, e_row)
    deq = dequantize_mxfp4(q, keep_padding=True)
    blocks = q.scale_e8m0.to(torch.int32) - 127
    inside = (blocks >= e_row[:, None] - 14).repeat_interleave(32, dim=1)
    assert inside.float().mean() > 0.99
    fold = e4.float() * rs[:, None]
    assert torch.equal(fold[inside], deq[inside])
    # a block below the window is rounded, within 2**-15 of 2**(e_row + 2)
    err = (fold - deq).abs()
    assert (err <= 2.0 ** (e_row[:, None].float() + 2 - 15)).all()


def test_bounds_that_are_not_finite_or_overflow():
    """NaN, Inf and bounds whose product overflows take the largest finite exponent; 0 the smallest."""
    b = torch.tensor([float("nan"), float("inf"), 3e38, 0.0, -2.0, 1.0])
    e = bound_row_exponent(b, 5, "floor")
    top = bound_row_exponent(torch.tensor([torch.finfo(torch.float32).max]), 0, "floor")
    assert e[:3].tolist() == [top.item()] * 3
    assert e[3].item() == -127
    assert e[4].item() == bound_row_exponent(torch.tensor([2.0]), 5, "floor").item()  # |A|
    x = torch.ones(3, 64, dtype=torch.bfloat16, device=DEVICE)
    x[0, 3] = float("nan")
    bound = torch.tensor([float("nan"), float("inf"), 1.0], device=DEVICE)
    spec = OperandSpec(hadamard_size=32, scale_mode="even")  # FLT_MAX's exponent rounds up to 126
    got = quantize_operand_triton(x, 1, spec, e4m3=True, row_bound=bound, single_chunk_max=0)
    q = quantize_operand(x, 1, spec)
    assert_fold(got, q, bound_row_exponent(bound.cpu(), 5, "even").to(DEVICE))
    assert got["e4m3"][0, :32].view(torch.uint8).eq(0x7F).all()  # the NaN's group


def test_empty_rows_and_operands():
    spec = OperandSpec(hadamard_size=32)
    x = torch.zeros(5, 0, dtype=torch.bfloat16, device=DEVICE)
    bound = torch.full((5,), 3.0, device=DEVICE)
    got = quantize_operand_triton(x, 1, spec, e4m3=True, packed=False, row_bound=bound)
    want = fold_e4m3(quantize_operand(x, 1, spec), bound_row_exponent(bound, 5, spec.scale_mode))[1]
    assert got["e4m3"].shape == (5, 0) and torch.equal(got["row_scale"], want)
    assert torch.equal(magnitude_bound(torch.zeros(0, 7), 0), torch.zeros(7))
    assert magnitude_bound(torch.zeros(0, 7), 1).shape == (0,)


def test_bad_row_bounds_are_refused():
    x = make((16, 64))
    spec = OperandSpec()
    for bad, what in ((torch.ones(15, device=DEVICE), r"\(16,\)"), (torch.ones(16, dtype=torch.float64), "float32"),
                      ([1.0] * 16, "list")):
        with pytest.raises(ValueError, match=what):
            quantize_operand_triton(x, 1, spec, e4m3=True, row_bound=bad)
    with pytest.raises(ValueError, match="bounds must be"):
        quantize_both(x, spec, spec, bounds=torch.ones(16))


@pytest.mark.parametrize("rows_form", ["e4m3", "packed"])
def test_both_orientations_with_bounds(rows_form):
    """One launch with both bounds: each orientation the fold of the reference at its bound's
    exponent (the packed one the reference itself); the norms as the two-pass kernel sums them."""
    x = make((100, 150), seed=2)
    cols = OperandSpec(hadamard_size=32, rounding="sr", sr_seed=5, signs_seed=9)
    rows = OperandSpec(hadamard_size=64, rounding="sr" if rows_form == "e4m3" else "rne", sr_seed=6)
    rb, cb = magnitude_bound(x, 1), magnitude_bound(x, 0)
    a, b = quantize_both(x, cols, rows, rows_form=rows_form, bounds=(rb, cb if rows_form == "e4m3" else None),
                         row_norms=True, col_norms=True, block_r=64, block_c=64)
    assert_fold(a, quantize_operand(x, 1, cols), bound_row_exponent(rb, 5, cols.scale_mode))
    qb = quantize_operand(x, 0, rows)
    if rows_form == "e4m3":
        assert_fold(b, qb, bound_row_exponent(cb, 6, rows.scale_mode))
    else:
        assert torch.equal(b["mx"].codes, qb.codes) and torch.equal(b["mx"].scale_e8m0, qb.scale_e8m0)
    a2, b2 = quantize_both(x, cols, rows, rows_form=rows_form, row_norms=True, col_norms=True,
                           block_r=64, block_c=64)
    assert torch.equal(a["norms"], a2["norms"]) and torch.equal(b["norms"], b2["norms"])


class _EmulatedHopperExact(EmulatedHopper):
    takes_row_bounds = False


@pytest.mark.parametrize("recipe,modes", [
    ("adahop_lv2", {"fprop": "iht", "dgrad": "iht+oe_left", "wgrad": "iht+oe_right"}),
    ("mxfp4", None),
    ("tseng", None),
])
def test_layer_same_with_and_without_bounds(monkeypatch, layer_on_backend, recipe, modes):
    """The layer's output and gradients are the same bits with the bounds (one pass) as with the
    exact row maxima (two passes): every block of these operands lies within the window of both
    (the products are the same MXFP4 values), and the bounds reach the kernels (counted)."""
    x, g = make((64, 96), seed=1, spread=0.5), make((64, 128), seed=3, spread=0.5)
    w = make((128, 96), seed=2, spread=0.5).float() * 0.1
    given = []
    import adahop.kernels.quantize as kq
    import adahop.kernels.quantize_both as kqb

    def counting(real, key):
        def call(*args, **kwargs):
            given.append(kwargs.get(key) is not None)
            return real(*args, **kwargs)
        return call

    monkeypatch.setattr(kq, "quantize_operand_triton", counting(quantize_operand_triton, "row_bound"))
    monkeypatch.setattr(kqb, "quantize_both", counting(quantize_both, "bounds"))
    with_bounds = layer_on_backend(EmulatedHopper(), recipe, x, w, g, modes)
    n_with = sum(given)
    given.clear()
    exact = layer_on_backend(_EmulatedHopperExact(), recipe, x, w, g, modes)
    assert sum(given) == 0
    # x along K (fprop) and the gradient's two orientations: three operands with a bound
    assert n_with >= 2
    for got, want in zip(with_bounds, exact):
        assert torch.equal(got, want)


def test_compiled_layers_take_the_bounds_and_match_eager(monkeypatch):
    """Two layers behind a norm, compiled whole (Dynamo and AOTAutograd, fullgraph): no graph
    break at the bounds (``bounds_wanted`` is a constant for Dynamo), the bounds reach the kernels
    in the forward and the backward, and the loss and gradients are eager's bit for bit."""
    backend = EmulatedHopper()
    monkeypatch.setattr(adahop.layer.plan, "get_backend", lambda name, device: backend)
    cfg = adahop.AdaHOPConfig.from_recipe_name("mxfp4_iht")
    torch.manual_seed(0)
    layers = nn.ModuleList([adahop.AdaHOPLinear.from_float(nn.Linear(64, 96, bias=False), config=cfg, name="a"),
                            adahop.AdaHOPLinear.from_float(nn.Linear(96, 64, bias=False), config=cfg, name="b")])
    norm_w = torch.rand(64) + 0.5

    def loss_of(mods, h):  # (h: the eager norm's output, so that both runs see the same bits on a GPU too)
        return mods[1](nn.functional.silu(mods[0](h))).float().pow(2).mean()

    x = make((64, 64), seed=5, spread=0.5).float()
    given = []
    real = kqb.quantize_both
    monkeypatch.setattr(kqb, "quantize_both",
                        lambda *a, **k: given.append(k.get("bounds") is not None) or real(*a, **k))
    results = []
    for compiled in (False, True):
        mods = copy.deepcopy(layers)
        fn = loss_of
        if compiled:
            torch._dynamo.reset()
            explained = torch._dynamo.explain(loss_of)(copy.deepcopy(layers), x.clone().requires_grad_())
            assert explained.graph_break_count == 0, explained.break_reasons
            fn = torch.compile(loss_of, backend="aot_eager", fullgraph=True)
        given.clear()
        xx = x.clone().requires_grad_()
        loss = fn(mods, xx * torch.rsqrt(xx.pow(2).mean(-1, keepdim=True) + 1e-5) * norm_w)
        loss.backward()
        assert given and all(given)  # x (quantize_and_pack) and g (quantize_both) of both layers
        results.append((loss.detach(), xx.grad, [m.weight.grad for m in mods]))
    (le, xe, we), (lc, xc, wc) = results
    assert torch.equal(le, lc) and torch.equal(xe, xc) and all(torch.equal(a, b) for a, b in zip(we, wc))


@pytest.mark.parametrize("shape", [(70, 300), (1, 5), (130, 64)])
def test_row_and_column_maxima_from_one_read(shape):
    """``kernels.magnitude``: the infinity norms of rows and columns, NaN where one holds NaN; the
    custom op the backward calls gives the same."""
    from adahop.kernels.magnitude import row_col_absmax

    x = make(shape, seed=shape[0])
    x[0, -1] = -1e30
    if shape[0] > 3:
        x[3, 2] = float("nan")
    rows, cols = row_col_absmax(x)
    for got, dim in ((rows, 1), (cols, 0)):
        want = torch.linalg.vector_norm(x, float("inf"), dim).float()
        assert torch.equal(torch.isnan(got), torch.isnan(want))
        assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(want))
    op = torch.ops.adahop.row_col_magnitudes(x)
    assert torch.equal(torch.nan_to_num(op[0]), torch.nan_to_num(rows))
    assert torch.equal(torch.nan_to_num(op[1]), torch.nan_to_num(cols))
    empty_r, empty_c = row_col_absmax(x[:0])
    assert empty_r.shape == (0,) and torch.equal(empty_c, torch.zeros(shape[1], device=x.device))
    with pytest.raises(ValueError, match="2-D floating-point"):
        row_col_absmax(x[0])


def test_no_input_bound_where_fprop_splits_the_mean(monkeypatch):
    """With ``fprop_mean_bias`` fprop quantizes x less its mean, which x's bound does not bound:
    the layer takes none for x (the gradient's are taken as before)."""
    from adahop.layer.bounds import bounds_wanted

    monkeypatch.setattr(adahop.layer.plan, "get_backend", lambda name, device: EmulatedHopper())
    cfg = adahop.AdaHOPConfig.from_recipe_name("mxfp4_iht")
    plain = adahop.AdaHOPLinear.from_float(nn.Linear(64, 32, bias=False), config=cfg, name="a")
    split = adahop.AdaHOPLinear.from_float(nn.Linear(64, 32, bias=False), config=cfg.replace(fprop_mean_bias=True),
                                           name="b")
    assert bounds_wanted(plain.numerics, "cpu") == (True, True, True, False)
    assert bounds_wanted(split.numerics, "cpu") == (False, True, True, False)


def test_a_group_on_one_input_takes_its_bound_once(monkeypatch):
    """q, k and v (layers that read one activation, ``shared_input``) share x's bound: one
    reduction for the group, not one per layer."""
    import adahop.layer.bounds as lb
    from adahop.shared_input import linears_on_one_input

    monkeypatch.setattr(adahop.layer.plan, "get_backend", lambda name, device: EmulatedHopper())
    taken = []
    real = lb.magnitude_bound
    monkeypatch.setattr(lb, "magnitude_bound", lambda t, dim: taken.append(dim) or real(t, dim))
    cfg = adahop.AdaHOPConfig.from_recipe_name("mxfp4_iht")
    torch.manual_seed(0)
    layers = [adahop.AdaHOPLinear.from_float(nn.Linear(64, 32, bias=False), config=cfg, name=f"l{i}")
              for i in range(3)]
    x = make((16, 64), seed=2, spread=0.5).float()
    with torch.no_grad():
        grouped = linears_on_one_input(layers, [x] * 3)
    assert taken == [1]
    taken.clear()
    with torch.no_grad():
        alone = [layer(x) for layer in layers]
    assert taken == [1, 1, 1]
    assert all(torch.equal(a, b) for a, b in zip(grouped, alone))
