"""FSDP2's quantized all-gather (adahop/quantized_all_gather.py): each AdaHOP layer's weight gathered
as fprop's MXFP4 operand.

- Exact, in one process: the shards' operands concatenated are the whole weight's; a layer given
  the gathered operand feeds its GEMMs the operands of the ordinary layer, bit for bit, and
  returns its outputs and gradients; plain-MXFP4 tiles need whole 32-row shards.
- Exact, on 2 gloo processes (one spawn): against FSDP2's ordinary gather, every GEMM's operands
  (codes and scales), the losses and the gradients are equal bit for bit, in float32 and with
  bf16 parameters; the bytes each all-gather sends are counted (FSDP2's custom all-gather) and
  come to 4.25 / 16 of bf16's for a layer gathered in MXFP4. Through the trainer (adahop_lv2,
  calibration in bf16, then modes that mix both formats) the losses equal the ordinary gather's
  step by step, and a resume from its checkpoint continues them.
- Bad configurations are one-line errors.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_distributed import SEQ, VOCAB, IndexedBatches, _free_port

import adahop
from adahop import quantized_all_gather as qag
from adahop.formats.mxfp4 import dequantize_mxfp4
from adahop.ops.backends import ReferenceBackend
from adahop.oscillation import add_dampening_grad
from adahop.train.run_log import read_log
from adahop.train.trainer import TrainConfig, train

from rank_exit import exit_rank
from tiny_lm import TinyLM

# fprop modes, one per layer (sorted names: blocks.0.down, blocks.0.proj, blocks.0.qkv, ...): both
# gather formats, plain MXFP4 (tiles) and IHT, and each reason to gather in high precision.
FPROP_MODES = ("mxfp4", "iht", "iht", "iht+oe_left", "iht", "mxfp4", "iht+oe_right", "bf16")
MX_LAYERS = {i for i, m in enumerate(FPROP_MODES) if m in ("mxfp4", "iht")}


def adahop_config(recipe="mxfp4_iht", scale_mode="even", **kw):
    q = adahop.AdaHOPConfig.from_recipe_name(recipe, backend="reference", dgrad_weight="forward", **kw)
    q = q.with_gemm_settings(oe_k=4, scale_mode=scale_mode)
    return q.replace(fprop=dataclasses.replace(q.fprop, random_signs=True))  # signs along K too


def layer_modes(i: int) -> dict:
    return {"fprop": FPROP_MODES[i], "dgrad": "iht", "wgrad": "iht+oe_right" if i % 2 else "iht"}


def linear(w: torch.Tensor, modes: dict, name="blocks.0.up", scale_mode="even") -> adahop.AdaHOPLinear:
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    lin.weight.data.copy_(w)
    m = adahop.AdaHOPLinear.from_float(lin, config=adahop_config(scale_mode=scale_mode), name=name)
    m.set_modes(modes)
    return m


class Recorder:
    """Every MXFP4 GEMM's operands (codes and scales) on the reference backend, in call order."""

    def __init__(self, monkeypatch=None):
        self.calls = []
        real = ReferenceBackend.mm_nt

        def mm_nt(backend, a, b, out_dtype):
            self.calls.append(tuple(t.clone() for t in (a.codes, a.scale_e8m0, b.codes, b.scale_e8m0)))
            return real(backend, a, b, out_dtype)

        self.real = real
        if monkeypatch is not None:
            monkeypatch.setattr(ReferenceBackend, "mm_nt", mm_nt)
        else:
            ReferenceBackend.mm_nt = mm_nt

    def stop(self):
        ReferenceBackend.mm_nt = self.real


def same_operands(a: list, b: list) -> bool:
    return len(a) == len(b) > 0 and all(torch.equal(s, t) for x, y in zip(a, b) for s, t in zip(x, y))


