"""Layers that read one activation quantize it once (adahop.shared_input, adahop.layer.grouped's
``linear_group_forward``): the same bits as the layers called one by one, with fewer
quantizations of x, on the reference backend and on hopper_fp8's kernels (Triton's interpreter,
the FP8 GEMM emulated exactly: emulated_hopper.EmulatedHopper), which quantize x both ways in
one call."""

import copy

import pytest
import torch

import adahop
import adahop.layer.grouped
import adahop.layer.plan
from adahop.llama.model import compute_copies
from adahop.shared_input import linears_on_one_input

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # (the GPU check runs this file too)
T, K = 64, 64
OUT = (96, 32, 160)  # q-, k- and v-like widths (none equal to K or T: x's quantizations are told apart)


def make(shape, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp(torch.randn(1, shape[1], generator=g))
    x[torch.rand(shape, generator=g) < 0.01] *= 30
    return x.to(DEVICE)


def layers(recipe="adahop_lv2", modes=None, **config):
    config.setdefault("share_input", True)
    cfg = adahop.AdaHOPConfig.from_recipe_name(recipe, **config).with_gemm_settings(oe_k=4)
    out = []
    for i, n in enumerate(OUT):
        lin = torch.nn.Linear(K, n, bias=False, device=DEVICE)
        lin.weight.data.copy_(make((n, K), seed=10 + i) * 0.1)
        layer = adahop.AdaHOPLinear.from_float(lin, config=cfg, name=f"layers.0.attention.w{'qkv'[i]}")
        if modes is not None:
            layer.set_modes(modes[i])
        out.append(layer)
    return out


IHT = {"fprop": "iht", "dgrad": "iht", "wgrad": "iht"}
MIXED = (  # fprop and wgrad differ: some layers share x's quantization, some only one orientation
    {"fprop": "iht", "dgrad": "iht+oe_left", "wgrad": "iht"},
    {"fprop": "iht", "dgrad": "iht", "wgrad": "bf16"},
    {"fprop": "iht+oe_left", "dgrad": "iht", "wgrad": "iht"},
)
OE_RIGHT = (
    {"fprop": "iht+oe_right", "dgrad": "iht", "wgrad": "iht+oe_right"},
    {"fprop": "iht", "dgrad": "iht", "wgrad": "iht+oe_right"},
    {"fprop": "mxfp4", "dgrad": "mxfp4", "wgrad": "mxfp4"},
)


def step(group, x, grads, shared: bool, autocast: bool):
    """One forward and backward of the three layers on copies of x: ``(ys, dx, dws)``."""
    xx = x.clone().requires_grad_()
    with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast):
        copies = compute_copies(xx, 3)
        ys = linears_on_one_input(group, copies) if shared else tuple(lay(c) for lay, c in zip(group, copies))
    sum((y.float() * g).sum() for y, g in zip(ys, grads)).backward()
    dws = [lay.weight.grad.clone() for lay in group]
    for lay in group:
        lay.weight.grad = None
    return [y.detach() for y in ys], xx.grad, dws


def count_x_quantizations(monkeypatch, backend):
    """Counts the quantize calls whose operand has x's shape [T, K] (the weights' and the
    gradients' shapes differ)."""
    calls = []
    for name in ("quantize", "quantize_packed", "quantize_and_pack"):
        real = getattr(backend, name, None)
        if real is None:
            continue

        def spy(t, *args, _real=real, _name=name, **kwargs):
            if tuple(t.shape) == (T, K):
                calls.append(_name)
            return _real(t, *args, **kwargs)

        monkeypatch.setattr(backend, name, spy)
    return calls


def emulated_hopper():
    pytest.importorskip("triton")
    from emulated_hopper import EmulatedHopper

    backend = EmulatedHopper()
    backend.FUSED_X_MIN_K = 0  # x both ways from the fused kernel at this small K too
    return backend


