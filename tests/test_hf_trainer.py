"""The Hugging Face Trainer with adahop (adahop.hf_trainer): a converted tiny random model trained by
``transformers.Trainer`` with gradient accumulation and bf16 autocast on the CPU, calibrated in the
Trainer's own steps, its BF16 phase switched by ``AdaHOPCallback``, its checkpoints reloaded
with their modes and resumed. Skipped where transformers or accelerate is not installed."""

import importlib.util
import json
import os
import shutil
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import adahop  # noqa: E402
from adahop import hf  # noqa: E402
from adahop.hf_trainer import STATE_FILE, AdaHOPCallback  # noqa: E402

from rank_exit import exit_rank  # noqa: E402

VOCAB, SEQ = 64, 32
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=SEQ)
FAMILIES = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
            "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}
STEPS, GRAD_ACCUM, CALIBRATION = 10, 2, 3
# (a checkpoint in the middle of the calibration says so: adahop.hf.from_pretrained of it calibrates afresh)
MID_CALIBRATION = pytest.mark.filterwarnings("ignore:the model is still calibrating:UserWarning")


class Counting(torch.utils.data.Dataset):
    """Rows that count up by a random stride from a random start (mod VOCAB): learnable."""

    def __init__(self, n=80):
        g = torch.Generator().manual_seed(0)
        start, stride = torch.randint(0, VOCAB, (n, 1), generator=g), torch.randint(1, 4, (n, 1), generator=g)
        self.rows = (start + stride * torch.arange(SEQ)) % VOCAB

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def converted(kind="llama", recipe="adahop_lv2_tail"):
    torch.manual_seed(0)
    config_cls, model_cls = FAMILIES[kind]
    model = model_cls(config_cls(**SMALL))
    r = adahop.recipe(recipe, calibration_steps=CALIBRATION, backend="reference")
    adahop.convert_to_adahop_training(model, config=r.config.with_gemm_settings(oe_k=4))
    return model, r


def trainer(model, out, callback, save_steps=5, max_steps=STEPS, **kwargs):
    args = transformers.TrainingArguments(**{
        "output_dir": str(out), "max_steps": max_steps, "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": GRAD_ACCUM, "learning_rate": 3e-3, "bf16": True, "use_cpu": True,
        "logging_steps": 2, "save_steps": save_steps, "report_to": [], "disable_tqdm": True, "seed": 0, **kwargs})
    return transformers.Trainer(model=model, args=args, train_dataset=Counting(), callbacks=[callback])


def layer_states(model):
    return {name: {k: v for k, v in layer.get_extra_state().items()}
            for name, layer in adahop.adahop_layers(model).items()}


def test_the_trainer_calibrates_switches_the_phase_and_saves_checkpoints_with_modes(tmp_path, kind="llama"):
    model, recipe = converted(kind)
    calls = []  # per training forward of one layer: (calibrating, autocast on)
    probe = model.model.layers[0].mlp.up_proj
    probe.register_forward_pre_hook(lambda mod, args: calls.append((mod.calibrating, torch.is_autocast_enabled("cpu")))
                                    if mod.training and torch.is_grad_enabled() else None)
    callback = AdaHOPCallback(recipe.schedule)
    trainer(model, tmp_path, callback).train()

    # every micro-batch is a forward and backward: 3 calibration passes, so the layers froze after
    # the first micro-batch of the second step, and that step's second micro-batch ran frozen modes
    assert calls == [(True, True)] * CALIBRATION + [(False, True)] * (STEPS * GRAD_ACCUM - CALIBRATION)
    layers = adahop.adahop_layers(model)
    assert all(layer.calibration.steps == CALIBRATION for layer in layers.values())
    assert all(layer.calls == STEPS * GRAD_ACCUM for layer in layers.values())  # one SR call per micro-batch
    assert callback.calibrated_at == 2  # ceil(3 passes / 2 per step)
    # adahop_lv2_tail: fprop BF16 once floor(0.82 * 10) = 8 steps are done
    assert callback.switched_at == recipe.schedule.switch_step(STEPS) == 8
    assert all(layer.modes["fprop"] == "bf16" for layer in layers.values())
    logs = {r["step"]: r for r in model_logs(trainer_state(tmp_path, STEPS))}
    assert logs[2]["adahop/calibrating_layers"] == 0 and logs[8]["adahop/modes/fprop/iht"] == len(layers)
    assert logs[10]["adahop/modes/fprop/bf16"] == len(layers) and "adahop/modes/fprop/iht" not in logs[10]

    # the Trainer's checkpoints load back converted with the modes of their step
    _, model_cls = FAMILIES[kind]
    at_5 = hf.from_pretrained(model_cls, tmp_path / "checkpoint-5")
    assert all(layer.modes["fprop"] == "iht" for layer in adahop.adahop_layers(at_5).values())
    at_10 = hf.from_pretrained(model_cls, tmp_path / "checkpoint-10")
    for name, layer in adahop.adahop_layers(at_10).items():
        assert (layer.modes, layer.patterns) == (layers[name].modes, layers[name].patterns), name
    for name, t in hf.tensor_state_dict(model).items():
        assert torch.equal(t, at_10.state_dict()[name]), name
    saved = json.loads((tmp_path / "checkpoint-10" / hf.MODES_FILE).read_text())
    assert {name: entry["fprop"] for name, entry in saved.items()} == {name: "bf16" for name in layers}