# ---- one process ----------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["iht", "mxfp4"])
@pytest.mark.parametrize("k", [64, 70])  # 70: K padded to the blocks
def test_the_shards_operands_are_the_whole_weights(mode, k):
    torch.manual_seed(0)
    # columns over four decades, rows over two: blocks, tiles and half tiles take different scales
    w = torch.randn(128, k) * torch.logspace(-2, 2, k) * torch.logspace(0, 2, 16).repeat(8)[:, None]
    layer = linear(w, {"fprop": mode, "dgrad": "iht", "wgrad": "iht"})
    whole = qag.fprop_operand(w, layer, torch.bfloat16)
    for rows in (32, 64):
        parts = [qag.fprop_operand(s, layer, torch.bfloat16) for s in w.split(rows)]
        assert torch.equal(torch.cat([p.codes for p in parts]), whole.codes)
        assert torch.equal(torch.cat([p.scale_e8m0 for p in parts]), whole.scale_e8m0)
    if mode == "mxfp4":  # 16- and 48-row shards cut the 32 x 32 tiles: their scales differ (why gather_format refuses)
        for rows in (16, 48):
            parts = [dequantize_mxfp4(qag.fprop_operand(s, layer, torch.bfloat16)) for s in w.split(rows)]
            assert not torch.equal(torch.cat(parts), dequantize_mxfp4(whole))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("modes,scale_mode", [(layer_modes(0), "even"), (layer_modes(1), "even"),
                                              (layer_modes(5), "even"),
                                              # plain MXFP4's tiles take the layer's other scale rule too
                                              (layer_modes(0), "rceil"), (layer_modes(0), "ceil")])
def test_a_layer_multiplies_by_its_gathered_operand_as_by_its_weight(monkeypatch, modes, scale_mode, dtype):
    torch.manual_seed(1)
    # columns over four decades: blocks and tiles take different scales, which each rule rounds its own way
    w = torch.randn(64, 96) * torch.logspace(-2, 2, 96)
    x, g = torch.randn(40, 96).to(dtype), torch.randn(40, 64).to(dtype)
    runs = {}
    for kind in ("weight", "gathered"):
        layer = linear(w.to(dtype).float(), modes, scale_mode=scale_mode)
        layer.weight = torch.nn.Parameter(w.to(dtype))  # what FSDP2's ordinary gather gives the layer
        if kind == "gathered":
            q = qag.fprop_operand(w, layer, dtype)
            layer.weight = torch.nn.Parameter(qag.GatheredFpropWeight(
                q.codes, q.scale_e8m0, w.shape, dtype, layer.numerics, q.block_size))
        rec = Recorder(monkeypatch)
        xx = x.clone().requires_grad_()
        y = layer(xx)
        y.backward(g)
        runs[kind] = (rec.calls, y.detach(), xx.grad, layer.weight.grad)
        monkeypatch.undo()
    (ops_w, *out_w), (ops_g, *out_g) = runs["weight"], runs["gathered"]
    assert len(ops_w) == 3 and same_operands(ops_w, ops_g)  # fprop, dgrad, wgrad: the same bits in
    assert all(torch.equal(a, b) for a, b in zip(out_w, out_g))  # and out
    assert type(runs["gathered"][3]) is torch.Tensor and runs["gathered"][3].dtype == dtype


def test_the_gather_format_follows_the_layers_state():
    w = torch.randn(64, 64)
    layer = adahop.AdaHOPLinear.from_float(torch.nn.Linear(64, 64, bias=False), config=adahop_config("adahop_lv2"))
    assert qag.gather_format(layer, 32, 2) == (qag.HIGH_PRECISION, "calibrating: the layer observes W and runs "
                                                                   "high-precision GEMMs")
    expect = {"iht": qag.MXFP4, "mxfp4": qag.MXFP4, "bf16": qag.HIGH_PRECISION,
              "iht+oe_left": qag.HIGH_PRECISION, "iht+oe_right": qag.HIGH_PRECISION}
    for mode, fmt in expect.items():
        layer.set_modes({"fprop": mode, "dgrad": "iht", "wgrad": "iht"})
        assert qag.gather_format(layer, 32, 2)[0] == fmt, mode
    layer.set_modes({"fprop": "mxfp4", "dgrad": "iht", "wgrad": "iht"})
    # mxfp4: shards of whole 32-row tiles only (16 or 48 rows cut them: test_the_shards_operands_...)
    assert [qag.gather_format(layer, rows, 2)[0] for rows in (16, 32, 48, 64, 96)] == [
        qag.HIGH_PRECISION, qag.MXFP4, qag.HIGH_PRECISION, qag.MXFP4, qag.MXFP4]
    layer.set_modes({"fprop": "iht", "dgrad": "iht", "wgrad": "iht"})
    assert qag.gather_format(layer, 16, 4)[0] == qag.MXFP4 and qag.gather_format(layer, 64, 1)[0] == qag.HIGH_PRECISION
    plain = adahop.AdaHOPLinear.from_float(torch.nn.Linear(64, 64), config=adahop.AdaHOPConfig.from_recipe_name("bf16"))
    assert qag.gather_format(plain, 32, 2)[0] == qag.HIGH_PRECISION
    del w


