"""``AdaHOPConfig.wgrad_input``: a quantized wgrad's x packed by the forward and saved ("packed"),
or x itself kept and quantized by the backward ("recompute"). The same outputs and gradients bit
for bit on every backend, SR chains and OE-right's columns included; what autograd keeps; a
compiled model that keeps no packed x; the option's config, key and CLI."""

import dataclasses

import pytest
import torch
from torch import nn

triton = pytest.importorskip("triton")

from emulated_hopper import EmulatedHopper  # noqa: E402

import adahop  # noqa: E402
import adahop.layer.plan  # noqa: E402
from adahop.ops.backends import get_backend  # noqa: E402

LV2_MODES = {"fprop": "iht", "dgrad": "iht+oe_left", "wgrad": "iht+oe_right"}


def make(shape, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp(torch.randn(shape[1], generator=g) * 0.5)
    return x.to(torch.bfloat16)


def two_calls(monkeypatch, backend, recipe, modes, wgrad_input):
    """Two forward + backward calls of one layer (the SR chain advances between them): each call's
    ``(y, dx, dw)``."""
    monkeypatch.setattr(adahop.layer.plan, "get_backend", lambda name, device: backend)
    cfg = adahop.AdaHOPConfig.from_recipe_name(recipe, wgrad_input=wgrad_input).with_gemm_settings(oe_k=4)
    lin = nn.Linear(96, 64, bias=False)
    with torch.no_grad():
        lin.weight.copy_(make((64, 96), seed=2).float() * 0.1)
    layer = adahop.AdaHOPLinear.from_float(lin, config=cfg, name="probe")
    if modes:
        layer.set_modes(modes)
    out = []
    for call in range(2):
        x = make((128, 96), seed=10 + call).requires_grad_()  # (T = 128: x [T, K] is not W's shape)
        y = layer(x)
        y.backward(make((128, 64), seed=20 + call))
        out.append((y.detach(), x.grad, layer.weight.grad.clone()))
        layer.weight.grad = None
    return out


@pytest.mark.parametrize("backend", ["reference", "triton", "emulated_hopper"])
@pytest.mark.parametrize("recipe,modes", [("mxfp4", None), ("mxfp4_iht", None), ("tseng", None),
                                          ("adahop_lv2", LV2_MODES)])
def test_recompute_gives_the_packed_bits(monkeypatch, backend, recipe, modes):
    """x quantized by the backward is x quantized by the forward: the same y, dx and dw, call after
    call (tseng: SR on wgrad's operands; lv2: OE-right's columns chosen again from x)."""
    be = EmulatedHopper() if backend == "emulated_hopper" else get_backend(backend, "cpu")
    packed = two_calls(monkeypatch, be, recipe, modes, "packed")
    recompute = two_calls(monkeypatch, be, recipe, modes, "recompute")
    for p, r in zip(packed, recompute):
        for a, b in zip(p, r):
            assert torch.equal(a, b)


def saved_by_autograd(wgrad_input, recipe="mxfp4"):
    """The dtypes and shapes autograd keeps for one layer call."""
    cfg = adahop.AdaHOPConfig.from_recipe_name(recipe, backend="reference", wgrad_input=wgrad_input)
    layer = adahop.AdaHOPLinear.from_float(nn.Linear(96, 64, bias=False), config=cfg, name="probe")
    kept = []

    def pack(t):
        kept.append((t.dtype, tuple(t.shape)))
        return t

    x = make((64, 96), seed=1).requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x).sum().backward()
    return kept


def test_what_autograd_keeps():
    """packed: x's 4-bit codes and scale bytes [K, T/2], [K, T/32] and no bf16 x; recompute: x
    itself and nothing packed."""
    packed, recompute = saved_by_autograd("packed"), saved_by_autograd("recompute")
    assert (torch.uint8, (96, 32)) in packed and (torch.uint8, (96, 2)) in packed
    assert (torch.bfloat16, (64, 96)) not in packed
    assert (torch.bfloat16, (64, 96)) in recompute
    assert not any(dtype == torch.uint8 and shape != (0,) for dtype, shape in recompute)  # (the ops' empty outputs)


def test_bounds_reach_the_backward_quantization(monkeypatch):
    """On a backend that takes row bounds, the backward's quantization of x gets x's column maxima
    (one pass), and its numerics key says recompute."""
    import adahop.kernels.quantize as kq
    from adahop.kernels.quantize import quantize_operand_triton
    from adahop.layer.bounds import bounds_wanted

    seen = []

    def spy(x, dim, spec, **kwargs):
        seen.append((tuple(x.shape), dim, kwargs.get("row_bound")))
        return quantize_operand_triton(x, dim, spec, **kwargs)

    monkeypatch.setattr(kq, "quantize_operand_triton", spy)
    two_calls(monkeypatch, EmulatedHopper(), "mxfp4", None, "recompute")
    along_t = [(shape, bound) for shape, dim, bound in seen if dim == 0 and shape == (128, 96)]
    assert along_t and all(b is not None and b.shape == (96,) for _, b in along_t)
    cfg = adahop.AdaHOPConfig.from_recipe_name("mxfp4", wgrad_input="recompute")
    layer = adahop.AdaHOPLinear.from_float(nn.Linear(96, 64, bias=False), config=cfg, name="probe")
    assert bounds_wanted(layer.numerics, "cpu")[3]
    assert '"wgrad_input":"recompute"' in layer.numerics