def trainer_state(out, step):
    return json.loads((Path(out) / f"checkpoint-{step}" / "trainer_state.json").read_text())


def model_logs(state):
    return [r for r in state["log_history"] if "loss" in r]


@MID_CALIBRATION
def test_a_resumed_run_ends_as_the_uninterrupted_one(tmp_path):
    """(Qwen2: the other family, with biases on q, k, v.)"""
    model, recipe = converted("qwen2")
    trainer(model, tmp_path / "a", AdaHOPCallback(recipe.schedule), save_steps=1).train()
    for resume_at in (1, 5):  # 1: in the middle of the calibration (2 of 3 passes); 5: frozen
        at = json.loads((tmp_path / "a" / f"checkpoint-{resume_at}" / STATE_FILE).read_text())["layers"]
        assert all((entry["modes"] is None) == (resume_at == 1) for entry in at.values())
        resumed, _ = converted("qwen2")
        out = tmp_path / f"b{resume_at}"
        shutil.copytree(tmp_path / "a" / f"checkpoint-{resume_at}", out / f"checkpoint-{resume_at}")
        trainer(resumed, out, AdaHOPCallback(recipe.schedule), save_steps=STEPS).train(resume_from_checkpoint=True)
        assert layer_states(resumed) == layer_states(model), resume_at  # modes, calibration, SR counters
        for name, t in hf.tensor_state_dict(model).items():
            assert torch.equal(t, resumed.state_dict()[name]), (resume_at, name)


@MID_CALIBRATION
def test_a_resume_without_the_adahop_state_is_refused_while_calibrating(tmp_path):
    model, recipe = converted()
    trainer(model, tmp_path, AdaHOPCallback(), save_steps=1, max_steps=1).train()  # (no schedule: one step)
    (tmp_path / "checkpoint-1" / STATE_FILE).unlink()
    fresh, _ = converted()
    with pytest.raises(ValueError, match="calibrate afresh in the middle of the run"):
        trainer(fresh, tmp_path, AdaHOPCallback(recipe.schedule)).train(resume_from_checkpoint=True)


@MID_CALIBRATION
def test_a_checkpoint_named_in_the_arguments_is_resumed_from_where_it_lies(tmp_path):
    model, recipe = converted()
    trainer(model, tmp_path / "a", AdaHOPCallback(), save_steps=1, max_steps=1).train()  # (mid-calibration)
    elsewhere = tmp_path / "kept"
    shutil.move(tmp_path / "a" / "checkpoint-1", elsewhere)
    fresh, _ = converted()
    t = trainer(fresh, tmp_path / "b", AdaHOPCallback(), max_steps=2, resume_from_checkpoint=str(elsewhere))
    t.train(resume_from_checkpoint=str(elsewhere))
    assert all(layer.calibration.steps == CALIBRATION and not layer.calibrating  # 2 passes restored, 1 more
               for layer in adahop.adahop_layers(fresh).values())