def test_install_leaves_uneven_and_high_precision_layers_to_fsdp2():
    model = TinyLM(vocab=VOCAB, d=64, layers=1, heads=4, seq_len=SEQ)  # qkv 192 rows, proj 64, up 256, down 64
    adahop.convert_to_adahop_training(model, config=adahop_config())
    left = qag.install(model, world=3)
    assert set(left) == {"blocks.0.proj", "blocks.0.down", "blocks.0.up"}
    assert "do not split evenly over 3 ranks" in left["blocks.0.up"]
    assert isinstance(model.blocks[0].qkv.weight, qag.ShardedWeight)
    # a checkpoint holds the plain tensor (it loads with weights_only, without this module)
    import io

    buf = io.BytesIO()
    torch.save({"w": model.blocks[0].qkv.weight}, buf)
    loaded = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)["w"]
    assert type(loaded) in (torch.Tensor, torch.nn.Parameter)
    assert torch.equal(loaded, model.blocks[0].qkv.weight._tensor)


def test_a_gathered_weight_is_only_for_its_layers_gemms():
    q = qag.fprop_operand(torch.randn(32, 64), linear(torch.randn(32, 64), layer_modes(1)), torch.float32)
    gw = qag.GatheredFpropWeight(q.codes, q.scale_e8m0, torch.Size((32, 64)), torch.float32, "{}", 32)
    with pytest.raises(NotImplementedError, match="read only by its AdaHOP layer's GEMMs"):
        gw + 1
    layer = linear(torch.randn(32, 64), layer_modes(1))
    layer.weight = torch.nn.Parameter(gw)  # quantized for other numerics ("{}")
    with pytest.raises(RuntimeError, match="other numerics"):
        layer(torch.randn(4, 64))
    layer.weight.numerics = layer.numerics  # (the parameter: a detached twin of gw)
    with pytest.raises(ValueError, match="param_dtype, which must be the compute dtype"):
        layer(torch.randn(4, 64, dtype=torch.bfloat16))


@pytest.mark.parametrize("change, message", [
    ({"parallel": "ddp"}, "needs parallel 'fsdp2', got 'ddp'"),
    ({"adahop": adahop.AdaHOPConfig.from_recipe_name("adahop_lv2")}, "needs dgrad_weight 'forward'"),
    ({"adahop": adahop.AdaHOPConfig.from_recipe_name("bf16", dgrad_weight="forward")}, "runs no MXFP4 GEMM"),
    ({"compile": "model"}, "give --compile none"),
])
def test_bad_configurations_are_one_line_errors(change, message):
    base = dict(parallel="fsdp2", adahop=adahop_config("adahop_lv2"), device="cpu", compile="none",
                quantized_all_gather=True)
    with pytest.raises(ValueError, match=message) as e:
        TrainConfig(**{**base, **change}).validate()
    assert "\n" not in str(e.value)
    TrainConfig(**base).validate()


def test_the_cli_flag():
    from adahop.cli import build_parser, train_config

    args = build_parser().parse_args(["train", "--preset", "debug", "--device", "cpu", "--dgrad-weight", "forward",
                                      "--parallel", "fsdp2", "--compile", "none", "--quantized-all-gather"])
    with pytest.raises(ValueError, match="torchrun"):  # (not launched by torchrun here)
        train_config(args)
    args.parallel = "none"
    with pytest.raises(ValueError, match="needs parallel 'fsdp2', got 'none'"):
        train_config(args)


