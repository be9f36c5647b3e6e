"""adahop.titan's torchtitan-free parts (adahop.titan.hooks), on a stand-in module tree with
torchtitan's names: which linears are converted, and the optimizer hook that runs the precision
schedule, keeps the modes and refuses data-parallel calibration. Runs without torchtitan."""

import json
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from adahop import adahop_layers, convert_to_adahop_training, recipe
from adahop.schedule import PrecisionSchedule
from adahop.titan.hooks import AdaHOPHook, is_block_linear, optimizer_step

DIM = 32


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = nn.Module()
        self.attention.qkv_linear = nn.Module()
        self.attention.qkv_linear.wqkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.attention.wo = nn.Linear(DIM, DIM, bias=False)
        self.feed_forward = nn.Module()
        self.feed_forward.w1 = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x):
        q, k, v = self.attention.qkv_linear.wqkv(x).chunk(3, dim=-1)
        x = x + self.attention.wo(q * k.sigmoid() + v)
        return x + self.feed_forward.w1(x).relu()


class StandIn(nn.Module):
    """torchtitan's module names: tok_embeddings, layers.<i> (a ModuleDict), norm, lm_head; and
    an ``output`` linear (the LM head's name in other models) to check the name rule."""

    def __init__(self, n_layers=3):
        super().__init__()
        torch.manual_seed(0)
        self.tok_embeddings = nn.Embedding(64, DIM)
        self.layers = nn.ModuleDict({str(i): Block() for i in range(n_layers)})
        self.norm = nn.RMSNorm(DIM)
        self.lm_head = nn.Linear(DIM, 64, bias=False)
        self.output = nn.Linear(DIM, 64, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        h = self.norm(h)
        return self.lm_head(h) + self.output(h)


class Container(torch.optim.Optimizer):
    """torchtitan's OptimizersContainer as far as the hook sees it: an Optimizer (its step hooks)
    holding the real optimizers in ``.optimizers``, with an empty state of its own."""

    def __init__(self, params):
        params = list(params)
        self.optimizers = [torch.optim.AdamW(params, lr=1e-3)]
        super().__init__(params, {})

    def step(self, closure=None):
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none=True):
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)


def convert(model, name, **overrides):
    return convert_to_adahop_training(model, config=recipe(name, **overrides).config,
                                      module_filter_fn=lambda mod, fqn: is_block_linear(fqn))


def train_step(model, optimizers, seed):
    optimizers.zero_grad()
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(seed))
    model(tokens).float().pow(2).mean().backward()
    optimizers.step()


def test_is_block_linear_names():
    assert is_block_linear("layers.0.attention.qkv_linear.wqkv")
    assert is_block_linear("layers.11.feed_forward.w2")
    assert is_block_linear("layers.3.moe.experts.w1")
    for fqn in ("lm_head", "output", "tok_embeddings", "norm", "layers.0.output", "layers.2.lm_head",
                "model.layers.0.attention.wo", "layers.x.attention.wo", "layers.1.moe.router.gate"):
        assert not is_block_linear(fqn), fqn


def test_is_block_linear_keeps_the_bf16_blocks():
    kept = [i for i in range(8) if is_block_linear(f"layers.{i}.attention.wo", 8, (2, 1))]
    assert kept == [2, 3, 4, 5, 6]
    with pytest.raises(ValueError, match="n_layers"):
        is_block_linear("layers.0.attention.wo", None, (1, 0))


def test_converting_by_the_filter_leaves_heads_and_embeddings_alone():
    model = convert(StandIn(), "mxfp4")
    assert sorted(adahop_layers(model)) == sorted(
        f"layers.{i}.{n}" for i in range(3) for n in ("attention.qkv_linear.wqkv", "attention.wo", "feed_forward.w1"))
    assert type(model.lm_head) is nn.Linear and type(model.output) is nn.Linear


def test_optimizer_step_reads_the_inner_optimizers():
    model = StandIn()
    optimizers = Container(model.parameters())
    assert optimizer_step(optimizers) == 0
    for seed in range(3):
        train_step(model, optimizers, seed)
    assert optimizer_step(optimizers) == 3  # the container's own state is empty
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train_step(model, sgd, 0)
    with pytest.raises(ValueError, match="no per-parameter 'step'"):
        optimizer_step(sgd)


def test_hook_switches_at_the_schedules_step():
    model = convert(StandIn(), "mxfp4")
    optimizers = Container(model.parameters())
    hook = AdaHOPHook(PrecisionSchedule(bf16_phase_start=0.5, bf16_phase_gemms=("fprop",)), 6)
    hook(optimizers, [model], SimpleNamespace(dp_replicate=1, dp_shard=1))
    switched = []
    for step in range(6):
        train_step(model, optimizers, step)
        switched.append(len(hook.switched))
    assert switched == [0, 0, 0, 9, 0, 0]  # the 9 layers, once 3 of 6 steps are done
    assert all(m.modes["fprop"] == "bf16" and m.modes["dgrad"] == "mxfp4" for m in adahop_layers(model).values())
    with pytest.raises(ValueError, match="past the 6 steps"):
        train_step(model, optimizers, 6)


def test_hook_writes_the_modes_once_calibrated_and_a_resumed_run_loads_them(tmp_path):
    modes_file = tmp_path / "run" / "adahop_modes.json"
    model = convert(StandIn(), "adahop_lv2", calibration_steps=2)
    optimizers = Container(model.parameters())
    AdaHOPHook(PrecisionSchedule(), 10, modes_file)(optimizers, [model])
    train_step(model, optimizers, 0)
    assert not modes_file.exists()  # still calibrating
    train_step(model, optimizers, 1)
    written = json.loads(modes_file.read_text())
    assert written == {f: {**m.modes, "patterns": m.patterns} for f, m in adahop_layers(model).items()}

    resumed = convert(StandIn(), "adahop_lv2", calibration_steps=2)
    AdaHOPHook(PrecisionSchedule(), 10, modes_file)(Container(resumed.parameters()), [resumed])
    modes = {f: m.modes for f, m in adahop_layers(model).items()}
    assert {f: m.modes for f, m in adahop_layers(resumed).items()} == modes


def test_hook_refuses_data_parallel_calibration_and_bad_input():
    parallel = SimpleNamespace(dp_replicate=1, dp_shard=2)
    model = convert(StandIn(), "adahop_lv2")
    with pytest.raises(ValueError, match="data parallelism of degree 2 with 9 AdaHOP layers still calibrating"):
        AdaHOPHook(PrecisionSchedule(), 10)(Container(model.parameters()), [model], parallel)
    AdaHOPHook(PrecisionSchedule(), 10, calibrator=True)(Container(model.parameters()), [model], parallel)
    fixed = convert(StandIn(), "mxfp4")  # nothing to calibrate: data parallelism is fine
    AdaHOPHook(PrecisionSchedule(), 10)(Container(fixed.parameters()), [fixed], parallel)
    with pytest.raises(ValueError, match="no AdaHOP layer"):
        AdaHOPHook(PrecisionSchedule(), 10)(Container(StandIn().parameters()), [StandIn()])
    with pytest.raises(ValueError, match="one model's modes; this run has 2 model parts"):
        AdaHOPHook(PrecisionSchedule(), 10, "m.json")(Container(fixed.parameters()), [fixed, fixed])
    with pytest.raises(ValueError, match="total_steps must be an int >= 1"):
        AdaHOPHook(PrecisionSchedule(), 0)
    with pytest.raises(ValueError, match="schedule must be a PrecisionSchedule"):
        AdaHOPHook("adahop_lv2_tail", 10)