def test_mistakes_are_refused_with_a_clear_error(tmp_path):
    torch.manual_seed(0)
    plain = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL))
    with pytest.raises(ValueError, match="converted before the Trainer is built"):
        trainer(plain, tmp_path, AdaHOPCallback())
    with pytest.raises(ValueError, match="PrecisionSchedule"):
        AdaHOPCallback("adahop_lv2_tail")
    model, recipe = converted()
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    with pytest.raises(ValueError, match="gradient checkpointing"):
        trainer(model, tmp_path, AdaHOPCallback(recipe.schedule)).train()
    with pytest.raises(ValueError, match="DataParallel"):  # (several GPUs in one process: no GPU here to make one)
        AdaHOPCallback._check_args(type("Args", (), dict(n_gpu=2, world_size=1, fsdp="", deepspeed=None,
                                                         gradient_checkpointing=False))(), plain)
    model, recipe = converted()
    early = adahop.PrecisionSchedule(bf16_phase_start=0.1, bf16_phase_gemms=("fprop",))  # after step 1 of 10
    with pytest.raises(ValueError, match="before the calibration ends"):
        trainer(model, tmp_path, AdaHOPCallback(early)).train()


def test_the_example_runs(capsys, tmp_path):
    path = Path(__file__).resolve().parents[1] / "examples" / "hf_trainer.py"
    spec = importlib.util.spec_from_file_location("hf_trainer_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.main(["--steps", "6", "--calibration-steps", "3", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "calibrated after step 2; BF16 phase from step 4" in out  # floor(0.82 * 6) = 4
    assert "checkpoint-6 reloaded with the same modes: True" in out
    assert "model.layers.0.self_attn.q_proj  fprop=bf16" in out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- DDP: 2 gloo processes, the environment torchrun gives (accelerate reads it) ------------------------
def _ddp_entry(rank, world, port, root):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    model, recipe = converted()
    result = {}
    try:
        trainer(model, Path(root) / "refused", AdaHOPCallback(recipe.schedule), max_steps=4).train()
    except ValueError as e:
        result["refused"] = str(e)
    model, recipe = converted()
    callback = AdaHOPCallback(recipe.schedule)
    t = trainer(model, Path(root) / "run", callback, max_steps=4, ddp_broadcast_buffers=False,
                per_device_train_batch_size=2)
    t.train()
    result.update(wrapped=type(t.model_wrapped).__name__, calibrated_at=callback.calibrated_at,
                  layers=layer_states(model))
    Path(root, f"result.{rank}.json").write_text(json.dumps(result))
    torch.distributed.destroy_process_group()
    exit_rank()


def test_under_ddp_the_ranks_merge_their_calibration_and_draw_their_own_rounding(tmp_path):
    mp.start_processes(_ddp_entry, args=(2, _free_port(), str(tmp_path)), nprocs=2, start_method="spawn")
    results = [json.loads((tmp_path / f"result.{r}.json").read_text()) for r in range(2)]
    for r in results:
        assert r["wrapped"] == "DistributedDataParallel"
        assert "ddp_broadcast_buffers=False" in r["refused"]
        # each pass adds both ranks' observations: 2 x 2 >= 3 in the first step (one process: the second)
        assert r["calibrated_at"] == 1
        assert all(layer["calibration"]["g"]["votes"] and sum(layer["calibration"]["g"]["votes"].values()) == 4
                   for layer in r["layers"].values())
    a, b = (r["layers"] for r in results)
    frozen = [{n: (x["modes"], x["patterns"]) for n, x in layers.items()} for layers in (a, b)]
    assert frozen[0] == frozen[1]  # the same modes and patterns on both ranks
    # 8 passes a rank: rank r draws the calls r, r + 2, ..., r + 14, its counter then r + 15
    assert {x["calls"] for x in a.values()} == {15} and {x["calls"] for x in b.values()} == {16}
