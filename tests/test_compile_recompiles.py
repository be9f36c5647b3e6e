"""Compiled blocks whose layers froze different modes (train/compile.py, 'Recompiles'): each
distinct set of modes compiles once, all blocks run compiled, Dynamo never hits its recompile
limit; through the calibration (eager, then the freeze) and the BF16 phase (new modes late in
the run). In one process (per-block compile) and on 2 gloo ranks (FSDP2 with the whole model
or each block compiled, DDP with each block compiled).

A counting backend stands in for Inductor: it counts the graphs Dynamo hands it and the calls
of each, and runs the FX graph as it is (nothing is compiled, so these runs take seconds)."""

from __future__ import annotations

import functools
import itertools
import json
import logging
import os
import socket
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch._dynamo
import torch.distributed as dist
import torch.multiprocessing as mp

import adahop
from adahop.llama.model import Llama, LlamaConfig
from adahop.train import compile as compile_mod
from adahop.train import trainer
from adahop.train.trainer import TrainConfig, train

from rank_exit import exit_rank
from test_trainer import SEQ, VOCAB, CountingBatches

STEPS, PHASE_START = 3, 0.7  # step 1 calibrates (eager), 2 compiles the frozen modes, 3 the BF16 phase's
# Modes of each block: fprop never BF16, so that the BF16 phase of fprop changes every block's set
MODE_SETS = [dict(fprop=f, dgrad=d, wgrad=w) for f, d, w in itertools.product(
    ("mxfp4", "iht"), ("bf16", "mxfp4", "iht"), ("bf16", "mxfp4"))]


class CountingBackend:
    """A Dynamo backend that counts the graphs of transformer blocks it gets (a block's graph
    reads its attention's norm: placeholder ``L_self_modules_attention_norm_...``) and their
    calls, and runs each graph's forward as traced."""

    def __init__(self):
        self.block_graphs = self.block_calls = self.other_graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        is_block = any("attention_norm" in node.target for node in gm.graph.nodes if node.op == "placeholder")
        if not is_block:
            self.other_graphs += 1
            return gm.forward
        self.block_graphs += 1

        def run(*args):
            self.block_calls += 1
            return gm.forward(*args)

        return run


class RecompileLimitWarnings(logging.Handler):
    """Dynamo's 'hit config.recompile_limit' warnings (logged by torch._dynamo.convert_frame)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []
        self.logger = logging.getLogger("torch._dynamo.convert_frame")

    def emit(self, record):
        if "recompile_limit" in record.getMessage():
            self.messages.append(record.getMessage().splitlines()[0])

    def __enter__(self):
        self.logger.addHandler(self)
        return self

    def __exit__(self, *exc):
        self.logger.removeHandler(self)


def llama_with_distinct_modes(n_blocks: int) -> Llama:
    """A tiny Llama whose block i, calibrated, freezes the modes MODE_SETS[i] in all its layers
    (each block converted with a policy of its own)."""
    torch.manual_seed(0)
    model = Llama(LlamaConfig.from_size("tiny", vocab_size=VOCAB, max_seq_len=SEQ, n_layers=n_blocks))
    for block, modes in zip(model.layers, MODE_SETS[:n_blocks], strict=True):
        adahop.convert_to_adahop_training(block, config=adahop_config().replace(policy_fn=lambda s, m=modes: m))
    return model


def adahop_config() -> adahop.AdaHOPConfig:
    return adahop.AdaHOPConfig.from_recipe_name("adahop_lv2", calibration_steps=1,
                                                backend="reference").with_gemm_settings(oe_k=4)


def block_sets(model) -> set:
    """The distinct numerics sets of the model's blocks now."""
    return {tuple(layer.numerics for layer in adahop.adahop_layers(block).values()) for block in model.layers}