def compiled_step_saves(wgrad_input, bf16_wgrad=False):
    """(the dtypes and shapes of what a compiled step of a tiny Llama keeps for the backward, its
    loss and gradients). AOTAutograd with the min-cut partitioner, Inductor's choice of what to
    save. ``bf16_wgrad``: every wgrad in BF16."""
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    from adahop.llama.model import Llama, LlamaConfig

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Llama(LlamaConfig.from_size("tiny", vocab_size=128, max_seq_len=64, n_layers=1))
    cfg = adahop.AdaHOPConfig.from_recipe_name("mxfp4", backend="reference", wgrad_input=wgrad_input)
    if bf16_wgrad:
        cfg = cfg.replace(wgrad=dataclasses.replace(cfg.wgrad, mode="bf16"))
    adahop.convert_to_adahop_training(model, config=cfg)
    saved = []

    def forward_compiler(gm, _):
        outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        saved.extend((str(n.meta["val"].dtype), tuple(n.meta["val"].shape)) for n in outputs[1:]  # (not empty ones)
                     if n.op != "placeholder" and isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].numel())
        return make_boxed_func(gm.forward)

    backend = aot_autograd(fw_compiler=forward_compiler, bw_compiler=lambda gm, _: make_boxed_func(gm.forward),
                           partition_fn=min_cut_rematerialization_partition)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    tokens = torch.randint(0, 128, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = compiled(tokens).float().logsumexp(-1).mean()
    loss.backward()
    return saved, loss.detach(), [p.grad for p in model.parameters()]


def test_compiled_model_keeps_no_packed_x_and_the_same_bits():
    """Compiled, recompute keeps no packed x (no uint8 tensor among the saved ones, where packed
    keeps codes and scales for every layer), and its loss and gradients are packed's bit for bit."""
    packed, loss_p, grads_p = compiled_step_saves("packed")
    recompute, loss_r, grads_r = compiled_step_saves("recompute")
    # codes and scales of the 7 layers' 4 inputs (q, k and v read one, w1 and w3 one)
    assert [dtype for dtype, _ in packed].count("torch.uint8") == 2 * 4
    assert "torch.uint8" not in [dtype for dtype, _ in recompute]
    assert torch.equal(loss_p, loss_r)
    assert all(torch.equal(a, b) for a, b in zip(grads_p, grads_r))


def test_config_key_and_cli():
    """A bad value is refused naming the choices; the default leaves the numerics key as it was;
    the config round-trips; ``adahop train --wgrad-input`` reaches the config."""
    from adahop.cli import build_parser, train_config

    with pytest.raises(ValueError, match=r"wgrad_input must be one of \('packed', 'recompute'\)"):
        adahop.AdaHOPConfig.from_recipe_name("mxfp4", wgrad_input="bf16")
    cfg = adahop.AdaHOPConfig.from_recipe_name("mxfp4")
    layer = adahop.AdaHOPLinear.from_float(nn.Linear(96, 64, bias=False), config=cfg, name="probe")
    assert "wgrad_input" not in layer.numerics
    rc = cfg.replace(wgrad_input="recompute")
    assert adahop.AdaHOPConfig.from_dict(rc.to_dict()) == rc
    args = build_parser().parse_args(["train", "--preset", "debug", "--recipe", "mxfp4", "--wgrad-input",
                                      "recompute", "--corpus", ".", "--device", "cpu"])
    assert train_config(args).adahop.wgrad_input == "recompute"


def test_compiled_bf16_wgrad_recomputes_x():
    """A BF16 wgrad keeps x itself; compiled, x is recomputed as for "recompute" (the norms'
    outputs and w2's input are not kept): the step keeps exactly what the "recompute" step keeps."""
    bf16_wgrad, *_ = compiled_step_saves("packed", bf16_wgrad=True)
    recompute, *_ = compiled_step_saves("recompute")
    assert sorted(bf16_wgrad) == sorted(recompute)
    assert ("torch.bfloat16", (128, 192)) not in bf16_wgrad  # w2's input


@pytest.mark.parametrize("recipe", ["mxfp4_iht", "tseng"])
def test_eager_llama_groups_give_the_packed_bits(recipe):
    """The tiny Llama eager, its q, k, v and w1, w3 run as groups on one input: two steps' losses
    and gradients with x recomputed are those with x packed, bit for bit."""
    from adahop.llama.model import Llama, LlamaConfig

    results = []
    for wgrad_input in ("packed", "recompute"):
        torch.manual_seed(0)
        model = Llama(LlamaConfig.from_size("tiny", vocab_size=128, max_seq_len=64, n_layers=2))
        cfg = adahop.AdaHOPConfig.from_recipe_name(recipe, backend="reference", wgrad_input=wgrad_input)
        adahop.convert_to_adahop_training(model, config=cfg)
        out = []
        for step in range(2):
            tokens = torch.randint(0, 128, (2, 64), generator=torch.Generator().manual_seed(step))
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(tokens).float().logsumexp(-1).mean()
            loss.backward()
            out.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
            model.zero_grad()
        results.append(out)
    for (lp, gp), (lr, gr) in zip(*results):
        assert torch.equal(lp, lr) and all(torch.equal(a, b) for a, b in zip(gp, gr))