def test_the_config_field_is_validated_and_sets_the_weights_up_at_conversion():
    with pytest.raises(ValueError, match="needs dgrad_weight 'forward'"):
        adahop.AdaHOPConfig.from_recipe_name("adahop_lv2", quantized_all_gather=True)
    with pytest.raises(ValueError, match="runs no MXFP4 GEMM"):
        adahop.AdaHOPConfig.from_recipe_name("bf16", dgrad_weight="forward", quantized_all_gather=True)
    with pytest.raises(ValueError, match="quantized_all_gather must be a bool"):
        adahop_config(quantized_all_gather=1)
    q = adahop_config(quantized_all_gather=True)
    assert adahop.AdaHOPConfig.from_dict(q.to_dict()) == q
    plain, gathered = (TinyLM(vocab=VOCAB, d=64, layers=1, heads=4, seq_len=SEQ) for _ in range(2))
    gathered.load_state_dict(plain.state_dict())
    adahop.convert_to_adahop_training(plain, config=adahop_config())
    adahop.convert_to_adahop_training(gathered, config=q)
    assert all(isinstance(m.weight, qag.ShardedWeight) for m in adahop.adahop_layers(gathered).values())
    # the same state_dict keys and values: checkpoints load either way
    a, b = plain.state_dict(), gathered.state_dict()
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a if not k.endswith("_extra_state"))
    gathered.load_state_dict(a)
    x = torch.randint(0, VOCAB, (2, 8))
    assert torch.equal(plain(x), gathered(x))  # outside FSDP2: the layer as it was (calibrating, bf16)


def test_the_switch_may_change_on_resume_and_old_configs_resume():
    from adahop.train.trainer import resume_conflicts

    base = TrainConfig(parallel="fsdp2", adahop=adahop_config("adahop_lv2"), device="cpu", compile="none")
    on = dataclasses.replace(base, adahop=base.adahop.replace(quantized_all_gather=True))
    flag = dataclasses.replace(base, quantized_all_gather=True)
    assert on.gathers_quantized and flag.gathers_quantized and not base.gathers_quantized
    old = base.to_dict()
    del old["adahop"]["quantized_all_gather"]  # a config written before the field
    assert resume_conflicts(old, on) == resume_conflicts(on.to_dict(), flag) == resume_conflicts(old, base) == []
    on.validate()


# ---- 2 processes ----------------------------------------------------------------------------------
def tiny_model(modes=True, config=None):
    torch.manual_seed(0)
    model = TinyLM(vocab=VOCAB, d=64, layers=2, heads=4, seq_len=SEQ)
    adahop.convert_to_adahop_training(model, config=config or adahop_config())
    if modes:
        for i, layer in enumerate(sorted(adahop.adahop_layers(model).items())):
            layer[1].set_modes(layer_modes(i))
    return model


def exactness(rank, root):
    """The same model under FSDP2's ordinary gather and the quantized one, the same batch on both
    ranks (so the reduced gradient is each rank's own): 3 SGD steps each, every GEMM recorded."""
    from adahop.train.distributed import Parallel

    par = Parallel(mode="fsdp2", rank=rank, world=2, device=torch.device("cpu"))
    out = {}
    for bf16 in (False, True):
        runs = {}
        for quantized in (False, True):
            model = tiny_model()
            left = par.shard_model(model, bf16=bf16, quantized_all_gather=quantized)
            meter = qag.AllGatherMeter()
            meter.install(model)
            opt = torch.optim.SGD(model.parameters(), lr=0.5)
            rec = Recorder()
            losses, step_bytes = [], []
            batches = IndexedBatches(batch=2)
            try:
                for _ in range(3):
                    inputs, targets = next(batches)
                    before = meter.bytes
                    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                        logits = model(inputs)
                    loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
                    loss.backward()
                    step_bytes.append(meter.bytes - before)
                    opt.step()
                    opt.zero_grad()
                    losses.append(loss.item())
            finally:
                rec.stop()
            weights = {n: p.full_tensor() for n, p in model.named_parameters()}
            runs[quantized] = dict(calls=rec.calls, losses=losses, weights=weights, step_bytes=step_bytes,
                                   report=qag.gather_report(model), left=left)
        a, b = runs[False], runs[True]
        plain = adahop.adahop_layers(tiny_model(False))
        layers = sorted(plain)
        out["bf16" if bf16 else "float32"] = {
            "gemms": len(a["calls"]), "same_gemm_operands": same_operands(a["calls"], b["calls"]),
            "losses": (a["losses"], b["losses"]),
            "same_weights": all(torch.equal(a["weights"][n], b["weights"][n]) for n in a["weights"]),
            "step_bytes": (a["step_bytes"], b["step_bytes"]), "left": b["left"],
            "report": b["report"], "layers": layers, "k": {n: plain[n].in_features for n in layers},
        }
    return out


