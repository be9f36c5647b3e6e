"""torch.compile of the model, whole or by blocks (train/compile.py), on the CPU (Inductor's C++ backend).

Compiling takes 5-30 s per run here, so these runs are few and short."""

import copy
import math

import pytest
import torch
import torch._dynamo
from torch import nn

import adahop
from adahop.llama.model import Llama, LlamaConfig
from adahop.train.compile import compile_blocks, compile_model
from adahop.train.trainer import TrainConfig, train

from test_trainer import SEQ, VOCAB, CountingBatches, config
from tiny_lm import TinyLM


def llama(seed=0, n_layers=2):
    torch.manual_seed(seed)
    return Llama(LlamaConfig.from_size("tiny", vocab_size=VOCAB, max_seq_len=SEQ, n_layers=n_layers))


def run(tmp_path, recipe, compile, **kw):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    stop_after = kw.pop("stop_after", None)
    model = kw.pop("model", None) or llama()
    mode = compile if isinstance(compile, str) else "blocks" if compile else "none"
    cfg = config(tmp_path, recipe=recipe, steps=10, compile=mode, **kw)
    summary = train(cfg, model=model, train_batches=CountingBatches(), stop_after=stop_after)
    return summary, {k: dict(v) for k, v in torch._dynamo.utils.counters.items()}


def test_bf16_compiles_whole_blocks_and_matches_eager(tmp_path):
    eager, _ = run(tmp_path / "eager", "bf16", False)
    compiled, counters = run(tmp_path / "compiled", "bf16", True)
    # The bf16 recipe's layers are F.linear, traced with the rest: the two identical blocks share
    # one graph, and nothing breaks it.
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters.get("graph_break")
    # fp32 on the CPU: the fused kernels round differently, by about an ulp per op
    assert compiled["losses"] == pytest.approx(eager["losses"], rel=1e-5, abs=1e-5)


def test_adahop_blocks_compile_and_match_eager(tmp_path):
    eager, _ = run(tmp_path / "eager", "adahop_lv2", False)
    model = llama()
    compiled, counters = run(tmp_path / "compiled", "adahop_lv2", True, model=model)
    # Calibration runs eagerly, and after the freeze the quantized layers are traced with the
    # rest, without a break: one graph per distinct set of frozen modes among the blocks.
    mode_sets = {tuple(str(layer.modes) for layer in adahop.adahop_layers(block).values()) for block in model.layers}
    assert counters["stats"]["unique_graphs"] == len(mode_sets)
    assert not counters.get("graph_break")
    losses = compiled["losses"]
    assert len(losses) == 10 and all(math.isfinite(v) for v in losses)
    # Same numerics up to the fused elementwise kernels' rounding, which the MXFP4 rounding of
    # the next GEMM can amplify to a code step here and there (seen: 1.4e-3 after 12 steps).
    assert losses == pytest.approx(eager["losses"], abs=1e-2)
    assert losses[-1] < losses[0] - 0.5


# ---- the whole model as one graph ------------------------------------------------------------------
RECIPES = ("bf16", "mxfp4", "mxfp4_iht", "tseng", "adahop_lv1", "adahop_lv2")


def calibrated(recipe, seed=0, oe_k=8):
    """A converted tiny Llama (reference backend) after its calibration (one eager step)."""
    model = llama(seed)
    cfg = adahop.AdaHOPConfig.from_recipe_name(recipe, calibration_steps=1, backend="reference")
    adahop.convert_to_adahop_training(model, config=cfg.with_gemm_settings(oe_k=oe_k))
    step(model, tokens())
    assert not any(layer.calibrating for layer in adahop.adahop_layers(model).values())
    return model


def tokens(seed=0):
    return torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(seed))


def step(model, tok):
    """One forward + backward; returns the loss and all gradients, flattened (and clears them)."""
    logits = model(tok[:, :-1])
    loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), tok[:, 1:].flatten())
    loss.backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


@pytest.mark.parametrize("recipe", RECIPES)
def test_converted_model_traces_as_one_graph(recipe):
    """Zero graph breaks for a converted model after calibration, under every recipe, in training
    and under no_grad (Dynamo only: torch._dynamo.explain)."""
    model = calibrated(recipe)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(tokens()[:, :-1])
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1
    with torch.no_grad():
        explained = torch._dynamo.explain(model)(tokens()[:, :-1])
    assert explained.graph_break_count == 0, explained.break_reasons


@pytest.mark.parametrize("recipe", ["tseng", "adahop_lv2"])
def test_whole_model_compile_matches_eager_and_draws_new_bits(recipe):
    """fullgraph=True through AOTAutograd (no code generation: the same aten ops as eager) gives
    eager's losses and gradients bit for bit, step after step: the ops' autograd, fake shapes and
    the SR counters advanced inside the graph are those of eager mode. Each step draws new SR bits
    (same batch, same weights, other gradients)."""
    eager = calibrated(recipe)
    compiled = copy.deepcopy(eager)
    torch._dynamo.reset()
    compile_model(compiled, fullgraph=True, backend="aot_eager")
    grads = []
    for _ in range(2):
        (loss_e, grad_e), (loss_c, grad_c) = step(eager, tokens()), step(compiled, tokens())
        assert torch.equal(loss_e, loss_c) and torch.equal(grad_e, grad_c)
        grads.append(grad_c)
    assert not torch.equal(grads[0], grads[1])  # the counter moved: new stochastic rounding
    calls = [layer.calls for layer in adahop.adahop_layers(compiled).values()]
    assert calls == [layer.calls for layer in adahop.adahop_layers(eager).values()] == [3] * len(calls)


