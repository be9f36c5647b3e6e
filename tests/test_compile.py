"""torch.compile of the model's blocks (train/compile.py), on the CPU (Inductor's C++ backend).

Compiling takes 5-30 s per run here, so these runs are few and short."""

import math

import pytest
import torch
import torch._dynamo

import adahop
from adahop.train.compile import compile_blocks
from adahop.train.model import Llama, LlamaConfig
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
    cfg = config(tmp_path, recipe=recipe, steps=10, compile=compile, **kw)
    summary = train(cfg, model=llama(), train_batches=CountingBatches(), stop_after=stop_after)
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


def test_adahop_layers_run_eagerly_between_compiled_parts(tmp_path):
    eager, _ = run(tmp_path / "eager", "adahop_lv2", False)
    compiled, counters = run(tmp_path / "compiled", "adahop_lv2", True)
    assert counters["stats"]["unique_graphs"] > 1  # the pieces between the linear layers
    breaks = " ".join(counters["graph_break"])
    assert "_forward_adahop" in breaks  # the quantized path was not traced
    losses = compiled["losses"]
    assert len(losses) == 10 and all(math.isfinite(v) for v in losses)
    # Same numerics up to the fused elementwise kernels' rounding, which the MXFP4 rounding of
    # the next GEMM can amplify to a code step here and there (seen: 1.4e-3 after 12 steps).
    assert losses == pytest.approx(eager["losses"], abs=1e-2)
    assert losses[-1] < losses[0] - 0.5


def test_compiled_run_resumes_exactly(tmp_path):
    full, _ = run(tmp_path / "a", "adahop_lv2", True, ckpt_every=5)
    first, _ = run(tmp_path / "b", "adahop_lv2", True, ckpt_every=5, stop_after=5)
    torch._dynamo.reset()
    cfg = config(tmp_path / "b", recipe="adahop_lv2", steps=10, compile=True, ckpt_every=5)
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
    with pytest.raises(ValueError, match="compile must be a bool"):
        TrainConfig(compile="yes").validate()