def _cycling_policy():
    """Each layer's modes at the freeze, in the order the consensus freezes them (sorted names)."""
    calls = iter(range(8))

    def policy(summary):
        return layer_modes(next(calls))

    return policy


def trainer_runs(rank, root):
    """adahop_lv2 from scratch (calibration, then FPROP_MODES) under FSDP2's ordinary and
    quantized gather, 6 steps; then the quantized run again from its checkpoint of step 3."""
    out = {}
    for name, quantized in (("ordinary", False), ("quantized", True), ("resumed", True)):
        if name == "resumed":
            if rank == 0:
                shutil.copytree(root / "quantized", root / "resumed")
                (root / "resumed" / "checkpoints" / "latest").write_text("step_000000003")
                (root / "resumed" / "summary.json").unlink()
            dist.barrier()
        q = adahop_config("adahop_lv2", calibration_steps=2).replace(policy_fn=_cycling_policy())
        cfg = TrainConfig(adahop=q, out_dir=str(root / name), steps=6, batch_size=4, seq_len=SEQ, lr=3e-3,
                          warmup_steps=2, progress=False, device="cpu", compile="none", parallel="fsdp2",
                          ckpt_every=3, quantized_all_gather=quantized)
        model = tiny_model(modes=False, config=q)
        summary = train(cfg, model=model, train_batches=IndexedBatches())
        # the run log's all-gathers of each step (rank 0's log; every rank sends as much)
        gathers = {r["step"]: r["all_gather"] for r in read_log(root / name) if "all_gather" in r}
        out[name] = {"losses": summary["losses"], "gathers": [gathers[step] for step in sorted(gathers)],
                     "report": qag.gather_report(model),
                     "modes": {f: m.modes for f, m in adahop.adahop_layers(model).items()},
                     "shard_bytes": shard_bytes(model)}
    return out


def shard_bytes(model) -> dict[str, int]:
    """The bytes of this rank's parameter shards: the blocks' and the root group's."""
    out = {"blocks": 0, "root": 0}
    for name, p in model.named_parameters():
        out["blocks" if name.startswith("blocks.") else "root"] += p.to_local().numel() * p.element_size()
    return out


class WithUnevenLayer(torch.nn.Module):
    """The tiny model and, after its head, a converted layer of 65 rows (33 and 32 over 2 ranks)."""

    def __init__(self, config):
        super().__init__()
        torch.manual_seed(0)
        self.lm = TinyLM(vocab=VOCAB, d=64, layers=2, heads=4, seq_len=SEQ)
        self.odd = torch.nn.Linear(VOCAB, 65, bias=False)
        adahop.convert_to_adahop_training(self, config=config)

    def forward(self, x):
        return self.odd(self.lm(x))