OE_KS = (  # OE-right wgrads with their own k (as the measured policy chooses): one x, each its own columns
    {**OE_RIGHT[0], "oe_k": {"fprop": 8, "wgrad": 2}},
    {**OE_RIGHT[1], "oe_k": {"wgrad": 8}},
    OE_RIGHT[2],
)
MODE_SETS = {"iht": (IHT,) * 3, "mixed": MIXED, "oe_right": OE_RIGHT, "oe_ks": OE_KS}
# x's quantizations per step, grouped: one per distinct setting of x's operands instead of one per
# layer. The reference quantizes x along K and along T in two calls, hopper_fp8 in one.
#   mixed: layers 0 and 2 have the same settings for x (their modes differ in OE only), layer 1
#   quantizes x along K only (its wgrad is BF16); oe_right: layers 0 and 1 share, layer 2 (plain
#   MXFP4, no Hadamard) quantizes its own.
GROUPED_CALLS = {("iht", "reference"): 2, ("iht", "hopper_fp8"): 1, ("mixed", "reference"): 3,
                 ("mixed", "hopper_fp8"): 2, ("oe_right", "reference"): 4, ("oe_right", "hopper_fp8"): 2,
                 ("oe_ks", "reference"): 4}


# (the interpreter is slow: hopper_fp8 runs two of the three mode sets)
@pytest.mark.parametrize("mode_set,backend_name", [case for case in GROUPED_CALLS if case != ("mixed", "hopper_fp8")])
def test_group_is_bit_identical_to_the_layers_one_by_one(monkeypatch, backend_name, mode_set):
    modes = MODE_SETS[mode_set]
    backend = emulated_hopper() if backend_name == "hopper_fp8" else adahop.layer.plan.get_backend("reference", DEVICE)
    monkeypatch.setattr(adahop.layer.plan, "get_backend", lambda name, device: backend)
    calls = count_x_quantizations(monkeypatch, backend)
    x = make((T, K), seed=1).view(2, T // 2, K)
    grads = [make((T, n), seed=20 + i).view(2, T // 2, n) for i, n in enumerate(OUT)]
    results = {}
    for shared in (False, True):
        group = layers("adahop_lv2", list(modes))
        calls.clear()
        # two steps: the second draws its SR bits from the counters the first advanced
        results[shared] = [step(group, x, grads, shared, autocast=True) for _ in range(2)], list(calls)
    (one_by_one, calls_one_by_one), (grouped, calls_grouped) = results[False], results[True]
    for (ys0, dx0, dws0), (ys1, dx1, dws1) in zip(one_by_one, grouped):
        for a, b in zip(ys0 + [dx0] + dws0, ys1 + [dx1] + dws1):
            assert a.dtype == b.dtype and torch.equal(a, b)
        assert all(torch.isfinite(t).all() for t in ys1 + [dx1] + dws1)
    assert len(calls_grouped) == 2 * GROUPED_CALLS[mode_set, backend_name]
    assert len(calls_grouped) < len(calls_one_by_one)


def test_evaluation_shares_the_forward_quantization(monkeypatch):
    backend = adahop.layer.plan.get_backend("reference", DEVICE)
    monkeypatch.setattr(adahop.layer.plan, "get_backend", lambda name, device: backend)
    calls = count_x_quantizations(monkeypatch, backend)
    group = layers("mxfp4")
    x = make((T, K), seed=2)
    with torch.no_grad():
        want = [lay(x) for lay in group]
        calls.clear()
        got = linears_on_one_input(group, (x,) * 3)
    assert calls == ["quantize"]  # along K, once; nothing for a backward
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert [int(lay.rng_state[1]) for lay in group] == [0, 0, 0]  # evaluation draws no SR bits


# The forward's own quantization differs, all else alike (as the measured policy or set_modes can
# make it): layer 0's fprop is plain MXFP4, the others' IHT, and every wgrad quantizes x alike.
FPROP_DIFFERS = ({"fprop": "mxfp4", "dgrad": "iht", "wgrad": "iht"}, IHT, IHT)


@pytest.mark.parametrize("training", [True, False])
def test_layers_with_another_forward_quantize_their_own_x(monkeypatch, training):
    """A layer whose forward quantizes x otherwise (plain MXFP4 against IHT) gets its own
    quantized x, in training and in evaluation (where x reaches the forward only): the group's
    outputs are the layers' own, bit for bit, while the two IHT layers still share theirs."""
    backend = adahop.layer.plan.get_backend("reference", DEVICE)
    monkeypatch.setattr(adahop.layer.plan, "get_backend", lambda name, device: backend)
    calls = count_x_quantizations(monkeypatch, backend)
    keys = [lay.input_key(training) for lay in layers("adahop_lv2", list(FPROP_DIFFERS))]
    assert keys[0] != keys[1] == keys[2]
    x = make((T, K), seed=4).view(2, T // 2, K)
    grads = [make((T, n), seed=30 + i).view(2, T // 2, n) for i, n in enumerate(OUT)]
    results = {}
    for shared in (False, True):
        group = layers("adahop_lv2", list(FPROP_DIFFERS))
        calls.clear()
        if training:
            results[shared] = step(group, x, grads, shared, autocast=False), len(calls)
        else:
            with torch.no_grad():
                ys = linears_on_one_input(group, (x,) * 3) if shared else [lay(x) for lay in group]
            results[shared] = (list(ys),), len(calls)
    (one_by_one, calls_one_by_one), (grouped, calls_grouped) = results[False], results[True]
    flat = [t for part in one_by_one for t in (part if isinstance(part, list) else [part])]
    flat_grouped = [t for part in grouped for t in (part if isinstance(part, list) else [part])]
    assert len(flat) == len(flat_grouped) and all(torch.equal(a, b) for a, b in zip(flat, flat_grouped))
    assert calls_grouped == calls_one_by_one - (2 if training else 1)  # layer 2 used layer 1's x


def _group_ran(monkeypatch):
    ran = []
    real = adahop.layer.grouped.quantize_input
    monkeypatch.setattr(adahop.layer.grouped, "quantize_input", lambda *a, **k: ran.append(1) or real(*a, **k))
    return ran


class _Subclass(torch.Tensor):
    pass


@pytest.mark.parametrize("case", ["share_input=False", "calibrating", "bf16", "hook", "bias", "plain linear",
                                  "nothing shared", "weight subclass", "one weight frozen"])
def test_falls_back_to_the_layers_one_by_one(monkeypatch, case):
    """Where the group cannot run as one op, each layer is called as it is, with the same
    result as calling it directly."""
    modes = [IHT] * 3
    if case == "share_input=False":
        group = layers(modes=modes, share_input=False)
    elif case == "calibrating":
        group = layers()
    elif case == "bf16":
        group = layers("bf16")
    elif case == "nothing shared":  # tseng with fprop in BF16: x only reaches wgrad, in SR
        group = layers("tseng", modes=[{"fprop": "bf16", "dgrad": "iht", "wgrad": "iht"}] * 3)
    else:
        group = layers(modes=modes)
        if case == "hook":
            group[1].register_forward_hook(lambda mod, args, out: None)
        elif case == "bias":
            group[2].bias = torch.nn.Parameter(torch.zeros(OUT[2], device=DEVICE))
        elif case == "one weight frozen":  # a backward for two layers, none for the third
            group[2].weight.requires_grad_(False)
        elif case == "weight subclass":
            group[1].weight = torch.nn.Parameter(group[1].weight.detach().as_subclass(_Subclass))
        else:
            group[0] = torch.nn.Linear(K, OUT[0], bias=False, device=DEVICE)
    ran = _group_ran(monkeypatch)
    x = make((T, K), seed=3)
    got = linears_on_one_input(group, (x,) * 3)
    assert not ran
    assert all(torch.equal(lay(x), y) for lay, y in zip(group, got))


def test_groups_the_model_projections_and_bad_input_reaches_the_layer(monkeypatch):
    from adahop.llama.model import Llama, LlamaConfig

    torch.manual_seed(0)
    model = Llama(LlamaConfig.from_size("tiny", vocab_size=64, max_seq_len=16, n_layers=1)).to(DEVICE)
    adahop.convert_to_adahop_training(model, config=adahop.AdaHOPConfig.from_recipe_name("mxfp4", share_input=True))
    ran = _group_ran(monkeypatch)
    model(torch.randint(0, 64, (2, 16), device=DEVICE)).sum().backward()
    assert len(ran) == 2  # q, k, v and w1, w3: one quantize_input each
    with pytest.raises(ValueError, match="in_features=64"):
        linears_on_one_input(layers(modes=[IHT] * 3), (torch.zeros(4, 32, device=DEVICE),) * 3)
    with pytest.raises(ValueError, match="one copy of the input per layer"):
        linears_on_one_input(layers(modes=[IHT] * 3), (torch.zeros(4, K, device=DEVICE),) * 2)


def test_share_input_is_a_checked_config_field():
    assert adahop.AdaHOPConfig().share_input is True  # measured faster at 1B (docs/method.md)
    with pytest.raises(ValueError, match="share_input must be a bool"):
        adahop.AdaHOPConfig(share_input="yes")
    cfg = adahop.AdaHOPConfig(share_input=True)
    assert adahop.AdaHOPConfig.from_dict(cfg.to_dict()) == cfg


def test_the_op_checks_its_owners_against_the_layers_numerics():
    group = layers(modes=[IHT, IHT, MIXED[1]])
    xs = [make((T, K), seed=4)] * 3
    numerics = adahop.layer.grouped.group_numerics_key([lay.numerics for lay in group])
    # one line: Inductor's GPU code cites the op's arguments in a one-line comment
    assert len(numerics.splitlines()) == 1 and "\r" not in numerics
    assert adahop.layer.grouped.group_layers(numerics, True) == (tuple(lay.numerics for lay in group), (0, 0, 2))
    # (layer 2: wgrad BF16, x along K only)
    args = (xs, [lay.weight for lay in group], [lay.rng_state.clone() for lay in group], numerics)
    with pytest.raises(ValueError, match=r"owners \[0, 1, 2\] do not match the layers' numerics, which give "):
        torch.ops.adahop.linear_group_forward(*args, [0, 1, 2], True, None)
    with pytest.raises(ValueError, match="a group of 3 layers takes 3 inputs"):
        torch.ops.adahop.linear_group_forward(xs[:2], *args[1:], [0, 0, 2], True, None)
    out = torch.ops.adahop.linear_group_forward(*args, [0, 0, 2], True, None)
    assert len(out) == 15 and out[6].numel() == 0 and out[1].numel() > 0  # layer 1's saved x is layer 0's


def test_a_compiled_model_traces_the_groups_without_a_break():
    """The whole model compiles as one graph with the groups' op in it (fullgraph), and trains
    to the eager losses (up to the fused elementwise kernels' rounding: test_compile)."""
    from adahop.llama.model import Llama, LlamaConfig

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Llama(LlamaConfig.from_size("tiny", vocab_size=64, max_seq_len=16, n_layers=1)).to(DEVICE)
    cfg = adahop.AdaHOPConfig.from_recipe_name("mxfp4", share_input=True, backend="reference")
    adahop.convert_to_adahop_training(model, config=cfg)
    tokens = torch.randint(0, 64, (2, 16), device=DEVICE)
    explained = torch._dynamo.explain(model)(tokens)
    assert explained.graph_break_count == 0, explained.break_reasons
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, fullgraph=True)
    for m in (eager, compiled):
        for _ in range(2):
            with torch.autocast(DEVICE, dtype=torch.bfloat16):
                loss = m(tokens).float().logsumexp(-1).mean()
            loss.backward()
        m.loss = float(loss)
    assert compiled.loss == pytest.approx(eager.loss, abs=1e-2)
    for (name, p), (_, q) in zip(compiled.named_parameters(), eager.named_parameters()):
        assert torch.isfinite(p.grad).all() and p.grad.shape == q.grad.shape, name