def counted_run(out: Path, n_blocks: int, compile: str, parallel: str = "none") -> dict:
    """Train the model of ``llama_with_distinct_modes`` for STEPS steps (BF16 fprop in the last),
    compiled by ``compile`` with the counting backend. Returns what was counted: the block
    graphs, the compiled block calls after each step, the distinct sets the blocks ran, the
    recompile-limit warnings."""
    backend = CountingBackend()
    patched = {"compile_blocks": trainer.compile_blocks, "compile_model": trainer.compile_model}
    trainer.compile_blocks = functools.partial(compile_mod.compile_blocks, backend=backend)
    trainer.compile_model = functools.partial(compile_mod.compile_model, backend=backend)
    model, calls, sets = llama_with_distinct_modes(n_blocks), [], set()

    def on_step(step, model):
        calls.append(backend.block_calls)
        sets.update(block_sets(model))

    cfg = TrainConfig(adahop=adahop_config(), out_dir=str(out), steps=STEPS, batch_size=4, seq_len=SEQ, lr=1e-3,
                      warmup_steps=1, progress=False, device="cpu", parallel=parallel, compile=compile,
                      bf16_phase_start=PHASE_START, bf16_phase_gemms=("fprop",))
    try:
        with RecompileLimitWarnings() as warnings:
            train(cfg, model=model, train_batches=CountingBatches(), on_step=on_step)
    finally:
        for name, fn in patched.items():
            setattr(trainer, name, fn)
    return {"block_graphs": backend.block_graphs, "calls": calls, "sets": len(sets), "warnings": warnings.messages}


def check_counts(counted: dict, n_blocks: int, frozen_sets: int, phase_sets: int) -> None:
    assert counted["warnings"] == []
    # each distinct set once: those frozen at calibration, then the BF16 phase's
    assert counted["sets"] == frozen_sets + phase_sets
    assert counted["block_graphs"] == counted["sets"]
    # step 1 calibrates: every block eager; every block compiled at every later step
    assert counted["calls"] == [n_blocks * step for step in range(STEPS)]


def test_ten_blocks_with_ten_mode_sets_compile_each_set_once(tmp_path):
    """Per-block compile in one process, 10 distinct sets of frozen modes (more than Dynamo's
    recompile limit of 8), then 6 more in the BF16 phase (fprop BF16: the blocks that differed
    only in fprop now share a set): 16 graphs of TransformerBlock.forward, one each. The limit is
    raised only around the compiled calls: other compiled code keeps Dynamo's."""
    torch._dynamo.reset()
    assert torch._dynamo.config.recompile_limit == 8  # Dynamo's default: what the 10 sets exceed
    check_counts(counted_run(tmp_path, 10, "blocks"), 10, frozen_sets=10, phase_sets=6)
    assert torch._dynamo.config.recompile_limit == 8
    assert torch._dynamo.config.accumulated_recompile_limit == 256


# ---- 2 gloo ranks ----------------------------------------------------------------------------------
# Dynamo's recompile limit is lowered to 2 there (each rank traces every graph, on a shared core):
# 3 blocks with 3 distinct sets exceed it as 10 blocks exceed 8, with fewer graphs to trace.
RANK_BLOCKS, RANK_LIMIT = 3, 2
RANK_RUNS = (("fsdp2", "model"), ("fsdp2", "blocks"), ("ddp", "blocks"))


def _entry(rank, world, port, root):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch._dynamo.config.recompile_limit = RANK_LIMIT
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        out = {}
        for parallel, compile in RANK_RUNS:
            torch._dynamo.reset()
            out[f"{parallel}_{compile}"] = counted_run(Path(root, f"{parallel}_{compile}"), RANK_BLOCKS, compile,
                                                       parallel)
        Path(root, f"counts.{rank}.json").write_text(json.dumps(out))
    finally:
        dist.destroy_process_group()
    exit_rank()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def rank_counts(tmp_path_factory):
    root = tmp_path_factory.mktemp("recompiles")
    mp.start_processes(_entry, args=(2, _free_port(), str(root)), nprocs=2, start_method="spawn")
    return [json.loads(Path(root, f"counts.{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.parametrize("parallel,compile", RANK_RUNS)
def test_on_2_ranks_each_set_of_modes_compiles_once(rank_counts, parallel, compile):
    """FSDP2 + whole-model compile breaks the graph at each sharded block, so each block is a
    frame of TransformerBlock.forward, as under per-block compile: 3 sets frozen, then 3 in the
    BF16 phase, one graph each, every block compiled at every step after calibration."""
    for counts in rank_counts:
        check_counts(counts[f"{parallel}_{compile}"], RANK_BLOCKS, frozen_sets=3, phase_sets=3)