def config_field(rank, root):
    """A loop of one's own under FSDP2 (``fully_shard`` per block, then the model), with the model
    converted with ``AdaHOPConfig(quantized_all_gather=True)`` and nothing else, against the same
    without the field: 4 SGD steps, the same batch on both ranks, the modes of the layers moved on
    by one after step 2 (formats switch: the weights find their FSDP2 parameters themselves)."""
    from torch.distributed.fsdp import fully_shard

    runs = {}
    for field in (False, True):
        model = WithUnevenLayer(adahop_config().replace(quantized_all_gather=field))
        layers = adahop.adahop_layers(model)
        names = sorted(layers)
        for i, fqn in enumerate(names):
            layers[fqn].set_modes(layer_modes(i % 8))
        for block in model.lm.blocks:
            fully_shard(block)
        fully_shard(model)
        meter = qag.AllGatherMeter()
        meter.install(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        rec = Recorder()
        losses, formats = [], []
        batches = IndexedBatches(batch=2)
        try:
            for step in range(4):
                if step == 2:
                    for i, fqn in enumerate(names):
                        layers[fqn].set_modes(layer_modes((i + 1) % 8))
                inputs, targets = next(batches)
                loss = torch.nn.functional.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
                loss.backward()
                formats.append({f: v["format"] for f, v in qag.gather_report(model).items()})
                if step == 3:  # (the dampening reads whole weights: refused on shards)
                    try:
                        add_dampening_grad(model, 0.1)
                        dampening = None
                    except ValueError as e:
                        dampening = str(e)
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
        finally:
            rec.stop()
        runs[field] = {"losses": losses, "formats": formats, "bytes": meter.bytes, "calls": rec.calls,
                       "weights": {n: p.full_tensor() for n, p in model.named_parameters()},
                       "report": qag.gather_report(model), "dampening": dampening}
    a, b = runs[False], runs[True]
    return {"names": names, "losses": (a["losses"], b["losses"]), "formats": b["formats"], "report": b["report"],
            "bytes": (a["bytes"], b["bytes"]), "same_gemm_operands": same_operands(a["calls"], b["calls"]),
            "same_weights": all(torch.equal(a["weights"][n], b["weights"][n]) for n in a["weights"]),
            "ordinary_report": a["report"], "dampening": b["dampening"]}


def _entry(rank, world, port, root):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        result = {"exactness": exactness(rank, Path(root)), "trainer": trainer_runs(rank, Path(root)),
                  "config_field": config_field(rank, Path(root))}
        Path(root, f"result.{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()
    exit_rank()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("qag")
    mp.start_processes(_entry, args=(2, _free_port(), str(root)), nprocs=2, start_method="spawn")
    return [json.loads(Path(root, f"result.{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("dtype", ["float32", "bf16"])
def test_the_quantized_gather_feeds_the_gemms_the_ordinary_gathers_bits(ranks, dtype):
    for r in ranks:
        e = r["exactness"][dtype]
        assert e["gemms"] == 3 * (3 * 8 - 1)  # 3 steps, 3 GEMMs of 8 layers, one fprop in bf16
        assert e["same_gemm_operands"] and e["same_weights"] and e["left"] == {}
        assert e["losses"][0] == e["losses"][1]
        formats = {f: v["format"] for f, v in e["report"].items()}
        assert formats == {f: qag.MXFP4 if i in MX_LAYERS else qag.HIGH_PRECISION for i, f in enumerate(e["layers"])}


def test_the_bytes_each_all_gather_sends(ranks):
    e = ranks[0]["exactness"]["bf16"]
    ordinary, quantized = e["step_bytes"]
    assert len(set(ordinary)) == len(set(quantized)) == 1  # the same every step
    # per layer: its weight's share of what this rank sends, per gather (forward and backward)
    for i, fqn in enumerate(e["layers"]):
        per = e["report"][fqn]["gathers"]
        fmt = qag.MXFP4 if i in MX_LAYERS else qag.HIGH_PRECISION
        count, sent = per[fmt]["count"], per[fmt]["bytes"]
        assert set(per) == {fmt} and count == 6  # 3 steps, a gather for the forward and one for the backward
        rows, k = {"qkv": 96, "proj": 32, "up": 128, "down": 32}[fqn.split(".")[-1]], e["k"][fqn]
        bf16 = rows * k * 2
        assert sent // count == (rows * (k // 2 + k // 32) if fmt == qag.MXFP4 else bf16)
    saved = sum(e["report"][f]["gathers"][qag.MXFP4]["bytes"] for i, f in enumerate(e["layers"]) if i in MX_LAYERS)
    full = sum({"qkv": 96, "proj": 32, "up": 128, "down": 32}[f.split(".")[-1]] * e["k"][f] * 2 * 6
               for i, f in enumerate(e["layers"]) if i in MX_LAYERS)
    assert saved * 16 == full * 4.25  # exactly 4.25 bits a value for the MXFP4 layers (K a multiple of 32)
    # what the collectives carry (norms, embeddings and the high-precision layers included)
    assert 3 * (ordinary[0] - quantized[0]) == full - saved
    print(f"\nper step and rank: {ordinary[0]} bytes gathered in bf16, {quantized[0]} with the quantized gather "
          f"({quantized[0] / ordinary[0]:.3f}); its MXFP4 layers {saved // 3} bytes, {saved / full:.4f} of bf16's")


def test_through_the_trainer_the_losses_are_the_ordinary_gathers(ranks):
    for r in ranks:
        t = r["trainer"]
        assert t["quantized"]["losses"] == t["ordinary"]["losses"] and len(t["ordinary"]["losses"]) == 6
        assert t["quantized"]["modes"] == t["ordinary"]["modes"]
        # calibration gathered bf16 (step 1: forward and backward), then each layer its format
        report = t["quantized"]["report"]
        for i, fqn in enumerate(sorted(report)):
            gathers = report[fqn]["gathers"]
            assert gathers[qag.HIGH_PRECISION]["count"] == (2 if i in MX_LAYERS else 12)
            assert gathers.get(qag.MXFP4, {"count": 0})["count"] == (10 if i in MX_LAYERS else 0)
        # the run log's bytes of each step's all-gathers
        ordinary, quantized = ([g["bytes"] for g in t[name]["gathers"]] for name in ("ordinary", "quantized"))
        assert len(ordinary) == len(quantized) == 6 and len(set(ordinary)) == 1
        assert quantized[0] == ordinary[0]  # step 1 calibrates: bf16 gathers
        assert len(set(quantized[1:])) == 1 and quantized[1] < ordinary[1]
        # the saving is the MXFP4 layers': each step 2 gathers (forward, backward) of their shards,
        # float32 in step 1 (4 bytes a value), then MXFP4 (4.25 bits a value: K = 64, no padding)
        mx = [f for i, f in enumerate(sorted(report)) if i in MX_LAYERS]
        float32 = sum(report[f]["gathers"][qag.HIGH_PRECISION]["bytes"] for f in mx)
        mxfp4 = sum(report[f]["gathers"][qag.MXFP4]["bytes"] for f in mx) // 5  # steps 2-6
        assert mxfp4 * 32 == float32 * 4.25
        assert ordinary[1] - quantized[1] == float32 - mxfp4
        # the ordinary gather sends each block's parameter shards (float32 on the CPU) twice a
        # step, the root group's (embedding, final norm, head) once: kept unsharded for the backward
        shards = t["ordinary"]["shard_bytes"]
        assert ordinary[0] == 2 * shards["blocks"] + shards["root"]
        assert {g["gathers"] for g in t["ordinary"]["gathers"]} == {2 * 2 + 1}
        # resumed at step 3 (its log kept to step 3): the same gathers after it as the run it resumes
        assert t["resumed"]["gathers"] == t["quantized"]["gathers"]
        # resumed at step 3 from the quantized run's checkpoint: the same losses
        assert t["resumed"]["losses"] == t["quantized"]["losses"][3:]


def test_the_config_field_alone_gathers_quantized_under_fsdp2(ranks):
    """``AdaHOPConfig(quantized_all_gather=True)`` at conversion, then FSDP2's own ``fully_shard``:
    each layer whose fprop allows it is gathered in MXFP4 (the 65-row layer, uneven over 2 ranks,
    in high precision, padded), its switch follows the modes, and every GEMM gets the ordinary
    gather's operands: the same losses and weights, bit for bit, with fewer bytes gathered."""
    for r in ranks:
        c = r["config_field"]
        assert c["ordinary_report"] == {} and c["losses"][0] == c["losses"][1]
        assert c["same_gemm_operands"] and c["same_weights"] and c["bytes"][1] < c["bytes"][0]
        odd = c["names"].index("odd")
        for step, shift in ((0, 0), (1, 0), (2, 1), (3, 1)):
            expect = {f: qag.HIGH_PRECISION if f == "odd" or (i + shift) % 8 not in MX_LAYERS else qag.MXFP4
                      for i, f in enumerate(c["names"])}
            assert c["formats"][step] == expect, step
        assert "65 rows do not split evenly over 2 ranks" in c["report"]["odd"]["why"] and odd == 8
        # both formats gathered by the layers that switched
        assert any(set(v["gathers"]) == {qag.MXFP4, qag.HIGH_PRECISION} for v in c["report"].values())
        assert "holds an FSDP2 shard" in c["dampening"]


def test_fsdp_param_groups_of_either_torch():
    """FSDP2 keeps its parameter groups as a list from torch 2.13 and as one group (or None)
    before, e.g. in torch 2.11, the GPU machines': ``attach`` reads both."""
    from types import SimpleNamespace

    from adahop.quantized_all_gather import _param_groups

    a, b = object(), object()
    assert _param_groups(SimpleNamespace(_fsdp_param_groups=[a, b])) == [a, b]
    assert _param_groups(SimpleNamespace(_fsdp_param_group=a)) == [a]
    assert _param_groups(SimpleNamespace(_fsdp_param_group=None)) == []