def test_whole_model_inductor_compile_trains_like_eager():
    """Inductor, fullgraph=True, a few optimizer steps from the start of calibration: the
    calibration step runs eagerly (compile_model), the rest compiled, close to eager."""
    torch._dynamo.reset()
    losses = {}
    for name in ("eager", "compiled"):
        model = llama()
        cfg = adahop.AdaHOPConfig.from_recipe_name("adahop_lv2", calibration_steps=2, backend="reference")
        adahop.convert_to_adahop_training(model, config=cfg.with_gemm_settings(oe_k=8))
        if name == "compiled":
            compile_model(model, fullgraph=True)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        losses[name] = []
        for _ in range(6):
            tok = tokens()  # one batch, learnt by heart
            loss = nn.functional.cross_entropy(model(tok[:, :-1]).flatten(0, 1).float(), tok[:, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses[name].append(loss.item())
    assert losses["compiled"][:2] == losses["eager"][:2]  # calibration: eager in both
    assert losses["compiled"] == pytest.approx(losses["eager"], abs=2e-2)
    assert losses["compiled"][-1] < losses["compiled"][0]


def test_compile_model_refuses_a_second_compile():
    model = llama()
    compile_model(model)
    with pytest.raises(ValueError, match="compiled already"):
        compile_model(model)


@pytest.mark.parametrize("mode", ["blocks", "model"])
def test_compiled_run_resumes_exactly(tmp_path, mode):
    """A compiled run (by blocks, or whole: the GPU default) killed after 5 of 10 steps and
    resumed gives the uninterrupted run's losses, bit for bit; the whole model compiles once,
    after calibration, with no graph break."""
    full, counters = run(tmp_path / "a", "adahop_lv2", mode, ckpt_every=5)
    if mode == "model":
        assert counters["stats"]["unique_graphs"] == 1 and not counters.get("graph_break")
    first, _ = run(tmp_path / "b", "adahop_lv2", mode, ckpt_every=5, stop_after=5)
    torch._dynamo.reset()
    cfg = config(tmp_path / "b", recipe="adahop_lv2", steps=10, compile=mode, ckpt_every=5)
    second = train(cfg, model=llama(seed=123), train_batches=CountingBatches(seed=99))
    assert first["losses"] + second["losses"] == full["losses"]


def test_compile_keeps_the_state_dict_keys():
    model = llama()
    adahop.convert_to_adahop_training(model, config=adahop.AdaHOPConfig.from_recipe_name("adahop_lv2"))
    keys = list(model.state_dict())
    assert compile_blocks(model) == 2
    assert list(model.state_dict()) == keys


def test_compile_refuses_a_model_without_blocks_and_a_bad_flag(tmp_path):
    with pytest.raises(ValueError, match="no TransformerBlock"):
        compile_blocks(TinyLM(vocab=VOCAB, d=64, layers=2, heads=4, seq_len=SEQ))
    with pytest.raises(ValueError, match="compile must be one of"):
        TrainConfig(compile="yes").validate()
    with pytest.raises(ValueError, match="cudagraphs replays the compiled model"):
        TrainConfig(compile="blocks", cudagraphs=True).validate()


def test_new_shapes_do_not_compile_once_each():
    """A compiled converted model given batches of six lengths compiles a graph with dynamic
    shapes after the second (the ops' fake shapes are symbolic) and one more for the lengths past
    a guard it took, not one per length; outputs as eager."""
    eager = calibrated("adahop_lv2")
    compiled = copy.deepcopy(eager)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compile_model(compiled, fullgraph=True, backend="aot_eager")
    for seq in (SEQ, SEQ // 2, SEQ - 8, SEQ // 4, SEQ - 4, SEQ // 2 + 4):
        tok = tokens()[:, : seq + 1]
        (loss_e, grad_e), (loss_c, grad_c) = step(eager, tok), step(compiled, tok)
        assert torch.equal(loss_e, loss_c) and torch.equal(grad_e, grad_c)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 3


def test_non_finite_weights_give_the_eager_result_under_compile():
    """A NaN in a weight: compiled and eager both give a NaN loss (a defined result, no error)."""
    eager = calibrated("adahop_lv2")
    with torch.no_grad():
        eager.layers[0].feed_forward.w1.weight[0, 0] = float("nan")
    compiled = copy.deepcopy(eager)
    torch._dynamo.reset()
    compile_model(compiled, fullgraph=True, backend="aot_eager")
    (loss_e, _), (loss_c, _) = step(eager, tokens()), step(compiled, tokens())
    assert math.isnan(loss_e.item()) and math.isnan(loss_c.item())
